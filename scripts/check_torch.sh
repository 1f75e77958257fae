#!/usr/bin/env bash
# The install check for one torch release, as a user does it (README "Install"):
#   scripts/check_torch.sh 2.14.1 [none|partial|full]
# In a fresh virtual environment of its own (build/torch-<version>/venv), `pip install torch==<version>`
# (PyPI's default Linux wheel: the CUDA build) and the test packages; then `pip install
# --no-build-isolation .` from this tree, and the quick suite (make check's selection) against the
# installed package, from outside the tree. The CUDA toolkit is what the build sees:
#   none     no toolkit: the machine's is hidden (every /usr/local/cuda*, and nvcc's folder on the PATH)
#   partial  nvcc, but no runtime headers: the toolkit's include/ is hidden
#   full     the machine's toolkit as it is
# Hiding needs root (unshare -m, for this build only). torch above pip's cap on the project's
# machines: PIP_CONSTRAINT=/dev/null scripts/check_torch.sh 2.15.0
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
version=${1:?usage: scripts/check_torch.sh TORCH_VERSION [none|partial|full]}
toolkit=${2:-none}
PYTHON=${PYTHON:-python3}
work=$root/build/torch-$version
# As a user builds it: not the development tree that make's exports point at (make test runs this
# after building build/ against another torch, and setup.py would reconfigure that tree), and no
# binaries of that tree for the suite to run.
unset TORCHMHA_BUILD_DIR TORCHMHA_PYTHON TORCH_CMAKE_PREFIX_PATH TORCHMHA_CPP_EXAMPLE TORCHMHA_DEPLOY_EXAMPLE
venv=$work/venv

echo "== torch $version, CUDA toolkit: $toolkit ($work)"
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "torch==$version" > "$work.pip.log" 2>&1 || { tail -20 "$work.pip.log"; exit 1; }
fi
"$venv/bin/python" -m pip install -q -r tests/requirements.txt setuptools wheel >> "$work.pip.log" 2>&1
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

# The folders to hide for the toolkit situation asked for: the toolkits under /usr/local (not their
# symlinks), and for none also the folder of the nvcc on the PATH (a wrapper script there, here).
toolkits=()
for dir in /usr/local/cuda*; do [ -d "$dir" ] && [ ! -L "$dir" ] && toolkits+=("$dir"); done
nvcc=$(command -v nvcc || true)
hide=()
case $toolkit in
  none)
    hide=("${toolkits[@]}")
    if [ -n "$nvcc" ]; then hide+=("$(dirname "$nvcc")"); fi
    ;;
  partial) for dir in "${toolkits[@]}"; do hide+=("$dir/include"); done ;;
  full) ;;
  *) echo "toolkit must be none, partial or full"; exit 2 ;;
esac

if [ ${#hide[@]} -gt 0 ] && [ "$(id -u)" -ne 0 ]; then
  echo "not root, so nothing can be hidden (unshare -m): building with the machine's toolkit as it is"
  hide=()
fi

# The build tree is per torch version (setup.py): a fresh one, so no earlier toolkit choice is cached.
rm -rf build/temp.*/*-torch"$version"*
build() {
  for dir in "$@"; do mount -t tmpfs none "$dir"; done
  for tool in cmake c++ "$venv/bin/python"; do
    command -v "$tool" >/dev/null || { echo "hiding the toolkit hid $tool too"; exit 1; }
  done
  "$venv/bin/python" -m pip install -v --no-build-isolation --no-deps . > "$work.build.log" 2>&1 \
    || { tail -40 "$work.build.log"; exit 1; }
}
export -f build
export venv work
if [ ${#hide[@]} -gt 0 ]; then
  echo "hidden from the build: ${hide[*]}"
  unshare -m bash -c 'build "$@"' build "${hide[@]}"
else
  build
fi
grep -o "torchmha: torch .*" "$work.build.log" | head -1 || true
(cd "$work" && "$venv/bin/python" -c "import torchmha; print('build_info', torchmha.build_info())")

echo "== the quick suite against the installed package"
(cd "$work" && "$venv/bin/python" -W error -c "import torchmha" \
  && TORCHMHA_HYPOTHESIS=dev "$venv/bin/python" -m pytest "$root/tests/python" -q -p no:cacheprovider \
     --rootdir "$root/tests/python" -m "not slow" -W ignore::DeprecationWarning)
