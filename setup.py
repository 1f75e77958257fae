"""Builds torchmha's C++ library and Python extension with CMake, against the installed torch.

Install with `pip install --no-build-isolation -e .` (build isolation would fetch another torch).
The CMake build tree is build/ (TORCHMHA_BUILD_DIR to change it), the tree of the "default"
preset in CMakePresets.json: it also holds the GoogleTest binaries, so `make check` and
`ctest --preset default` use it, and rebuilds are incremental.
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


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch

        build_dir = Path(os.environ.get("TORCHMHA_BUILD_DIR", ROOT / "build")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DTORCHMHA_BUILD_PYTHON=ON",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TORCHMHA_BUILD_TYPE', 'Release')}",
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        configure += os.environ.get("TORCHMHA_CMAKE_ARGS", "").split()
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])

        # _C and the library it links, side by side in the package (RPATH $ORIGIN).
        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        ext_path.parent.mkdir(parents=True, exist_ok=True)
        copies = [(next(build_dir.glob("_C*.so")), ext_path), (build_dir / "libtorchmha.so", ext_path.parent / "libtorchmha.so")]
        if getattr(self, "editable_mode", False):
            # An editable install links the package sources, where _C is placed but the library is not.
            copies.append((build_dir / "libtorchmha.so", ROOT / "python" / "torchmha" / "libtorchmha.so"))
        for src, dst in copies:
            if dst.exists():
                dst.unlink()  # never overwrite a library a running process may have mapped
            shutil.copy2(src, dst)


setup(
    name="torchmha",
    version=VERSION,
    description="PyTorch's multi-head attention reimplemented in C++ (LibTorch), drop-in for torch.nn.MultiheadAttention",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("torchmha._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    extras_require={"plot": ["matplotlib"], "test": ["pytest", "hypothesis", "numpy"]},
    zip_safe=False,
)
