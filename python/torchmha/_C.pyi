# Type stubs of the C++ extension torchmha._C (csrc/python_bindings.cpp). The ops themselves are
# reached through torch.ops.torchmha (see _ops.py); the C++ modules through torchmha.cpp.
from typing import Any, Optional, Tuple

import torch

__version__: str

def _check_module_sizes(embed_dim: int, num_heads: int, kdim: int = ..., vdim: int = ...) -> None: ...
def _check_cross_attention_sizes(query_dim: int, context_dim: int, heads: int, dim_head: int) -> None: ...
def _check_forward_expansion(forward_expansion: int) -> None: ...
def _key_value_cache(
    batch_size: int,
    num_heads: int,
    max_length: int,
    head_dim: int,
    dtype: Optional[torch.dtype] = ...,
    device: Optional[torch.device] = ...,
) -> Tuple[torch.Tensor, torch.Tensor]: ...

# The C++ modules bound with torch::python::bind_module (torchmha.cpp re-exports them).
cpp: Any
