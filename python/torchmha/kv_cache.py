"""Caches for incremental decoding (C++: kv_cache.h). The cached attention itself is
:meth:`torchmha.MultiheadAttention.forward_with_cache` and :meth:`torchmha.CrossAttention.forward_with_cache`.

Decoding is inference: run it under ``torch.no_grad()`` or ``torch.inference_mode()`` (a cache is
written in place on every step, so autograd cannot differentiate across steps).
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from ._ops import rules


class StaticKeyValue(NamedTuple):
    """Keys and values of a fixed context (an encoder output), projected once and reused on every
    decoding step: the cross-attention cache. ``keys``, ``values``: (N, H, S, head_dim)."""

    keys: Tensor
    values: Tensor


class KeyValueCache:
    """A preallocated self-attention key/value cache for incremental decoding.

    ``keys`` and ``values`` are (batch_size, num_heads, max_length, head_dim); the first ``length``
    positions are filled. Each :meth:`MultiheadAttention.forward_with_cache` call writes its new
    positions in place and advances ``length``. :meth:`reset` starts a new sequence, reusing the
    storage (or reallocating it for another batch size). Filling past ``max_length`` or passing a
    query of another batch size raises (RuntimeError, AssertionError) and leaves the cache as it was.
    """

    def __init__(
        self,
        batch_size: int,
        num_heads: int,
        max_length: int,
        head_dim: int,
        *,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ) -> None:
        self.keys, self.values = rules._key_value_cache(batch_size, num_heads, max_length, head_dim, dtype, device)
        self.length = 0

    @classmethod
    def for_module(cls, module: nn.MultiheadAttention, batch_size: int, max_length: int) -> "KeyValueCache":
        """A cache matching ``module``'s heads and head_dim, and the dtype and device of its
        out_proj weight (present in every configuration), as C++'s KeyValueCache::for_module."""
        weight = module.out_proj.weight
        return cls(batch_size, module.num_heads, max_length, module.head_dim, dtype=weight.dtype, device=weight.device)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def max_length(self) -> int:
        return self.keys.shape[2]

    def reset(self, batch_size: Optional[int] = None) -> None:
        """Forgets the cached positions; with ``batch_size``, makes room for batches of that size
        (reallocating only if it differs)."""
        if batch_size is not None and batch_size != self.batch_size:
            _, num_heads, max_length, head_dim = self.keys.shape
            self.keys, self.values = rules._key_value_cache(
                batch_size, num_heads, max_length, head_dim, self.keys.dtype, self.keys.device
            )
        self.length = 0

    def __repr__(self) -> str:
        n, h, m, d = self.keys.shape
        return f"KeyValueCache(batch_size={n}, num_heads={h}, max_length={m}, head_dim={d}, length={self.length})"
