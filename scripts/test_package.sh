#!/usr/bin/env bash
# The package as a user gets it (make test-wheel): builds the sdist, and the wheel from it, as a user
# would (no build isolation, against the installed torch), installs the wheel into a fresh virtual environment
# that sees the packages of $PYTHON's environment (its torch), runs the Python suite against the installed package from outside
# the source tree, then checks the wheel's pin, metadata and binaries, the sdist's contents, the
# ImportError with another torch, and what mypy sees (tests/package).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
root=$(pwd)
work=${PACKAGE_DIR:-$root/build/package}
rm -rf "$work"
mkdir -p "$work/dist"
unset TORCHMHA_BUILD_DIR  # a user's build: setup.py's own tree, tests and benchmarks off

echo "== building the sdist, and the wheel from it"
# The wheel is built from the sdist, as a user's `pip install <sdist>` builds it: one compile checks
# both (a build from a clone is make build's and scripts/check_torch.sh's).
"$PYTHON" -m build --sdist --no-isolation --outdir "$work/dist" . > "$work/sdist.log"
sdist=$(ls "$work"/dist/torchmha-*.tar.gz)
"$PYTHON" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$work/linux" "$sdist" > "$work/wheel.log"
# A manylinux tag: torch's libraries are excluded (they come with the torch wheel the pin names),
# libgomp too: torch ships it, and one OpenMP runtime must serve both (at::parallel_for).
"$PYTHON" -m auditwheel repair --wheel-dir "$work/dist" --exclude libtorch_python.so --exclude libtorch_cpu.so \
    --exclude libtorch.so --exclude libc10.so --exclude libtorch_cuda.so --exclude libc10_cuda.so \
    --exclude libgomp.so.1 \
    "$work"/linux/torchmha-*.whl > "$work/auditwheel.log" 2>&1
wheel=$(ls "$work"/dist/torchmha-*.whl)
echo "$wheel"
echo "$sdist"

echo "== installing the wheel into a fresh virtual environment"
"$PYTHON" -m venv --system-site-packages "$work/venv"
venv_python="$work/venv/bin/python"
# Where $PYTHON is itself a virtual environment's, --system-site-packages shows the base
# interpreter's packages, not that environment's (its torch, pytest, mypy): a .pth file adds them.
"$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
  > "$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/outer_environment.pth"
(cd "$work" && "$venv_python" -m pip install --no-build-isolation --no-deps --no-index "$wheel" > "$work/install.log")
echo "== the Python suite against the installed wheel"
# From outside the tree (the rootdir is the package's test folder, not the repository) so that
# `import torchmha` finds the installed package, not the sources.
(cd "$work" && TORCHMHA_HYPOTHESIS=dev "$venv_python" -m pytest "$root/tests/python" -q -p no:cacheprovider \
    --rootdir "$root/tests/python" -m "not slow" -W ignore::DeprecationWarning)

echo "== the wheel, the sdist and the installed packages"
(TORCHMHA_WHEEL=$wheel TORCHMHA_SDIST=$sdist TORCHMHA_VENV_PYTHONS="$venv_python" \
  "$PYTHON" -m pytest "$root/tests/package" -q -p no:cacheprovider)

echo "== mypy on a typed usage of the installed wheel"
(cd "$work" && "$venv_python" -m mypy --warn-unused-ignores --no-incremental --follow-imports=silent \
    "$root/tests/package/typed_usage.py")
