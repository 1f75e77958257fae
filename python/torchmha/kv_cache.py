"""Caches for incremental decoding (C++: kv_cache.h). The cached attention itself is
:meth:`torchmha.MultiheadAttention.forward_with_cache` and :meth:`torchmha.CrossAttention.forward_with_cache`.

Decoding is inference: run it under ``torch.no_grad()`` or ``torch.inference_mode()`` (a cache is
written in place on every step, so autograd cannot differentiate across steps).
"""

from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ._ops import ops, rules


Slots = Union[int, Sequence[int], Tensor, None]


def as_slot_index(slots: Slots, device) -> Optional[Tensor]:
    """torch's index forms (an int, a list of ints, an integer or bool tensor) as a 1-D tensor, the
    form the reset ops take."""
    if slots is None:
        return None
    if not isinstance(slots, Tensor):
        slots = torch.as_tensor(slots, device=device)
    return slots if slots.dim() == 1 else slots.reshape(-1)


class StaticKeyValue(NamedTuple):
    """Keys and values of a fixed context (an encoder output), projected once and reused on every
    decoding step: the cross-attention cache. ``keys``, ``values``: (N, H, S, head_dim)."""

    keys: Tensor
    values: Tensor


class KeyValueCache:
    """A preallocated self-attention key/value cache for incremental decoding, each sequence at
    its own position.

    ``keys`` and ``values`` are (batch_size, num_heads, max_length, head_dim); ``lengths``
    ((batch_size,) int64) counts the positions filled per sequence. Each
    :meth:`MultiheadAttention.forward_with_cache` call writes its new positions in place and the
    op advances ``lengths``. :meth:`reorder` follows beam search, :meth:`reset` empties some or all
    sequences (reusing the storage, or reallocating it for another batch size). Filling past
    ``max_length`` or passing a query of another batch size raises and leaves the cache as it was.
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
        self._allocate(batch_size, num_heads, max_length, head_dim, dtype, device)

    def _allocate(self, batch_size: int, num_heads: int, max_length: int, head_dim: int, dtype, device) -> None:
        self.keys, self.values = rules._key_value_cache(batch_size, num_heads, max_length, head_dim, dtype, device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.keys.device)

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

    @property
    def length(self) -> int:
        """Positions filled, while every sequence has the same length (else use ``lengths``)."""
        shortest, longest = (int(x) for x in torch.aminmax(self.lengths))
        if shortest != longest:
            raise RuntimeError(
                f"KeyValueCache.length: the sequences have different lengths (from {shortest} to {longest}); "
                "use lengths"
            )
        return longest

    def reorder(self, indices: Tensor) -> None:
        """Beam search: sequence i becomes old sequence ``indices[i]``, with its length (in place)."""
        ops.reorder_cache(k_cache=self.keys, v_cache=self.values, lengths=self.lengths, indices=indices)

    def reset(self, slots: Slots = None, *, batch_size: Optional[int] = None) -> None:
        """Empties the sequences ``slots`` (an int, a list of ints, an integer tensor or a bool
        mask, as torch indexing takes; all if None), so new
        ones start there while the others go on. With ``batch_size``, empties every sequence and
        makes room for batches of that size (reallocating only if it differs)."""
        if batch_size is not None and batch_size != self.batch_size:
            _, num_heads, max_length, head_dim = self.keys.shape
            self._allocate(batch_size, num_heads, max_length, head_dim, self.keys.dtype, self.keys.device)
            return
        slots = None if batch_size is not None else as_slot_index(slots, self.lengths.device)
        ops.reset_cache(self.lengths, slots)

    def __repr__(self) -> str:
        n, h, m, d = self.keys.shape
        return f"KeyValueCache(batch_size={n}, num_heads={h}, max_length={m}, head_dim={d}, lengths={self.lengths.tolist()})"
