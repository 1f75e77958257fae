"""torchmha.MultiheadAttention: torch.nn.MultiheadAttention with forward computed by the C++ core
(C++: multihead_attention.h), its decoding methods, and replace_multihead_attention."""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ._ops import fast_path_allowed, ops
from .functional import warn_if_mask_dtypes_differ
from .kv_cache import KeyValueCache, StaticKeyValue


def _parameter(module: nn.Module, name: str):
    # nn.Module.__getattr__ costs about a microsecond per name; a name that is not a registered
    # parameter (a parametrization's property, a plain attribute) is read as usual.
    parameters = module.__dict__["_parameters"]
    return parameters[name] if name in parameters else getattr(module, name)


@torch.jit.unused
def _parameters_of(
    module: nn.MultiheadAttention,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor],
           Optional[Tensor], Optional[Tensor], Tensor, Optional[Tensor]]:
    """The module's parameters in forward's order (eager mode; TorchScript reads the attributes)."""
    modules = module.__dict__["_modules"]
    out_proj = modules["out_proj"] if "out_proj" in modules else module.out_proj
    return (
        _parameter(module, "in_proj_weight"), _parameter(module, "in_proj_bias"), _parameter(module, "bias_k"),
        _parameter(module, "bias_v"), _parameter(module, "q_proj_weight"), _parameter(module, "k_proj_weight"),
        _parameter(module, "v_proj_weight"), _parameter(out_proj, "weight"), _parameter(out_proj, "bias"),
    )


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in replacement for ``torch.nn.MultiheadAttention``, computed by torchmha's C++ core.

    Constructor, attributes, parameters (names, shapes, registration and initialisation order),
    state_dict, pickling and forward signature are torch's: the class derives from torch's, so a
    checkpoint of either loads into the other and ``isinstance(m, torch.nn.MultiheadAttention)``
    holds where torch's own Transformer layers check it. Only forward is replaced, and the
    decoding methods forward_with_cache and project_key_value are added.

    Differences from torch: with need_weights=False nothing of size L x S is built for
    key_padding_mask (it stays (N, 1, 1, S)).
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
    ) -> Tuple[Tensor, Optional[Tensor]]:
        warn_if_mask_dtypes_differ(key_padding_mask, attn_mask)
        if torch.jit.is_scripting():  # (TorchScript cannot read the dicts)
            params = (self.in_proj_weight, self.in_proj_bias, self.bias_k, self.bias_v, self.q_proj_weight,
                      self.k_proj_weight, self.v_proj_weight, self.out_proj.weight, self.out_proj.bias)
        else:
            params = _parameters_of(self)
        in_w, in_b, bias_k, bias_v, q_w, k_w, v_w, out_w, out_b = params
        # Positional: torch.ops matches keyword arguments against the schema by name, 60k instructions
        # a call for these 24 (callgrind), a fifth of what a 16-token call spent beyond its GEMMs.
        return ops.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, in_w, in_b, bias_k, bias_v, self.add_zero_attn,
            self.dropout, out_w, out_b, self.training, key_padding_mask, need_weights, attn_mask, q_w, k_w, v_w,
            average_attn_weights, is_causal, self.batch_first, fast_path_allowed(),
        )

    def forward_with_cache(
        self,
        query: Tensor,
        cache: Union[KeyValueCache, StaticKeyValue],
        key_padding_mask: Optional[Tensor] = None,
        new_lengths: Optional[Tensor] = None,
    ) -> Tensor:
        """Cached attention for incremental decoding (forward itself is unchanged). Batched inputs only.

        - ``cache`` a :class:`torchmha.KeyValueCache`: causal self-attention, each sequence at its
          own position. ``query`` (T, N, E) ((N, T, E) with batch_first) holds up to T next
          positions per sequence: sequence i appends its first ``new_lengths[i]`` ((N,) int64;
          default all T) at its own ``cache.lengths[i]`` and each position attends to its own
          sequence's cached positions up to itself, so step-by-step decoding equals one causal
          forward over each sequence alone. Output rows past ``new_lengths[i]`` are zeros.
          ``key_padding_mask`` (N, S) masks cache positions [0, S) (True = ignore; left-padded
          prompts), S covering every filled position.
        - ``cache`` a :class:`torchmha.StaticKeyValue` from :meth:`project_key_value`: attention to
          a fixed memory, equal to ``self(query, key, value, key_padding_mask)[0]`` without
          projecting it again.

        Returns the output only, laid out like ``query``.
        """
        in_w, in_b, bias_k, bias_v, q_w, k_w, v_w, out_w, out_b = _parameters_of(self)
        if isinstance(cache, KeyValueCache):  # (positional, as in forward: one call a token)
            return ops.attention_with_cache(
                query, cache.keys, cache.values, cache.lengths, self.num_heads, in_w, in_b, out_w, out_b,
                key_padding_mask, self.dropout, self.training, self.batch_first, q_w, k_w, v_w, bias_k, bias_v,
                self.add_zero_attn, new_lengths,
            )
        if new_lengths is not None:
            raise ValueError("forward_with_cache: new_lengths is for a KeyValueCache")
        if isinstance(cache, StaticKeyValue):
            return ops.attention_with_static_key_value(
                query, cache.keys, cache.values, self.num_heads, in_w, in_b, out_w, out_b, key_padding_mask,
                self.dropout, self.training, self.batch_first, q_w, bias_k, bias_v, self.add_zero_attn,
            )
        cache_type = f"{type(cache).__module__}.{type(cache).__qualname__}"
        raise TypeError(
            f"cache must be a torchmha.KeyValueCache or torchmha.StaticKeyValue, not {cache_type} "
            "(the torchmha.cpp classes go with torchmha.cpp modules)"
        )

    def project_key_value(self, key: Tensor, value: Optional[Tensor] = None) -> StaticKeyValue:
        """Projects a fixed memory (key (S, N, kdim), value (S, N, vdim), batch_first: (N, S, *);
        value defaults to key) once into a :class:`torchmha.StaticKeyValue` for forward_with_cache."""
        return StaticKeyValue(*ops.project_key_value(
            key=key, value=value, num_heads=self.num_heads, in_proj_weight=self.in_proj_weight,
            in_proj_bias=self.in_proj_bias, k_proj_weight=self.k_proj_weight, v_proj_weight=self.v_proj_weight,
            batch_first=self.batch_first, bias_k=self.bias_k, bias_v=self.bias_v, add_zero_attn=self.add_zero_attn,
        ))


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
