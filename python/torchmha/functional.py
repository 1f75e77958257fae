"""Functional API: thin Python entry points to the C++ ops registered as torch.ops.torchmha.*."""

import warnings
from typing import Optional

from torch import Tensor

from ._ops import attention_options, attention_parameters, ops


def warn_if_mask_dtypes_differ(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> None:
    """torch.nn.MultiheadAttention's deprecation warning for masks of different dtypes. Raised here,
    in Python, because warnings from inside a torch.ops call reach stderr, not the warnings module."""
    if key_padding_mask is not None and attn_mask is not None and key_padding_mask.dtype != attn_mask.dtype:
        warnings.warn(  # torch's text, so warning filters written against torch match
            "Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both instead.",
            stacklevel=3,
        )


def in_projection_packed(q: Tensor, k: Tensor, v: Tensor, w: Tensor, b: Optional[Tensor] = None):
    """Same as ``torch.nn.functional._in_projection_packed``: project q, k, v with one packed
    weight (3E, E) and bias (3E). The case (self-attention when q, k and v are the same tensor,
    encoder-decoder when only k and v are, else three projections) is chosen by tensor identity.
    Returns a tuple (q', k', v')."""
    return tuple(ops.in_projection_packed(q=q, k=k, v=v, w=w, b=b))


def in_projection(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w_q: Tensor,
    w_k: Tensor,
    w_v: Tensor,
    b_q: Optional[Tensor] = None,
    b_k: Optional[Tensor] = None,
    b_v: Optional[Tensor] = None,
):
    """Same as ``torch.nn.functional._in_projection``: three projections with separate weights
    w_q (Eq, Eq), w_k (Eq, Ek), w_v (Eq, Ev). Returns a tuple (q', k', v')."""
    return tuple(ops.in_projection(q=q, k=k, v=v, w_q=w_q, w_k=w_k, w_v=w_v, b_q=b_q, b_k=b_k, b_v=b_v))


def multi_head_attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Optional[Tensor],
    in_proj_bias: Optional[Tensor],
    bias_k: Optional[Tensor],
    bias_v: Optional[Tensor],
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor],
    training: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    need_weights: bool = True,
    attn_mask: Optional[Tensor] = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Optional[Tensor] = None,
    k_proj_weight: Optional[Tensor] = None,
    v_proj_weight: Optional[Tensor] = None,
    static_k: Optional[Tensor] = None,
    static_v: Optional[Tensor] = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
):
    """``torch.nn.functional.multi_head_attention_forward`` with the same signature, computed by
    torchmha's C++ core. Layout (L, N, E) or unbatched (L, E). Returns (output, weights or None).
    static_k / static_v (N*num_heads, S, head_dim) replace the projected keys / values, as in torch."""
    warn_if_mask_dtypes_differ(key_padding_mask, attn_mask)
    if use_separate_proj_weight:
        in_proj_weight = None
    else:
        q_proj_weight = k_proj_weight = v_proj_weight = None
    params = attention_parameters(
        num_heads, None, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight,
        bias_k=bias_k, bias_v=bias_v, add_zero_attn=add_zero_attn, out_proj_weight=out_proj_weight,
        out_proj_bias=out_proj_bias,
    )
    options = attention_options(
        key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal, training, False, dropout_p,
        static_k=static_k, static_v=static_v,
    )
    return ops.multi_head_attention_forward(query, key, value, embed_dim_to_check, *params, *options)
