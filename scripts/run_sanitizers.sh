#!/usr/bin/env bash
# Builds the C++ library and GoogleTest suite under AddressSanitizer+UndefinedBehaviorSanitizer (with
# LeakSanitizer) and under ThreadSanitizer (CMakePresets.json: asan, tsan; build-asan/, build-tsan/),
# and runs the suites. Any sanitizer report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export TORCH_CMAKE_PREFIX_PATH=${TORCH_CMAKE_PREFIX_PATH:-$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')}
export TORCHMHA_PYTHON=${TORCHMHA_PYTHON:-$(command -v "$PYTHON")}
here=$(pwd)

run_suite() {  # preset, environment...
  local preset=$1; shift
  [ -f "build-$preset/CMakeCache.txt" ] || cmake --preset "$preset"
  cmake --build --preset "$preset" -j "$(nproc)"
  env "$@" ctest --preset "$preset"
}

run_suite asan \
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  LSAN_OPTIONS="suppressions=$here/tests/sanitizers/lsan.supp:print_suppressions=0" \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
run_suite tsan \
  TSAN_OPTIONS="suppressions=$here/tests/sanitizers/tsan.supp:halt_on_error=1:report_signal_unsafe=0" \
  OMP_NUM_THREADS=1
