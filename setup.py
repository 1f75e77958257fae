"""Builds torchmha's C++ library and Python extension with CMake, against the installed torch.

    pip install torch==<the torch you want>            # first: torchmha builds against it
    pip install --no-build-isolation .                  # or -e . for development, or the sdist

Build isolation cannot work: pip would build against another torch downloaded into a temporary
environment, and the binary would fail to load beside yours. So torch is not a build requirement,
and a build that finds no torch stops at once and says so. The wheel pins the torch it was built
against (torch==X.Y.Z, local version tag +torchX.Ycpu or +torchX.YcuNNN), and `import torchmha`
with another torch raises an ImportError that says to rebuild.

The CMake build tree is per interpreter and torch version, under setuptools' build_temp, and gets
torch's Torch_DIR explicitly, so a stale cache can never bind another torch. Tests and benchmarks
are off there. `make` sets TORCHMHA_BUILD_DIR=build instead: the development tree of the "default"
preset (CMakePresets.json), which also holds the GoogleTest binaries.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = (ROOT / "VERSION").read_text().strip()  # the one version source (CMake reads it too)

MAKING_SDIST = "sdist" in sys.argv[1:]  # the source needs no torch, and names none

# The torch releases torchmha supports, in pip's form (CMake reads the same file).
TORCH_REQUIREMENT = (ROOT / "TORCH_REQUIREMENT").read_text().strip()  # torch>=2.13,<2.16
TORCH_MIN, TORCH_BELOW = (part.lstrip("<>=") for part in TORCH_REQUIREMENT[len("torch"):].split(","))
CMAKE_MIN = (3, 18)


def release(version: str) -> tuple:
    """(2, 14) of 2.14.1+cu130, for comparing releases."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def check_build_tools() -> None:
    """Stop at once, with what was found and what is needed, before CMake runs."""
    if not (release(TORCH_MIN) <= release(torch.__version__) < release(TORCH_BELOW)):
        sys.exit(f"torchmha supports {TORCH_REQUIREMENT}, and torch {torch.__version__} is installed here. "
                 f"Install a torch in that range first (pip install '{TORCH_REQUIREMENT}').")
    cmake = shutil.which("cmake")
    if cmake is None:
        sys.exit(f"torchmha builds with CMake >= {'.'.join(map(str, CMAKE_MIN))}, and no cmake is on the PATH: "
                 "install it (pip install cmake, or your system's package).")
    found = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout.split()[2]
    if release(found) < CMAKE_MIN:
        sys.exit(f"torchmha builds with CMake >= {'.'.join(map(str, CMAKE_MIN))}, and the cmake on the PATH is {found}: "
                 "install a newer one (pip install cmake).")
    compiler = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if compiler is None or shutil.which(compiler.split()[0]) is None:
        sys.exit("torchmha needs a C++ compiler (C++17 for torch 2.13, C++20 from 2.14: g++ >= 10 or clang >= 10), "
                 "and none was found "
                 f"({'CXX=' + compiler if compiler else 'no c++, g++ or clang++ on the PATH'}): install one, or set CXX.")


try:
    import torch
except ImportError:
    if not MAKING_SDIST:
        sys.exit(
            "torchmha builds against the torch installed in this environment, and none is installed here.\n"
            "Install torch first, then build without build isolation:\n"
            f"    pip install '{TORCH_REQUIREMENT}'\n"
            "    pip install --no-build-isolation <path to torchmha, or its sdist>"
        )


def torch_pin_and_tag():
    """(torch==X.Y.Z of the torch built against, local version tag +torchX.Ycpu or +torchX.YcuNNN)."""
    release = torch.__version__.split("+")[0]  # 2.13.0 of 2.13.0+cpu
    major, minor = release.split(".")[:2]
    variant = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return f"torch=={release}", f"torch{major}.{minor}{variant}"


if MAKING_SDIST:
    version, requirements = VERSION, [TORCH_REQUIREMENT]
else:
    pin, tag = torch_pin_and_tag()
    version, requirements = f"{VERSION}+{tag}", [pin]  # wheels for two torches never share a name


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def _build_dir(self) -> Path:
        if "TORCHMHA_BUILD_DIR" in os.environ:  # the development tree (make)
            return Path(os.environ["TORCHMHA_BUILD_DIR"]).resolve()
        tag = f"{sys.implementation.cache_tag}-torch{torch.__version__}"
        return (Path(self.build_temp) / tag).resolve()

    def build_extension(self, ext: Extension) -> None:
        check_build_tools()
        build_dir = self._build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        own_tree = "TORCHMHA_BUILD_DIR" not in os.environ
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DTorch_DIR={Path(torch.utils.cmake_prefix_path) / 'Torch'}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DTORCHMHA_BUILD_PYTHON=ON",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TORCHMHA_BUILD_TYPE', 'Release')}",
        ]
        if own_tree:  # a user's build: no GoogleTest, no test or benchmark sources needed
            configure += ["-DTORCHMHA_BUILD_TESTS=OFF", "-DTORCHMHA_BUILD_BENCHMARKS=OFF"]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        configure += os.environ.get("TORCHMHA_CMAKE_ARGS", "").split()
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])

        # _C, the library it links and what they were built with, side by side in the package.
        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        ext_path.parent.mkdir(parents=True, exist_ok=True)
        extension = next(build_dir.glob("_C*.so"))
        beside = [build_dir / "libtorchmha.so", build_dir / "_build_info.py"]
        copies = [(extension, ext_path)] + [(src, ext_path.parent / src.name) for src in beside]
        if getattr(self, "editable_mode", False):
            # An editable install links the package sources, where _C is placed but the rest is not.
            copies += [(src, ROOT / "python" / "torchmha" / src.name) for src in beside]
        for src, dst in copies:
            if dst.exists():
                dst.unlink()  # never overwrite a library a running process may have mapped
            shutil.copy2(src, dst)
            if dst.suffix == ".so" and own_tree and shutil.which("strip"):
                subprocess.check_call(["strip", "--strip-unneeded", str(dst)])  # a release wheel carries no symbols

setup(
    name="torchmha",
    version=version,
    description="PyTorch's multi-head attention reimplemented in C++ (LibTorch), drop-in for torch.nn.MultiheadAttention",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author="The torchmha authors",
    url="https://pypi.org/project/torchmha/",
    license="BSD-3-Clause",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
    package_dir={"": "python"},
    packages=find_packages("python"),
    package_data={"torchmha": ["py.typed", "_C.pyi"]},
    ext_modules=[CMakeExtension("torchmha._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=requirements,
    extras_require={"plot": ["matplotlib"], "test": ["pytest", "hypothesis", "numpy"]},
    zip_safe=False,
)
