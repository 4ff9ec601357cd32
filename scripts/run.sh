#!/usr/bin/env bash
# Builds flashkv (without the tests) and serves the default workload: on the GPU when one is
# visible, else on the CPU. The CUDA kernels are built only where a GPU is visible (nvidia-smi
# lists one): without one they could not run, and they take most of the build time.
# Extra arguments go to `flashkv serve` (e.g. --check, --workload spec).
# Usage: scripts/run.sh [serve options]   (FLASHKV_BUILD_DIR picks the build folder, default
# build; FLASHKV_CMAKE_ARGS adds configure options)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FLASHKV_BUILD_DIR:-build}
cuda=OFF
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  cuda=AUTO
fi
# No tests here: a fresh machine needs no GoogleTest to run flashkv.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHKV_BUILD_TESTS=OFF \
  -DFLASHKV_CUDA="$cuda" ${FLASHKV_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)" --target flashkv_cli
exec "$build/flashkv" serve "$@"
