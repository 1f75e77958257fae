"""The source article's four versions (C++: attention_versions.h; see docs/versions.md), rebuilt
without its defects. Layout [L, N, E]. Each owns its Linear layers and makes one call into the C++ core."""

from typing import Optional

from torch import Tensor, nn

from ._ops import attention_options, attention_parameters, ops, rules


def _versions_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, params: tuple,
                      mask: Optional[Tensor]) -> Tensor:
    """The versions' one call: no weights returned, the module's mode and dropout."""
    options = attention_options(attn_mask=mask, need_weights=False, training=module.training, dropout_p=module.dropout)
    return ops.multi_head_attention_forward(query, key, value, module.embed_dim, *params, *options)[0]


class _SeparateProjectionAttention(nn.Module):
    """v1-v3 share this layout: q_proj, k_proj (kdim -> E), v_proj (vdim -> E), out_proj."""

    def __init__(self, embed_dim, num_heads, kdim, vdim, dropout, device, dtype):
        super().__init__()
        rules._check_module_sizes(embed_dim, num_heads, kdim, vdim)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.kdim, self.vdim = kdim, vdim
        self.q_proj = nn.Linear(embed_dim, embed_dim, **factory)
        self.k_proj = nn.Linear(kdim, embed_dim, **factory)
        self.v_proj = nn.Linear(vdim, embed_dim, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **factory)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor]) -> Tensor:
        params = attention_parameters(
            self.num_heads, q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight, q_proj_bias=self.q_proj.bias, k_proj_bias=self.k_proj.bias,
            v_proj_bias=self.v_proj.bias, out_proj_weight=self.out_proj.weight, out_proj_bias=self.out_proj.bias,
        )
        return _versions_forward(self, query, key, value, params, mask)


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
        rules._check_module_sizes(embed_dim, num_heads)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **factory)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        params = attention_parameters(
            self.num_heads, in_proj_weight=self.in_proj.weight, in_proj_bias=self.in_proj.bias,
            out_proj_weight=self.out_proj.weight, out_proj_bias=self.out_proj.bias,
        )
        return _versions_forward(self, query, key, value, params, mask)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"
