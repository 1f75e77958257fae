"""The C++ extension, loaded once: ``torch.ops.torchmha.*`` (registered by libtorchmha, which _C
links) and the core's construction-time rules (``_C._check_*``). Every class of the package makes
one call into these."""

import torch

from . import _C  # noqa: F401  (loads libtorchmha, which registers torch.ops.torchmha.*)

ops = torch.ops.torchmha
rules = _C


def fast_path_allowed() -> bool:
    """torch's conditions for its fused inference path that only Python can see (the switch
    ``torch.backends.mha.set_fastpath_enabled`` and tracing); the C++ core checks the others."""
    return torch.backends.mha.get_fastpath_enabled() and not torch.compiler.is_compiling()
