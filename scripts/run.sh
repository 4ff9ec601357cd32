#!/usr/bin/env bash
# Builds flashkv (without the tests) and serves the default workload: on the GPU when one is
# visible, else on the CPU. Extra arguments go to `flashkv serve` (e.g. --check, --workload spec).
# Usage: scripts/run.sh [serve options]   (FLASHKV_BUILD_DIR picks the build folder, default
# build; FLASHKV_CMAKE_ARGS adds configure options)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FLASHKV_BUILD_DIR:-build}
# No tests here: a fresh machine needs no GoogleTest to run flashkv.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHKV_BUILD_TESTS=OFF ${FLASHKV_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)" --target flashkv_cli
exec "$build/flashkv" serve "$@"
