#!/usr/bin/env bash
# The package as a user gets it (make test-wheel): builds the wheel and the sdist as a user would
# (no build isolation, against the installed torch), installs each into a fresh virtual environment
# that sees the system's torch, runs the Python suite against each installed package from outside
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

echo "== building the sdist and the wheel"
"$PYTHON" -m build --sdist --no-isolation --outdir "$work/dist" . > "$work/sdist.log"
"$PYTHON" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$work/linux" . > "$work/wheel.log"
# A manylinux tag: torch's libraries are excluded (they come with the torch wheel the pin names),
# libgomp too: torch ships it, and one OpenMP runtime must serve both (at::parallel_for).
"$PYTHON" -m auditwheel repair --wheel-dir "$work/dist" --exclude libtorch_python.so --exclude libtorch_cpu.so \
    --exclude libtorch.so --exclude libc10.so --exclude libtorch_cuda.so --exclude libc10_cuda.so \
    --exclude libgomp.so.1 \
    "$work"/linux/torchmha-*.whl > "$work/auditwheel.log" 2>&1
wheel=$(ls "$work"/dist/torchmha-*.whl)
sdist=$(ls "$work"/dist/torchmha-*.tar.gz)
echo "$wheel"
echo "$sdist"

venv_pythons=()
for kind in wheel sdist; do
  echo "== installing the $kind into a fresh virtual environment"
  "$PYTHON" -m venv --system-site-packages "$work/venv-$kind"
  venv_python="$work/venv-$kind/bin/python"
  artifact=$wheel; [ "$kind" = sdist ] && artifact=$sdist
  (cd "$work" && "$venv_python" -m pip install --no-build-isolation --no-deps --no-index "$artifact" > "$work/install-$kind.log")
  echo "== the Python suite against the installed $kind"
  # From outside the tree (the rootdir is the package's test folder, not the repository) so that
  # `import torchmha` finds the installed package, not the sources.
  (cd "$work" && TORCHMHA_HYPOTHESIS=dev "$venv_python" -m pytest "$root/tests/python" -q -p no:cacheprovider \
      --rootdir "$root/tests/python" -m "not slow" -W ignore::DeprecationWarning)
  venv_pythons+=("$venv_python")
done

echo "== the wheel, the sdist and the installed packages"
(IFS=:; TORCHMHA_WHEEL=$wheel TORCHMHA_SDIST=$sdist TORCHMHA_VENV_PYTHONS="${venv_pythons[*]}" \
  "$PYTHON" -m pytest "$root/tests/package" -q -p no:cacheprovider)

echo "== mypy on a typed usage of the installed wheel"
(cd "$work" && "${venv_pythons[0]}" -m mypy --warn-unused-ignores --no-incremental --follow-imports=silent \
    "$root/tests/package/typed_usage.py")
