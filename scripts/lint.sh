#!/usr/bin/env bash
# Lint: fails on any formatting difference, header that needs another included first, or
# clang-tidy warning.
#   format:  clang-format --dry-run -Werror (.clang-format) over every tracked C++/CUDA source and
#            header (*.cpp *.h *.cu *.cuh).
#   headers: every tracked host header (*.h outside kernels/cuda/) compiles on its own.
#   tidy:    clang-tidy (.clang-tidy) over every tracked host C++ translation unit (*.cpp:
#            library, apps, tests, benchmarks, fuzz targets, Python bindings), in parallel, with
#            the compile_commands.json of a CPU-only clang configure in the build directory; the
#            flashkv headers they include are checked with them. With nvcc present, the .cpp
#            files with CUDA-only host code again, from a CUDA-on configure (<build-dir>-cuda).
# CUDA sources (*.cu, *.cuh) are format-checked only: clang-tidy parses CUDA with its clang, and
# clang 14 (Debian's) knows CUDA only up to 11.5: it rejects sm_90a and its CUDA wrapper headers
# do not compile against CUDA 12+ headers (texture references are gone). nvcc compiles them in
# the CUDA build (scripts/test.sh with nvcc present).
# Usage: scripts/lint.sh [format|headers|tidy|all] [build-dir]   (default: all, build-lint; `all`
#        runs the three and fails if any does; CLANG_FORMAT / CLANG_CXX / CLANG_TIDY pick the
#        tools, FLASHKV_LINT_JOBS the number of processes)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
build=${2:-build-lint}
clang_format=${CLANG_FORMAT:-clang-format}
clang_tidy=${CLANG_TIDY:-clang-tidy}
clang_cxx=${CLANG_CXX:-clang++}
jobs=${FLASHKV_LINT_JOBS:-$(nproc)}

check_format() {
  local start=$SECONDS
  echo "== clang-format ($("$clang_format" --version | grep -o 'version [0-9.]*'))"
  if ! git ls-files -z '*.cpp' '*.h' '*.cu' '*.cuh' |
      xargs -0 "$clang_format" --dry-run -Werror; then
    echo "clang-format: FAILED (see above; clang-format -i FILE rewrites a file)"
    return 1
  fi
  echo "clang-format: clean ($((SECONDS - start))s)"
}

# Every tracked host header compiles on its own, so the include order (which clang-format sorts)
# never matters. The per-ISA pieces of kernels/cpu/ are checked as an AVX-512 BF16 unit includes
# them (their ISA namespace and target); the headers in kernels/cuda/ are nvcc's (left out).
check_headers() {
  local start=$SECONDS
  echo "== headers compile on their own ($clang_cxx)"
  local -a flags=(-std=c++17 -fsyntax-only -DFLASHKV_WITH_CUDA=0 -Iinclude -Ikernels/include
                  -Ireference/include -Iapps/sim -Iapps/cli -Ibench/lib -Ikernels/cpu -Itests)
  local python=${PYTHON:-python3} nb_include
  if nb_include=$("$python" -m nanobind --include_dir 2>/dev/null); then
    flags+=(-I"$nb_include" -I"$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
  fi
  local -a headers
  mapfile -t headers < <(git ls-files '*.h' ':!kernels/cuda/')
  if [ -z "$nb_include" ]; then
    echo "headers: nanobind not found for $python: python/*.h not checked (pip install nanobind)"
    mapfile -t headers < <(printf '%s\n' "${headers[@]}" | grep -v '^python/')
  fi
  local status=0
  # shellcheck disable=SC2016  # the inner script expands its own arguments
  printf '%s\0' "${headers[@]}" | xargs -0 -P "$jobs" -I{} sh -c '
    h=$1; shift
    set -- "$@" -I"$(dirname "$h")"
    case "$h" in kernels/cpu/*) set -- "$@" -DFLASHKV_CPU_ISA_NS=avx512bf16 -DFLASHKV_CPU_HAS_BF16=1 \
      -mavx2 -mfma -mf16c -mbmi -mbmi2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16;;
    esac
    printf "#include \"%s\"\n" "$h" | "$0" "$@" -x c++ - 2>&1 && exit 0
    echo "^ $h does not compile on its own"; exit 1' "$clang_cxx" {} "${flags[@]}" || status=1
  if [ "$status" != 0 ]; then
    echo "headers: FAILED (${#headers[@]} headers, $((SECONDS - start))s)"
    return 1
  fi
  echo "headers: clean (${#headers[@]} headers, $((SECONDS - start))s)"
}

# run_tidy BUILD_DIR FILES...: clang-tidy on each file with BUILD_DIR's compile_commands.json,
# in parallel; a file's diagnostics are printed together, and any warning fails the run.
run_tidy() {
  local db=$1
  shift
  # shellcheck disable=SC2016  # the inner script expands its own arguments
  printf '%s\0' "$@" | xargs -0 -P "$jobs" -n 1 sh -c '
    out=$("$0" -p "$1" --quiet --warnings-as-errors="*" "$2" 2>&1) && exit 0
    printf "%s\n" "$out" | grep -v " warnings\? \(and [0-9]* errors\? \)\?generated\.$"
    exit 1' "$clang_tidy" "$db"
}

check_tidy() {
  local start=$SECONDS
  echo "== clang-tidy ($("$clang_tidy" --version | grep -o 'version [0-9.]*'), $jobs jobs)"
  # clang, so the flags in the database are ones clang-tidy understands. CUDA off: every host
  # translation unit, the fuzz targets and (when nanobind is there) the Python module.
  local configure=(-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
                   -DFLASHKV_CUDA=OFF -DFLASHKV_BUILD_TESTS=ON -DFLASHKV_BUILD_BENCH=ON
                   -DFLASHKV_FUZZ=ON)
  local python=${PYTHON:-python3}
  if "$python" -c 'import nanobind' 2>/dev/null; then
    configure+=(-DFLASHKV_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$python")")
  else
    echo "clang-tidy: nanobind not found for $python: python/*.cpp not checked (pip install nanobind)"
    configure+=(-DFLASHKV_BUILD_PYTHON=OFF)
  fi
  cmake -S . -B "$build" -G Ninja "${configure[@]}" >/dev/null || return 1

  # Every tracked .cpp the configure compiled; a tracked .cpp missing from the database (and not
  # one of the Python bindings skipped above, nor an example project built against the installed
  # package, which clang-tidy checks with the public headers below) fails the run rather than
  # going unchecked.
  local files
  files=$("$python" - "$build/compile_commands.json" <<'EOF'
import json, os, subprocess, sys
db = {os.path.realpath(e["file"]) for e in json.load(open(sys.argv[1]))}
tracked = subprocess.run(["git", "ls-files", "*.cpp"], capture_output=True, text=True,
                         check=True).stdout.split()
# examples/ are projects of their own, built against the installed package (.ci/run); the NCCL
# communicator is built only with CUDA and NCCL (checked in the CUDA-on pass below).
missing = [f for f in tracked if os.path.realpath(f) not in db
           and not f.startswith(("python/", "examples/", "parallel/nccl/"))]
if missing:
    sys.exit("clang-tidy: not in the compile database: " + " ".join(missing))
print("\n".join(f for f in tracked if os.path.realpath(f) in db))
EOF
) || return 1
  local -a host_files cuda_files=()
  mapfile -t host_files <<<"$files"
  local status=0
  run_tidy "$build" "${host_files[@]}" || status=1
  # The example projects: their sources against the public headers alone, as a user compiles them.
  local example out
  for example in $(git ls-files 'examples/*.cpp'); do
    if ! out=$("$clang_tidy" --quiet --warnings-as-errors="*" "$example" -- -std=c++17 -Iinclude \
        -DFLASHKV_WITH_CUDA=0 2>&1); then
      printf '%s\n' "$out"
      status=1
    fi
  done

  # With nvcc present, the host code behind `#if FLASHKV_WITH_CUDA` too: the .cpp files that
  # mention it, again, from a CUDA-on configure (whose .cu files stay unchecked, as above).
  local nvcc=/usr/local/cuda/bin/nvcc
  if command -v nvcc >/dev/null; then nvcc=$(command -v nvcc); fi
  if [ -x "$nvcc" ]; then
    mapfile -t cuda_files < <(git grep -l FLASHKV_WITH_CUDA -- '*.cpp' | grep -v '^python/')
    cmake -S . -B "$build-cuda" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DFLASHKV_CUDA=ON \
      -DFLASHKV_CUDA_ARCHS=90a -DFLASHKV_BUILD_TESTS=ON -DFLASHKV_BUILD_BENCH=ON >/dev/null ||
      return 1
    # The NCCL communicator, where the configure found NCCL and so compiles it.
    local f
    for f in $(git ls-files 'parallel/nccl/*.cpp'); do
      if grep -qF "/$f\"" "$build-cuda/compile_commands.json"; then cuda_files+=("$f"); fi
    done
    run_tidy "$build-cuda" "${cuda_files[@]}" || status=1
  else
    echo "clang-tidy: no nvcc: the CUDA-only host code (#if FLASHKV_WITH_CUDA) is not checked"
  fi
  local summary="${#host_files[@]} files, ${#cuda_files[@]} of them again with CUDA on"
  if [ "$status" != 0 ]; then
    echo "clang-tidy: FAILED (see above; $summary; $((SECONDS - start))s)"
    return 1
  fi
  echo "clang-tidy: clean ($summary; $((SECONDS - start))s)"
}

case "$what" in
  format) check_format ;;
  headers) check_headers ;;
  tidy) check_tidy ;;
  all)
    status=0
    check_format || status=1
    check_headers || status=1
    check_tidy || status=1
    exit "$status"
    ;;
  *) echo "usage: scripts/lint.sh [format|headers|tidy|all] [build-dir]" >&2; exit 2 ;;
esac
