"""The source article's Transformer block on torchmha's attention (docs/versions.md; C++: transformer_block.h)."""

from typing import Optional

from torch import Tensor, nn

from ._ops import attention_parameters, block_options, fast_path_allowed, ops, rules
from .functional import warn_if_mask_dtypes_differ
from .multihead_attention import MultiheadAttention


class TransformerBlock(nn.Module):
    """The article's Transformer block, batch first (N, L, E).

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
        rules._check_forward_expansion(forward_expansion)
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

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """x (N, L, E); attn_mask (L, L) or (N*H, L, L), key_padding_mask (N, L), as torch's."""
        warn_if_mask_dtypes_differ(key_padding_mask, attn_mask)
        attention = self.self_attn
        feed_forward = (
            self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias, self.norm1.weight,
            self.norm1.bias, self.norm2.weight, self.norm2.bias, self.norm1.eps, self.dropout.p, self.norm_first,
        )
        params = attention_parameters(
            attention.num_heads, in_proj_weight=attention.in_proj_weight, in_proj_bias=attention.in_proj_bias,
            out_proj_weight=attention.out_proj.weight, out_proj_bias=attention.out_proj.bias,
        )
        options = block_options(
            key_padding_mask, attn_mask, training=self.training, dropout_p=attention.dropout,
            allow_fast_path=fast_path_allowed(),
        )
        return ops.transformer_block(x, *feed_forward, *params, *options)
