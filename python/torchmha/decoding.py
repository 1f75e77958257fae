"""Beyond torch.nn.MultiheadAttention: key/value caches for incremental decoding, the source
article's CrossAttention (own inner width) and its Transformer block.

Every attention here is one of the C++ ops ``torch.ops.torchmha.attention_with_cache``,
``project_key_value`` and ``attention_with_static_key_value``; the classes own ordinary
nn.Parameters and pass them in.

Decoding is inference: run it under ``torch.no_grad()`` or ``torch.inference_mode()`` (a cache is
written in place on every step, so autograd cannot differentiate across steps).
"""

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

from . import _C  # noqa: F401  (registers the ops)
from .modules import MultiheadAttention

_ops = torch.ops.torchmha


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
        sizes = {"batch_size": batch_size, "num_heads": num_heads, "max_length": max_length, "head_dim": head_dim}
        if any(v <= 0 for v in sizes.values()):
            raise ValueError(f"KeyValueCache sizes must be greater than 0, got {sizes}")
        self.keys = torch.zeros(batch_size, num_heads, max_length, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    @classmethod
    def for_module(cls, module: nn.MultiheadAttention, batch_size: int, max_length: int) -> "KeyValueCache":
        """A cache matching ``module``'s heads, head_dim, dtype and device."""
        weight = module.in_proj_weight if module.in_proj_weight is not None else module.q_proj_weight
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
            if batch_size <= 0:
                raise ValueError(f"batch_size must be greater than 0, but got {batch_size}")
            self.keys = self.keys.new_zeros((batch_size, *self.keys.shape[1:]))
            self.values = torch.zeros_like(self.keys)
        self.length = 0

    def attend(
        self,
        query: Tensor,
        w_q: Tensor,
        b_q: Optional[Tensor],
        w_k: Tensor,
        b_k: Optional[Tensor],
        w_v: Tensor,
        b_v: Optional[Tensor],
        w_out: Tensor,
        b_out: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0,
        training: bool = False,
        batch_first: bool = False,
    ) -> Tensor:
        """``torch.ops.torchmha.attention_with_cache`` on this cache, then advances ``length`` by the
        number of new positions in ``query``."""
        output = _ops.attention_with_cache(
            query, self.keys, self.values, self.length, w_q, b_q, w_k, b_k, w_v, b_v, w_out, b_out,
            key_padding_mask, dropout_p, training, batch_first,
        )
        self.length += query.shape[1 if batch_first else 0]  # only once the op's checks passed
        return output

    def __repr__(self) -> str:
        n, h, m, d = self.keys.shape
        return f"KeyValueCache(batch_size={n}, num_heads={h}, max_length={m}, head_dim={d}, length={self.length})"


def _in_projection(module: nn.MultiheadAttention):
    """The module's (w_q, b_q, w_k, b_k, w_v, b_v); views into the packed tensors when packed."""
    if module.add_zero_attn or module.bias_k is not None:
        raise RuntimeError(
            "MultiheadAttention.forward_with_cache does not support add_bias_kv or add_zero_attn "
            "(they append key positions a cache does not hold)"
        )
    if module.in_proj_weight is not None:
        w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    b_q = b_k = b_v = None
    if module.in_proj_bias is not None:
        b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    return w_q, b_q, w_k, b_k, w_v, b_v


def _check_heads_match(module: nn.MultiheadAttention, keys: Tensor, what: str) -> None:
    # Keys split into heads some other way would pass every shape check of the ops (only
    # heads * head_dim must match) and silently attend with the wrong heads.
    if keys.dim() != 4 or keys.shape[1] != module.num_heads or keys.shape[3] != module.head_dim:
        raise AssertionError(
            f"MultiheadAttention.forward_with_cache: {what} has keys of shape {list(keys.shape)} "
            f"(batch, heads, length, head_dim), but the module has {module.num_heads} heads of size {module.head_dim}"
        )


def forward_with_cache(
    module: nn.MultiheadAttention,
    query: Tensor,
    cache: Union[KeyValueCache, StaticKeyValue],
    key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """Cached attention through any ``torch.nn.MultiheadAttention``'s weights (torchmha's class
    exposes it as the method ``forward_with_cache``). Batched inputs only.

    - ``cache`` a :class:`KeyValueCache`: incremental causal self-attention. ``query`` (T, N, E)
      ((N, T, E) with batch_first) holds the next T positions; their keys and values are appended
      to the cache and position i attends to every cached position up to its own, so step-by-step
      decoding equals one causal forward over the whole sequence. ``key_padding_mask`` (N, length+T)
      covers every key so far (torch's convention: True = ignore).
    - ``cache`` a :class:`StaticKeyValue` from :func:`project_key_value`: attention to a fixed
      memory, equal to ``module(query, key, value, key_padding_mask)[0]`` without reprojecting it.

    Returns the output only, laid out like ``query``.
    """
    w_q, b_q, w_k, b_k, w_v, b_v = _in_projection(module)
    dropout_p, training, batch_first = module.dropout, module.training, module.batch_first
    if isinstance(cache, KeyValueCache):
        _check_heads_match(module, cache.keys, "the cache")
        if not module._qkv_same_embed_dim:
            raise RuntimeError(
                "MultiheadAttention.forward_with_cache with a KeyValueCache is self-attention, so it needs "
                f"kdim == vdim == embed_dim ({module.embed_dim}), but kdim is {module.kdim} and vdim {module.vdim}"
            )
        return cache.attend(
            query, w_q, b_q, w_k, b_k, w_v, b_v, module.out_proj.weight, module.out_proj.bias,
            key_padding_mask, dropout_p, training, batch_first,
        )
    if isinstance(cache, StaticKeyValue):
        _check_heads_match(module, cache.keys, "the projected memory")
        return _ops.attention_with_static_key_value(
            query, cache.keys, cache.values, w_q, b_q, module.out_proj.weight, module.out_proj.bias,
            key_padding_mask, dropout_p, training, batch_first,
        )
    cache_type = f"{type(cache).__module__}.{type(cache).__qualname__}"
    raise TypeError(
        f"cache must be a torchmha.KeyValueCache or torchmha.StaticKeyValue, not {cache_type} "
        "(the torchmha.cpp classes go with torchmha.cpp modules)"
    )


def project_key_value(module: nn.MultiheadAttention, key: Tensor, value: Optional[Tensor] = None) -> StaticKeyValue:
    """Projects a fixed memory (key (S, N, kdim), value (S, N, vdim), batch_first: (N, S, *);
    value defaults to key) through ``module``'s k/v weights once, for :func:`forward_with_cache`."""
    _, _, w_k, b_k, w_v, b_v = _in_projection(module)
    value = key if value is None else value
    return StaticKeyValue(*_ops.project_key_value(key, value, module.num_heads, w_k, b_k, w_v, b_v, module.batch_first))


class CrossAttention(nn.Module):
    """The source article's cross-attention, its defects removed, on torchmha's C++ core.

    ``to_q`` Linear(query_dim, heads*dim_head), ``to_k``/``to_v`` Linear(context_dim, heads*dim_head),
    all without bias, ``to_out`` Linear(heads*dim_head, query_dim), then dropout (training only).
    The inner width heads*dim_head may differ from query_dim; scale dim_head**-0.5. Batch first:
    ``x`` (N, L, query_dim), ``context`` (N, S, context_dim), defaulting to ``x``.

    ``mask`` (N, S) is bool with **True = keep** (the article's convention, the opposite of torch's
    key_padding_mask). A query whose keys are all masked gets NaN, as in torch.
    """

    def __init__(
        self,
        query_dim: int,
        context_dim: Optional[int] = None,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        context_dim = query_dim if context_dim is None else context_dim
        if min(query_dim, context_dim, heads, dim_head) <= 0:
            raise ValueError(
                f"CrossAttention sizes must be greater than 0, got query_dim={query_dim}, "
                f"context_dim={context_dim}, heads={heads}, dim_head={dim_head}"
            )
        factory = {"device": device, "dtype": dtype}
        inner = heads * dim_head
        self.query_dim, self.context_dim, self.heads, self.dim_head = query_dim, context_dim, heads, dim_head
        self.to_q = nn.Linear(query_dim, inner, bias=False, **factory)
        self.to_k = nn.Linear(context_dim, inner, bias=False, **factory)
        self.to_v = nn.Linear(context_dim, inner, bias=False, **factory)
        self.to_out = nn.Linear(inner, query_dim, **factory)
        self.dropout = nn.Dropout(dropout)

    def project_context(self, context: Tensor) -> StaticKeyValue:
        """The context's keys and values, (N, heads, S, dim_head) each, to reuse across decoding steps."""
        return StaticKeyValue(
            *_ops.project_key_value(context, context, self.heads, self.to_k.weight, None, self.to_v.weight, None, True)
        )

    def forward_with_cache(self, x: Tensor, context: StaticKeyValue, mask: Optional[Tensor] = None) -> Tensor:
        """``forward`` with the context already projected by :meth:`project_context`."""
        if not isinstance(context, StaticKeyValue):
            raise TypeError(
                f"CrossAttention.forward_with_cache takes the context projected by project_context(context), "
                f"not {type(context).__name__}"
            )
        key_padding_mask = None
        if mask is not None:
            if mask.dtype != torch.bool:
                raise AssertionError(f"CrossAttention's mask must be bool (True = keep), but got dtype {mask.dtype}")
            key_padding_mask = ~mask  # the core takes torch's convention, True = ignore
        attended = _ops.attention_with_static_key_value(
            x, context.keys, context.values, self.to_q.weight, None, self.to_out.weight, self.to_out.bias,
            key_padding_mask, 0.0, self.training, True,
        )
        return self.dropout(attended)

    def forward(self, x: Tensor, context: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> Tensor:
        return self.forward_with_cache(x, self.project_context(x if context is None else context), mask)

    def extra_repr(self) -> str:
        return (
            f"query_dim={self.query_dim}, context_dim={self.context_dim}, heads={self.heads}, "
            f"dim_head={self.dim_head}"
        )


class TransformerBlock(nn.Module):
    """The source article's Transformer block on torchmha's attention, batch first (N, L, E).

    Self-attention and a feed-forward network Linear(E, forward_expansion*E) - ReLU - Linear, each
    with a residual connection and LayerNorm: post-norm (the article's) by default, pre-norm with
    ``norm_first=True``. Dropout acts on the attention weights and on each sublayer's output before
    the residual sum. Submodule names and computation are ``torch.nn.TransformerEncoderLayer``'s
    (activation="relu", batch_first=True), so its state_dict loads here and back.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        forward_expansion: int = 4,
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if forward_expansion <= 0:
            raise ValueError(f"forward_expansion must be greater than 0, but got {forward_expansion}")
        factory = {"device": device, "dtype": dtype}
        hidden = forward_expansion * embed_dim
        self.norm_first = norm_first
        # Registration order of torch.nn.TransformerEncoderLayer.
        self.self_attn = MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True, **factory)
        self.linear1 = nn.Linear(embed_dim, hidden, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(hidden, embed_dim, **factory)
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory)
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory)

    def _attention(self, x: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor]) -> Tensor:
        out = self.self_attn(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)[0]
        return self.dropout(out)

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.linear2(self.dropout(torch.relu(self.linear1(x)))))

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """x (N, L, E); attn_mask (L, L) or (N*H, L, L), key_padding_mask (N, L), as torch's."""
        if self.norm_first:
            x = x + self._attention(self.norm1(x), attn_mask, key_padding_mask)
            return x + self._feed_forward(self.norm2(x))
        x = self.norm1(x + self._attention(x, attn_mask, key_padding_mask))
        return self.norm2(x + self._feed_forward(x))
