#!/usr/bin/env bash
# Builds flashkv with its tests and runs them all (GPU tests skip without a GPU).
# Usage: scripts/test.sh [build-dir]   (FLASHKV_CMAKE_ARGS adds configure options)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHKV_BUILD_TESTS=ON ${FLASHKV_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure
