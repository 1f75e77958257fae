"""torchmha: PyTorch's multi-head attention reimplemented in C++ (LibTorch).

    import torchmha
    mha = torchmha.MultiheadAttention(512, 8, batch_first=True)   # drop-in for torch.nn's
    torchmha.replace_multihead_attention(model)                    # swap every one in a model
    cache = torchmha.KeyValueCache.for_module(mha, batch_size=1, max_length=1024)
    y_t = mha.forward_with_cache(x_t, cache)                        # incremental decoding

The compute is in the C++ extension (torch.ops.torchmha.*); the classes here are ordinary
torch.nn.Modules that own their parameters and call it.
"""

from typing import TYPE_CHECKING

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from ._build import build_info, check_torch

check_torch()  # before the extension loads: with another torch it would fail obscurely

from . import _C, cpp  # noqa: E402
from .cached_decoder import CachedDecoder, DecoderState
from .cross_attention import CrossAttention
from .functional import in_projection, in_projection_packed, multi_head_attention_forward
from .kv_cache import KeyValueCache, StaticKeyValue
from .multihead_attention import MultiheadAttention, replace_multihead_attention
from .plotting import plot_attention, plot_module_attention
from .transformer_block import TransformerBlock
from .versions import MultiheadAttentionV1, MultiheadAttentionV2, MultiheadAttentionV3, MultiheadAttentionV4


if TYPE_CHECKING:
    from . import distributed as distributed


def __getattr__(name: str) -> object:
    # torchmha.distributed imports DTensor and DCP, which most programs never use: loaded on first
    # access (import torchmha.distributed, or the attribute).
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__: str = _C.__version__  # from the repository's VERSION file, through CMake

__all__ = [
    "CachedDecoder",
    "DecoderState",
    "CrossAttention",
    "KeyValueCache",
    "MultiheadAttention",
    "MultiheadAttentionV1",
    "MultiheadAttentionV2",
    "MultiheadAttentionV3",
    "MultiheadAttentionV4",
    "StaticKeyValue",
    "build_info",
    "TransformerBlock",
    "cpp",
    "in_projection",
    "in_projection_packed",
    "multi_head_attention_forward",
    "plot_attention",
    "plot_module_attention",
    "replace_multihead_attention",
]
