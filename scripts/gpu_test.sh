#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds flashkv with the CUDA kernels, runs the whole test
# suite (GPU tests included), then the GPU tests again under compute-sanitizer's memcheck,
# racecheck, initcheck and synccheck (side by side).
# Usage: scripts/gpu_test.sh [build-dir] [--no-sanitizer | --sanitizer-only]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
archs=${FLASHKV_CUDA_ARCHS:-90a}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHKV_CUDA=ON \
  -DFLASHKV_CUDA_ARCHS="$archs" ${FLASHKV_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
mode=${2:-}
[ "$mode" = "--sanitizer-only" ] || "$build/flashkv_tests" --gtest_brief=1
[ "$mode" = "--no-sanitizer" ] && exit 0
# The GPU tests under each compute-sanitizer tool, the four tools side by side (one GPU holds
# them all; the host has the cores). Every GPU test runs under memcheck, initcheck and
# synccheck; racecheck, whose shared-memory tracking is many times slower, runs the kernels' own
# suites (the backend tests call the same kernels). FLASHKV_SANITIZER_FILTER and
# FLASHKV_RACECHECK_FILTER change the tests.
filter=${FLASHKV_SANITIZER_FILTER:-'Cuda*:*cuda*:*Cuda*'}
race_filter=${FLASHKV_RACECHECK_FILTER:-'CudaDecode.*:CudaPrefill.*:CudaMerge.*:CudaKV*:CudaAppendKV.*:CudaBuildKVIndices.*'}
tools="memcheck racecheck initcheck synccheck"
for tool in $tools; do
  f=$filter
  [ "$tool" = racecheck ] && f=$race_filter
  compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    "$build/flashkv_tests" --gtest_brief=1 --gtest_filter="$f" \
    >"$build/sanitizer-$tool.log" 2>&1 &
  eval "pid_$tool=$!"
done
status=0
for tool in $tools; do
  eval "pid=\$pid_$tool"
  if wait "$pid"; then
    echo "== compute-sanitizer --tool $tool: clean"
    grep -E "ERROR SUMMARY|tests? from .* ran|PASSED" "$build/sanitizer-$tool.log" | tail -3
  else
    echo "== compute-sanitizer --tool $tool: FAILED (log: $build/sanitizer-$tool.log)"
    tail -40 "$build/sanitizer-$tool.log"
    status=1
  fi
done
exit $status
