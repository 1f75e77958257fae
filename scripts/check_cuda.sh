#!/usr/bin/env bash
# The CUDA checks, on a machine with an NVIDIA GPU and a CUDA build of torch (a session's device
# machine, say), in one run: build torchmha against the torch there, run the tests that take a CUDA
# device, PyTorch's own test_multihead_attention.py with torchmha swapped in (when TORCH_MHA_TESTS
# names a copy of it: it is not part of this project), and benchmarks/run.py's cases on CUDA, one
# case at a time. The build is tried with torch's CMake package (where a CUDA toolkit is found), then,
# if errors fail there, without it. Each stage has its own time limit and the whole run ends by DEADLINE seconds, so a
# stage that hangs leaves the later ones their time and the logs are always written.
#
#   OUT=dir DEADLINE=540 TORCH_MHA_TESTS=path/test_multihead_attention.py scripts/check_cuda.sh
#
# Writes under $OUT (default build/cuda-check): env.txt, build.log, tests.log, torch_mha.log,
# bench.md (each case's table) and bench.jsonl (each case's rows).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-build/cuda-check}
PYTHON=${PYTHON:-python3}
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
# limit SECONDS CMD...: runs CMD for at most SECONDS, and never past the deadline.
limit() {
  local s=$1; shift
  local left=$(( DEADLINE - $(elapsed) ))
  (( left < s )) && s=$left
  (( s > 5 )) || { echo "(skipped: deadline)"; return 124; }
  timeout --kill-after=5 "$s" "$@"
}
stage() { echo "== $1 (at $(elapsed)s)"; }
export PYTHONUNBUFFERED=1 TORCHMHA_HYPOTHESIS=dev
# For CMakePresets.json (as the Makefile sets them), and this tree's package on the path.
export TORCHMHA_PYTHON=$(command -v "$PYTHON")
export TORCH_CMAKE_PREFIX_PATH=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

stage "machine" | tee "$OUT/env.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nvcc --version | tail -1; c++ --version | head -1; cmake --version | head -1
  echo "cores $(nproc)"
  env | grep -E '^(LDFLAGS|CXXFLAGS|CFLAGS|CPPFLAGS|CXX|CC|LIBRARY_PATH)=' || echo "no compiler or linker flags in the environment"
} >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# CMakeLists.txt refuses a static C++ runtime; an environment that asks for one is said and left out.
for v in LDFLAGS CXXFLAGS; do
  if [[ "${!v:-}" == *-static-libstdc++* ]]; then
    echo "$v asks for -static-libstdc++, which torchmha's configure refuses: left out for this check" | tee -a "$OUT/env.txt"
    export "$v=${!v//-static-libstdc++/}"
  fi
done

# build MODE: the library and _C in build/cuda-MODE with TORCHMHA_CUDA_TOOLKIT_MODE=MODE (AUTO: torch's
# CMake package where a toolkit it accepts is found; OFF: torch's libraries, as
# torch.utils.cpp_extension links a CPU extension), put beside the package's sources.
build() {
  stage "build, toolkit mode $1" | tee -a "$OUT/build.log"
  lib=build/cuda-$1
  cmake --preset default -B "$lib" -DTORCHMHA_BUILD_TESTS=OFF -DTORCHMHA_BUILD_BENCHMARKS=OFF \
    -DTORCHMHA_CUDA_TOOLKIT_MODE="$1" >> "$OUT/build.log" 2>&1 || return 1
  limit 300 cmake --build "$lib" --target _C -j "$(nproc)" >> "$OUT/build.log" 2>&1 || return 1
  cp "$lib"/_C*.so "$lib"/libtorchmha.so "$lib"/_build_info.py python/torchmha/
  "$PYTHON" -c "import torchmha, json; print(json.dumps(torchmha.build_info()))" 2>&1 | tee -a "$OUT/build.log"
}
# What the library was linked with, and whether it holds compiled parts of the C++ standard library
# (a copy that is not the process's own libstdc++ breaks every message that formats a number).
link_facts() {
  echo "NEEDED: $(readelf -d "$lib"/libtorchmha.so | grep -o 'Shared library: \[[^]]*\]' | tr -d '[]' | sed 's/Shared library: //' | tr '\n' ' ')"
  echo "libstdc++ code defined in libtorchmha.so: $(nm -C --defined-only "$lib"/libtorchmha.so | grep -c 'std::ostream::_M_insert')"
  command -v ninja > /dev/null && ninja -C "$lib" -t commands libtorchmha.so | tail -n 1 | tr ' ' '\n' | grep -E '^-l|\.(a|so)|static' | tr '\n' ' '
  echo
}
# An error through torch.ops whose message formats numbers: AssertionError, as torch raises.
errors_work() {
  timeout 60 "$PYTHON" -c "
import torch, torchmha
try:
    torchmha.MultiheadAttention(4, 4)(torch.randn(4, 4, 4), torch.randn(3, 3), torch.randn(4, 4, 4))
except AssertionError as e:
    assert 'expected \`key\` and \`value\` to be 3-D but found 2-D and 3-D' in str(e), str(e)
    print('an error with numbers in its message: AssertionError, as torch')
else:
    raise SystemExit('no error raised')
"
}
built=""
for mode in AUTO OFF; do
  if build "$mode"; then
    link_facts | tee -a "$OUT/build.log"
    if errors_work >> "$OUT/build.log" 2>&1; then built=$mode; break; fi
    echo "toolkit mode $mode: the error check failed (exit $?)" | tee -a "$OUT/build.log"
  fi
done
tail -n 5 "$OUT/build.log"
[[ -n $built ]] || { echo "no build passed the error check: see $OUT/build.log"; exit 1; }

stage "tests on CUDA" | tee "$OUT/tests.log"
limit 150 "$PYTHON" -m pytest tests/python/test_cuda.py tests/python/test_kv_cache.py -k "cuda" \
  -q -rs -p no:cacheprovider >> "$OUT/tests.log" 2>&1
echo "exit $?" >> "$OUT/tests.log"
stage "bad input (torch's exception types and messages)" | tee -a "$OUT/tests.log"
limit 150 "$PYTHON" -m pytest tests/python/test_bad_input.py -q -p no:cacheprovider >> "$OUT/tests.log" 2>&1
echo "exit $?" >> "$OUT/tests.log"; tail -n 15 "$OUT/tests.log"

if [[ -n "${TORCH_MHA_TESTS:-}" ]]; then
  # torch's own file, as it is and with torchmha.MultiheadAttention in torch.nn's place (the file
  # imports it from torch.nn), so that a failure of torch's own shows up in both.
  for swap in 0 1; do
    stage "PyTorch's test_multihead_attention.py, torchmha swapped in: $swap" | tee -a "$OUT/torch_mha.log"
    limit 150 "$PYTHON" - "$TORCH_MHA_TESTS" "$swap" >> "$OUT/torch_mha.log" 2>&1 <<'EOF'
import sys
import pytest
import torch
import torchmha
path, swap = sys.argv[1], sys.argv[2] == "1"
if swap:
    torch.nn.MultiheadAttention = torchmha.MultiheadAttention
sys.exit(pytest.main([path, "-q", "-rfs", "-p", "no:cacheprovider", "--tb=line"]))
EOF
    echo "exit $?" >> "$OUT/torch_mha.log"
  done
  grep -E "passed|failed|^FAILED|^exit" "$OUT/torch_mha.log"
fi

stage "benchmarks on CUDA, one case at a time" | tee "$OUT/bench.md"
cases=$("$PYTHON" -c "import sys; sys.path.insert(0, 'benchmarks'); import run; print(' '.join(run.CASES))" 2>/dev/null) \
  || { echo "benchmarks/run.py's cases could not be listed (import run)" | tee -a "$OUT/bench.md"; cases=""; }
: > "$OUT/bench.jsonl"
for name in $cases; do
  [[ $name == cpp ]] && continue  # needs build/bench_cpp, which build-python does not build
  echo "### $name (at $(elapsed)s)" >> "$OUT/bench.md"
  rm -f benchmarks/results/cuda_partial.json
  limit 150 "$PYTHON" benchmarks/run.py --device cuda --quick --cases "$name" > "$OUT/case.log" 2>&1
  code=$?
  if [[ -f benchmarks/results/cuda_partial.json ]]; then
    cat benchmarks/results/cuda_partial.md >> "$OUT/bench.md"
    "$PYTHON" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))" \
      benchmarks/results/cuda_partial.json >> "$OUT/bench.jsonl"
  else
    echo "exit $code" >> "$OUT/bench.md"; tail -n 15 "$OUT/case.log" >> "$OUT/bench.md"
  fi
  echo "$name: exit $code (at $(elapsed)s)"
done
rm -f "$OUT/case.log"
stage "done"
