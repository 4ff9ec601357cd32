#!/usr/bin/env bash
# On a GPU machine: checks and times the CUDA paged decode in one go (what a lent device run
# executes). Uses prebuilt binaries in $BIN when they run there, else builds into build-dev.
#   scripts/cuda_decode_device.sh [test|sanitize|bench|sass]...   (default: all four)
# Logs and the benchmark CSV go to $OUT (default: ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
BIN=${BIN:-bin}
if ! "$BIN/flashkv_tests" --gtest_list_tests >/dev/null 2>&1; then
  echo "== prebuilt binaries do not run here; building"
  cmake -S . -B build-dev -G Ninja -DFLASHKV_CUDA_ARCHS=90a >/dev/null &&
    ninja -C build-dev flashkv_tests cuda_decode_bench > "$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"
    exit 1
  }
  BIN=build-dev
fi
steps=${*:-test sanitize bench sass}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
for step in $steps; do
  case $step in
    test)
      echo "== tests"
      "$BIN/flashkv_tests" --gtest_filter='Cuda*' 2>&1 | tee "$OUT/tests.log" | grep -E "^\[  |FAILED|Failure|error|seed=|Expected|Which is|actual" | head -80
      ;;
    sanitize)
      echo "== compute-sanitizer memcheck"
      compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/flashkv_tests" \
        --gtest_filter='CudaDecode.SoftCapWindowAndNoLse:CudaDecode.ForcedAndAutomaticSplits:CudaDecode.GraphReplayWithANewBatch:CudaDecode.LargeAndOddGroups:CudaDecode.ManyItemsPerWorker:CudaMerge.*' \
        > "$OUT/memcheck.log" 2>&1
      echo "memcheck exit $?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | head
      echo "== compute-sanitizer racecheck"
      compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/flashkv_tests" \
        --gtest_filter='CudaDecode.ManyItemsPerWorker' > "$OUT/racecheck.log" 2>&1
      echo "racecheck exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/racecheck.log" | head
      ;;
    bench)
      echo "== benchmark"
      "$BIN/cuda_decode_bench" --csv "$OUT/bench.csv" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
      ;;
    bench-small)
      for split in 128 64; do
        echo "== benchmark, small shapes, min split $split"
        "$BIN/cuda_decode_bench" --small --min-split $split 2>&1 | tail -n +3
      done
      ;;
    sass)
      cuobjdump -sass "$BIN/cuda_decode_bench" > "$OUT/all.sass" 2>/dev/null
      echo "== SASS of the bf16 D=128 decode kernel (instruction counts)"
      awk '/Function : .*decode_kernel.*Li128ELNS0_6KvKindE0ELi1E.*nv_bfloat16/{f=1;next} /Function :/{f=0} f' "$OUT/all.sass" |
        grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+[A-Z0-9_.]+' | awk '{print $2}' | sort | uniq -c | sort -rn | head -16
      echo "== SASS of the fp8 e4m3 D=128 decode kernel (instruction counts)"
      awk '/Function : .*decode_kernel.*Li128ELNS0_6KvKindE1ELi1E.*nv_bfloat16/{f=1;next} /Function :/{f=0} f' "$OUT/all.sass" |
        grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+[A-Z0-9_.]+' | awk '{print $2}' | sort | uniq -c | sort -rn | head -16
      rm -f "$OUT/all.sass"
      ;;
  esac
done
