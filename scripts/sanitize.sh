#!/usr/bin/env bash
# Builds the CPU library and tests with AddressSanitizer + UndefinedBehaviorSanitizer in a
# separate build directory and runs the whole test suite, then a short `flashkv soak` (the
# scheduler's long-run paths); any report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-asan}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHKV_CUDA=OFF \
  -DFLASHKV_SANITIZE=ON -DFLASHKV_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$(nproc)"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$build" --output-on-failure
"$build/flashkv" soak --device cpu --quiet --steps "${FLASHKV_SANITIZE_SOAK_STEPS:-1000}"
