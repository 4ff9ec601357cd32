#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds flashkv with the CUDA kernels, runs the whole test
# suite (GPU tests included), then the GPU tests again under compute-sanitizer's memcheck,
# racecheck, initcheck and synccheck. Usage: scripts/gpu_test.sh [build-dir] [--no-sanitizer]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
archs=${FLASHKV_CUDA_ARCHS:-90a}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHKV_CUDA=ON \
  -DFLASHKV_CUDA_ARCHS="$archs" ${FLASHKV_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$build/flashkv_tests" --gtest_brief=1
[ "${2:-}" = "--no-sanitizer" ] && exit 0
# The GPU tests under each compute-sanitizer tool (smaller filter for the slower tools).
filter=${FLASHKV_SANITIZER_FILTER:-'Cuda*:*cuda*'}
status=0
for tool in memcheck racecheck initcheck synccheck; do
  echo "== compute-sanitizer --tool $tool"
  if ! compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
      "$build/flashkv_tests" --gtest_brief=1 --gtest_filter="$filter" >"$build/sanitizer-$tool.log" 2>&1; then
    echo "FAILED: $tool"; tail -40 "$build/sanitizer-$tool.log"; status=1
  else
    grep -E "ERROR SUMMARY|tests ran|PASSED" "$build/sanitizer-$tool.log" | tail -3
  fi
done
exit $status
