#!/usr/bin/env bash
# Builds flashkv with its tests and runs them all (GPU tests skip without a GPU): the C++ test
# binary, then the Python module (built in the same tree) under pytest.
# Usage: scripts/test.sh [build-dir]   (FLASHKV_CMAKE_ARGS adds configure options;
#        FLASHKV_SKIP_PYTHON=1 skips the Python part)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHKV_BUILD_TESTS=ON ${FLASHKV_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure

if [ "${FLASHKV_SKIP_PYTHON:-0}" = 1 ]; then
  exit 0
fi

# --- Python: install what is missing, build flashkv._flashkv, run pytest -------------------------
python=${PYTHON:-python3}
missing=()
for pkg in nanobind numpy pytest; do
  "$python" -c "import $pkg" 2>/dev/null || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  "$python" -m pip install -q "${missing[@]}" ||
    "$python" -m pip install -q --break-system-packages "${missing[@]}"
fi
cmake -S . -B "$build" -DFLASHKV_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$python")" >/dev/null
cmake --build "$build" -j "$(nproc)" --target _flashkv
# Exit code 5 (nothing collected) would mean the suite went missing: a failure, like any other.
status=0
PYTHONPATH="$PWD/$build/python" "$python" -m pytest -q -p no:cacheprovider python/tests || status=$?
if [ "$status" = 5 ]; then
  echo "scripts/test.sh: pytest collected no tests from python/tests" >&2
fi
exit "$status"
