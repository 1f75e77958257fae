#!/usr/bin/env bash
# Builds the libFuzzer target (CMakePresets.json: fuzz; clang, with the library instrumented for
# coverage and AddressSanitizer, in build-fuzz/) and fuzzes torchmha's C++ entry points for
# FUZZ_SECONDS (default 60). Any crash, internal assertion, sanitizer report or leak fails the run;
# the input that caused it is kept in build-fuzz/ (crash-*) to reproduce with ./build-fuzz/fuzz_mha <file>.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export TORCH_CMAKE_PREFIX_PATH=${TORCH_CMAKE_PREFIX_PATH:-$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')}
export TORCHMHA_PYTHON=${TORCHMHA_PYTHON:-$(command -v "$PYTHON")}
dir=build-fuzz
[ -f "$dir/CMakeCache.txt" ] || cmake --preset fuzz
cmake --build --preset fuzz -j "$(nproc)"
mkdir -p "$dir/corpus"
cd "$dir"
ASAN_OPTIONS=detect_leaks=1 \
LSAN_OPTIONS="suppressions=$(pwd)/../tests/sanitizers/lsan.supp:print_suppressions=0" \
OMP_NUM_THREADS=1 \
  ./fuzz_mha -max_total_time="${FUZZ_SECONDS:-60}" -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 corpus
