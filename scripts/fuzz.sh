#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) and runs each for SECONDS (default 60),
# starting from the corpus kept in fuzz/corpus/<target> (new inputs go to a scratch copy), with
# the dictionary fuzz/<target>.dict when there is one. A crash fails the script and leaves the
# input as fuzz-crash-<target>-*. FLASHKV_FUZZ_TARGETS="fuzz_a fuzz_b" runs only those.
# Usage: scripts/fuzz.sh [seconds] [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=${2:-build-fuzz}
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DFLASHKV_CUDA=OFF -DFLASHKV_FUZZ=ON \
  -DFLASHKV_BUILD_TESTS=OFF -DFLASHKV_BUILD_BENCH=OFF >/dev/null
targets=${FLASHKV_FUZZ_TARGETS:-$(cd fuzz && ls fuzz_*.cpp | sed 's/\.cpp$//')}
cmake --build "$build" -j "$(nproc)" --target $targets
status=0
for t in $targets; do
  scratch=$(mktemp -d)
  [ -d "fuzz/corpus/$t" ] && cp -r "fuzz/corpus/$t/." "$scratch/"
  dict=()
  [ -f "fuzz/$t.dict" ] && dict=(-dict="fuzz/$t.dict")
  echo "== $t: ${seconds}s"
  if ! "$build/$t" "$scratch" -max_total_time="$seconds" -print_final_stats=1 ${dict[@]+"${dict[@]}"} \
      -artifact_prefix="fuzz-crash-$t-" 2>"$build/$t.log"; then
    echo "FAILED: $t (see $build/$t.log)"; tail -30 "$build/$t.log"; status=1
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$build/$t.log" || true
  grep -E "^#[0-9]+[[:space:]]+DONE" "$build/$t.log" | tail -1 || true
  rm -rf "$scratch"
done
exit $status
