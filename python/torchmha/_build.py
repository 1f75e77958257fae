"""What the C++ extension was built with, and the check that it suits the torch imported.

The extension is C++ compiled against one torch: its ABI (pybind11 types, LibTorch symbols)
matches no other release, and loading it beside another fails with an obscure pybind11 error. So
the torch version is checked first, with a message that says what to do.
"""

from typing import Dict, Optional, Union

import torch

try:
    from ._build_info import BUILD_INFO
except ImportError as error:  # a source tree that was never built
    raise ImportError(
        "torchmha's C++ extension is not built here: run `make build` in the repository, or install "
        "torchmha with `pip install --no-build-isolation <path or sdist>`"
    ) from error


def build_info() -> Dict[str, Optional[Union[str, bool]]]:
    """What the binary was built with: torchmha and torch versions, CUDA (None for a CPU build),
    the C++11 ABI flag, the compiler and the build type."""
    return dict(BUILD_INFO)


def check_torch() -> None:
    """ImportError unless the imported torch is the one the extension was built against."""
    built, running = BUILD_INFO["torch"], torch.__version__
    if running != built:
        raise ImportError(
            f"torchmha {BUILD_INFO['torchmha']} was built for torch {built}, but torch {running} is installed, "
            "and its C++ extension only loads beside the torch it was built against. Rebuild it for this torch: "
            "pip install --no-build-isolation --force-reinstall --no-deps <torchmha source tree or sdist>"
        )
