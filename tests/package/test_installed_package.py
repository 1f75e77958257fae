"""The package as a user installs it (run by scripts/test_package.sh, not by the main suite):
the sdist, and the wheel built from it and installed in a fresh virtual environment. Paths come from the
environment: TORCHMHA_WHEEL, TORCHMHA_SDIST, TORCHMHA_VENV_PYTHONS (the venvs' interpreters,
separated by ':')."""

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

WHEEL = Path(os.environ.get("TORCHMHA_WHEEL", "missing.whl"))
SDIST = Path(os.environ.get("TORCHMHA_SDIST", "missing.tar.gz"))
VENV_PYTHONS = [p for p in os.environ.get("TORCHMHA_VENV_PYTHONS", "").split(":") if p]
TORCH_RELEASE = torch.__version__.split("+")[0]
pytestmark = pytest.mark.skipif(not WHEEL.exists(), reason="run by scripts/test_package.sh")


def test_wheel_pins_the_torch_it_was_built_against():
    major, minor = TORCH_RELEASE.split(".")[:2]
    variant = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    assert f"+torch{major}.{minor}{variant}-" in WHEEL.name, WHEEL.name
    assert re.search(r"-manylinux_2_\d+_x86_64\.whl$", WHEEL.name), f"{WHEEL.name}: not repaired to a manylinux tag"
    with zipfile.ZipFile(WHEEL) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(metadata).decode()
    requirements = re.findall(r"^Requires-Dist: (torch\b.*)$", text, re.M)
    assert requirements == [f"torch=={TORCH_RELEASE}"], requirements
    for field in ("License", "Author", "Home-page", "Description-Content-Type: text/markdown"):
        assert field in text, field


def _runpath(library: Path) -> str:
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    found = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[(.*)\]", dynamic)
    assert len(found) == 1, dynamic
    return found[0]


def test_wheel_binaries_find_only_the_package_and_torch(tmp_path):
    with zipfile.ZipFile(WHEEL) as wheel:
        names = [n for n in wheel.namelist() if n.endswith(".so")]
        wheel.extractall(tmp_path, names)
    assert {Path(n).name.split(".")[0] for n in names} == {"_C", "libtorchmha"}, names
    for name in names:
        entries = _runpath(tmp_path / name).split(":")
        assert entries == ["$ORIGIN", "$ORIGIN/../torch/lib"], (name, entries)
        symbols = subprocess.run(["readelf", "-S", str(tmp_path / name)], capture_output=True, text=True).stdout
        assert ".symtab" not in symbols, f"{name} is not stripped"


def test_sdist_holds_what_the_build_needs_and_no_build_products():
    with tarfile.open(SDIST) as sdist:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in sdist.getnames()}
    for needed in ("CMakeLists.txt", "VERSION", "TORCH_REQUIREMENT", "cmake/TorchMHAFindTorch.cmake", "LICENSE", "README.md", "setup.py", "pyproject.toml",
                   "cmake/TorchMHAConfig.cmake.in", "cmake/version.h.in", "cmake/build_info.py.in",
                   "csrc/register_ops.cpp", "csrc/core/multi_head_attention.cpp", "csrc/cpu/kernels.h",
                   "csrc/cpu/vec/decode_kernel_avx512.cpp", "csrc/common/settings.cpp",
                   "csrc/include/torchmha/torchmha.h", "python/torchmha/py.typed", "python/torchmha/_C.pyi"):
        assert needed in names, needed
    assert not [n for n in names if n.endswith(".so") or n.endswith("_build_info.py")]


@pytest.mark.parametrize("python", VENV_PYTHONS)
def test_import_with_another_torch_says_to_rebuild(python):
    code = "import torch; torch.__version__ = '0.0.1'; import torchmha"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode != 0
    assert "ImportError: torchmha" in result.stderr and "built for torch" in result.stderr, result.stderr
    assert "--no-build-isolation" in result.stderr


@pytest.mark.parametrize("python", VENV_PYTHONS)
def test_installed_package_reports_its_build(python):
    code = "import torch, torchmha; info = torchmha.build_info(); print(info['torch'] == torch.__version__, torchmha.__file__)"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    flag, location = result.stdout.split()
    assert flag == "True"
    venv = Path(python).parents[1]
    assert Path(location).is_relative_to(venv / "lib"), f"{location} is not the package installed in {venv}"


def test_build_without_torch_stops_at_once_and_says_why(tmp_path):
    # A bare environment, as pip's build isolation makes one: no torch in it.
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "bare")], check=True)
    bare = tmp_path / "bare" / "bin" / "python"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([str(bare), str(root / "setup.py"), "--version"], capture_output=True, text=True, cwd=root)
    assert result.returncode != 0
    assert "Install torch first" in result.stderr and "--no-build-isolation" in result.stderr, result.stderr


def test_a_static_cpp_runtime_stops_the_configure(tmp_path):
    """LDFLAGS=-static-libstdc++ would give libtorchmha a C++ runtime of its own, and every error
    message that formats a number would come out without it, or crash (CMakeLists.txt)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, LDFLAGS="-static-libstdc++")
    result = subprocess.run(["cmake", "-S", str(root), "-B", str(tmp_path / "build"),
                             f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
                            capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "-static-libstdc++" in result.stderr and "share torch's" in result.stderr, result.stderr
