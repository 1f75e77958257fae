"""torch.nn.Modules on torchmha's C++ core.

Each class owns ordinary nn.Parameters (so optimizers, state_dict, .to(), DDP, deepcopy, pickling
and torch.compile behave as for any module) and passes them to the C++ op on every call.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from . import _C  # noqa: F401  (registers the ops)
from .functional import warn_if_mask_dtypes_differ

_mha_op = torch.ops.torchmha.multi_head_attention_forward.default


def _check_sizes(embed_dim: int, num_heads: int) -> None:
    # The same exception types torch.nn.MultiheadAttention raises.
    if embed_dim <= 0 or num_heads <= 0:
        raise ValueError(
            f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and num_heads={num_heads}"
        )
    if embed_dim % num_heads != 0:
        raise AssertionError(f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and num_heads={num_heads}")


class _SeparateProjectionAttention(nn.Module):
    """v1-v3 share this layout: q_proj, k_proj (kdim -> E), v_proj (vdim -> E), out_proj."""

    def __init__(self, embed_dim, num_heads, kdim, vdim, dropout, device, dtype):
        super().__init__()
        _check_sizes(embed_dim, num_heads)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.kdim, self.vdim = kdim, vdim
        self.q_proj = nn.Linear(embed_dim, embed_dim, **factory)
        self.k_proj = nn.Linear(kdim, embed_dim, **factory)
        self.v_proj = nn.Linear(vdim, embed_dim, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **factory)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor]) -> Tensor:
        in_proj_bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        return _mha_op(
            query, key, value, self.embed_dim, self.num_heads, None, in_proj_bias, None, None, False,
            self.dropout, self.out_proj.weight, self.out_proj.bias, self.training, None, False, mask,
            self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
        )[0]


class MultiheadAttentionV1(_SeparateProjectionAttention):
    """v1: single-head self-attention, softmax(Q K^T / sqrt(E)) V. Input and output [L, N, E].
    Equivalent to ``torch.nn.MultiheadAttention(embed_dim, 1)``."""

    def __init__(self, embed_dim: int, device=None, dtype=None) -> None:
        super().__init__(embed_dim, 1, embed_dim, embed_dim, 0.0, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self._attend(x, x, x, None)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}"


class MultiheadAttentionV2(_SeparateProjectionAttention):
    """v2: multi-head self-attention with dropout on the attention weights (training only) and an
    optional mask: (L, L) or (N*H, L, L), bool True = not allowed, float = added to the scores."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, device=None, dtype=None) -> None:
        super().__init__(embed_dim, num_heads, embed_dim, embed_dim, dropout, device, dtype)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self._attend(x, x, x, mask)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"


class MultiheadAttentionV3(_SeparateProjectionAttention):
    """v3: general attention. query [L, N, E], key [S, N, kdim], value [S, N, vdim]; k_proj is
    Linear(kdim, E), v_proj Linear(vdim, E). Mask (L, S) or (N*H, L, S)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        super().__init__(embed_dim, num_heads, kdim, vdim, dropout, device, dtype)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self._attend(query, key, value, mask)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, vdim={self.vdim}, "
            f"dropout={self.dropout}"
        )


class MultiheadAttentionV4(nn.Module):
    """v4: one packed ``in_proj = Linear(E, 3E)`` (rows q, k, v, exactly torch's in_proj_weight)
    and out_proj, projected like ``_in_projection_packed``: self-attention (query is key is value),
    encoder-decoder (key is value) and general attention all work."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        _check_sizes(embed_dim, num_heads)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **factory)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return _mha_op(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj.weight, self.in_proj.bias, None, None,
            False, self.dropout, self.out_proj.weight, self.out_proj.bias, self.training, None, False, mask,
        )[0]

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in replacement for ``torch.nn.MultiheadAttention``, computed by torchmha's C++ core.

    Constructor, attributes, parameters (names, shapes, registration and initialisation order),
    state_dict, pickling and forward signature are torch's: the class derives from torch's, so a
    checkpoint of either loads into the other and ``isinstance(m, torch.nn.MultiheadAttention)``
    holds where torch's own Transformer layers check it. Only forward is replaced.

    Differences from torch: the batch_first output is always contiguous; with need_weights=False
    nothing of size L x S is built for key_padding_mask (it stays (N, 1, 1, S)).
    """

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        # torch takes its fused inference path only outside tracing; the C++ core checks the
        # remaining conditions (eval, no grad, batch_first, self-attention, ...).
        allow_fast_path = torch.backends.mha.get_fastpath_enabled() and not torch.compiler.is_compiling()
        warn_if_mask_dtypes_differ(key_padding_mask, attn_mask)
        return _mha_op(
            query, key, value, self.embed_dim, self.num_heads,
            self.in_proj_weight, self.in_proj_bias, self.bias_k, self.bias_v, self.add_zero_attn,
            self.dropout, self.out_proj.weight, self.out_proj.bias, self.training,
            key_padding_mask, need_weights, attn_mask,
            self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
            average_attn_weights, is_causal, self.batch_first, allow_fast_path,
        )

    def forward_with_cache(self, query: Tensor, cache, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Cached attention for incremental decoding (forward itself is unchanged): ``cache`` a
        :class:`torchmha.KeyValueCache` for causal self-attention, one step of T new positions at a
        time, or a :class:`torchmha.StaticKeyValue` from :meth:`project_key_value` for a fixed
        memory. See :func:`torchmha.decoding.forward_with_cache`."""
        from .decoding import forward_with_cache  # decoding.py imports this module

        return forward_with_cache(self, query, cache, key_padding_mask)

    def project_key_value(self, key: Tensor, value: Optional[Tensor] = None):
        """Projects a fixed memory once into a :class:`torchmha.StaticKeyValue` for forward_with_cache."""
        from .decoding import project_key_value

        return project_key_value(self, key, value)


def replace_multihead_attention(model: nn.Module) -> int:
    """Makes every ``torch.nn.MultiheadAttention`` inside ``model`` (and ``model`` itself) a
    ``torchmha.MultiheadAttention`` in place and returns how many it changed.

    The modules keep their identity, parameters (the same Parameter objects, so an optimizer
    built before the swap still steps them), buffers, hooks, device, dtype and training mode: only
    their class changes, which is sound because torchmha's class adds no state to torch's.
    Subclasses of torch's class are left alone, as their forward may differ.
    """
    replaced = 0
    for module in model.modules():
        if type(module) is nn.MultiheadAttention:
            module.__class__ = MultiheadAttention
            replaced += 1
    return replaced
