#!/usr/bin/env bash
# Builds the C++ library and GoogleTest suite under AddressSanitizer+UndefinedBehaviorSanitizer (with
# LeakSanitizer) and under ThreadSanitizer, in build-asan/ and build-tsan/, and runs the suites.
# Any sanitizer report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
here=$(pwd)
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)

run_suite() {  # name, sanitize flags, environment...
  local dir="build-$1" sanitize=$2; shift 2
  [ -f "$dir/CMakeCache.txt" ] || cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_PREFIX_PATH="$prefix" -DTORCHMHA_SANITIZE="$sanitize" -DPython3_EXECUTABLE="$(command -v "$PYTHON")"
  cmake --build "$dir" --target torchmha_tests -j "$(nproc)"
  env "$@" ctest --test-dir "$dir" --output-on-failure --no-tests=error
}

run_suite asan address,undefined \
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  LSAN_OPTIONS="suppressions=$here/tests/sanitizers/lsan.supp:print_suppressions=0" \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
run_suite tsan thread \
  TSAN_OPTIONS="suppressions=$here/tests/sanitizers/tsan.supp:halt_on_error=1:report_signal_unsafe=0" \
  OMP_NUM_THREADS=1
