"""The source article's CrossAttention, its defects removed (docs/versions.md; C++: cross_attention.h)."""

from typing import Optional

from torch import Tensor, nn

from ._ops import attention_parameters, ops, rules
from .kv_cache import StaticKeyValue


class CrossAttention(nn.Module):
    """Cross-attention with its own inner width, on torchmha's C++ core.

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
        rules._check_cross_attention_sizes(query_dim, context_dim, heads, dim_head)
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
        params = attention_parameters(self.heads, k_proj_weight=self.to_k.weight, v_proj_weight=self.to_v.weight)
        return StaticKeyValue(*ops.project_key_value(context, None, *params, True))

    def forward_with_cache(self, x: Tensor, context: StaticKeyValue, mask: Optional[Tensor] = None) -> Tensor:
        """``forward`` with the context already projected by :meth:`project_context`."""
        if not isinstance(context, StaticKeyValue):
            raise TypeError(
                f"CrossAttention.forward_with_cache takes the context projected by project_context(context), "
                f"not {type(context).__name__}"
            )
        params = attention_parameters(
            self.heads, q_proj_weight=self.to_q.weight, out_proj_weight=self.to_out.weight,
            out_proj_bias=self.to_out.bias,
        )
        return self.dropout(ops.cross_attention(x, context.keys, context.values, *params, mask, self.training))

    def forward(self, x: Tensor, context: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> Tensor:
        return self.forward_with_cache(x, self.project_context(x if context is None else context), mask)

    def extra_repr(self) -> str:
        return (
            f"query_dim={self.query_dim}, context_dim={self.context_dim}, heads={self.heads}, "
            f"dim_head={self.dim_head}"
        )
