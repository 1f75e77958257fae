#!/usr/bin/env bash
# Builds the libFuzzer target (clang, with the library instrumented for coverage and AddressSanitizer)
# in build-fuzz/ and fuzzes torchmha's C++ entry points for FUZZ_SECONDS (default 60). Any crash,
# unexpected exception, sanitizer report or leak fails the run; the input that caused it is kept in
# build-fuzz/ (crash-*) to reproduce with ./build-fuzz/fuzz_mha <file>.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dir=build-fuzz
prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
[ -f "$dir/CMakeCache.txt" ] || cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" \
    -DTORCHMHA_SANITIZE=fuzzer-no-link,address -DTORCHMHA_BUILD_TESTS=OFF -DTORCHMHA_BUILD_FUZZER=ON
cmake --build "$dir" --target fuzz_mha -j "$(nproc)"
mkdir -p "$dir/corpus"
cd "$dir"
ASAN_OPTIONS=detect_leaks=1 \
LSAN_OPTIONS="suppressions=$(pwd)/../tests/sanitizers/lsan.supp:print_suppressions=0" \
OMP_NUM_THREADS=1 \
  ./fuzz_mha -max_total_time="${FUZZ_SECONDS:-60}" -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 corpus
