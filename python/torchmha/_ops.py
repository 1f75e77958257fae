"""The C++ extension, loaded once: ``torch.ops.torchmha.*`` (registered by libtorchmha, which _C
links), the core's construction-time rules (``_C._check_*``) and CachedDecoder's per-step checks
(``_C._entries_unchanged``, ``_C._tensor_stamps``). Every class of the package makes one call into
these.

The attention ops take the C++ argument structs (csrc/include/torchmha/attention_arguments.h) as
runs of schema arguments. ``attention_parameters``, ``attention_options``, ``block_options`` and ``decoding_options``
are their one spelling in Python: they return a struct's run in schema order, so callers pass it
positionally (``op(query, key, value, E, *attention_parameters(...), *attention_options(...))``)
and torch.ops never matches keywords against the schema (tests/python/test_ops.py checks the
order against the schemas)."""

from typing import Optional

import torch
from torch import Tensor

from . import _C  # noqa: F401  (loads libtorchmha, which registers torch.ops.torchmha.*)

ops = torch.ops.torchmha
rules = _C


def fast_path_allowed() -> bool:
    """torch's conditions for its fused inference path that only Python can see (the switch
    ``torch.backends.mha.set_fastpath_enabled`` and tracing); the C++ core checks the others."""
    return torch.backends.mha.get_fastpath_enabled() and not torch.compiler.is_compiling()


def attention_parameters(
    num_heads: int,
    head_dim: Optional[int] = None,
    in_proj_weight: Optional[Tensor] = None,
    in_proj_bias: Optional[Tensor] = None,
    q_proj_weight: Optional[Tensor] = None,
    k_proj_weight: Optional[Tensor] = None,
    v_proj_weight: Optional[Tensor] = None,
    q_proj_bias: Optional[Tensor] = None,
    k_proj_bias: Optional[Tensor] = None,
    v_proj_bias: Optional[Tensor] = None,
    bias_k: Optional[Tensor] = None,
    bias_v: Optional[Tensor] = None,
    add_zero_attn: bool = False,
    out_proj_weight: Optional[Tensor] = None,
    out_proj_bias: Optional[Tensor] = None,
):
    """A module's parameters (AttentionParameters) as the ops' positional arguments."""
    return (num_heads, head_dim, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight,
            q_proj_bias, k_proj_bias, v_proj_bias, bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias)


def attention_options(
    key_padding_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    need_weights: bool = True,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    training: bool = True,
    batch_first: bool = False,
    dropout_p: float = 0.0,
    allow_fast_path: bool = False,
    static_k: Optional[Tensor] = None,
    static_v: Optional[Tensor] = None,
):
    """One forward call's masks and flags (AttentionOptions) as the ops' positional arguments."""
    return (key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal, training, batch_first,
            dropout_p, allow_fast_path, static_k, static_v)


def block_options(
    key_padding_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    training: bool = True,
    dropout_p: float = 0.0,
    allow_fast_path: bool = False,
):
    """A TransformerBlock call's masks and flags (BlockOptions) as the op's positional arguments."""
    return (key_padding_mask, attn_mask, is_causal, training, dropout_p, allow_fast_path)


def decoding_options(
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    training: bool = False,
    batch_first: bool = False,
):
    """One decoding step's mask and flags (DecodingOptions) as the ops' positional arguments."""
    return (key_padding_mask, dropout_p, training, batch_first)
