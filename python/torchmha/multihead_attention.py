"""torchmha.MultiheadAttention: torch.nn.MultiheadAttention with forward computed by the C++ core
(C++: multihead_attention.h), its decoding methods, and replace_multihead_attention."""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ._ops import attention_options, attention_parameters, decoding_options, fast_path_allowed, ops
from .functional import warn_if_mask_dtypes_differ
from .kv_cache import KeyValueCache, StaticKeyValue


def _parameter(module: nn.Module, name: str):
    # nn.Module.__getattr__ costs about a microsecond per name; a name that is not a registered
    # parameter (a parametrization's property, a plain attribute) is read as usual.
    parameters = module.__dict__["_parameters"]
    return parameters[name] if name in parameters else getattr(module, name)


@torch.jit.unused
def _parameters_of(module: nn.MultiheadAttention):
    """The module's parameters as the ops take them (eager mode; TorchScript reads the attributes)."""
    modules = module.__dict__["_modules"]
    out_proj = modules["out_proj"] if "out_proj" in modules else module.out_proj
    return attention_parameters(
        module.num_heads, None, _parameter(module, "in_proj_weight"), _parameter(module, "in_proj_bias"),
        _parameter(module, "q_proj_weight"), _parameter(module, "k_proj_weight"), _parameter(module, "v_proj_weight"),
        None, None, None, _parameter(module, "bias_k"), _parameter(module, "bias_v"), module.add_zero_attn,
        _parameter(out_proj, "weight"), _parameter(out_proj, "bias"),
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
            params = attention_parameters(
                self.num_heads, None, self.in_proj_weight, self.in_proj_bias, self.q_proj_weight, self.k_proj_weight,
                self.v_proj_weight, None, None, None, self.bias_k, self.bias_v, self.add_zero_attn,
                self.out_proj.weight, self.out_proj.bias,
            )
        else:
            params = _parameters_of(self)
        # Positional: torch.ops matches keyword arguments against the schema by name, 60k instructions
        # a call for 24 of them (callgrind), a fifth of what a 16-token call spent beyond its GEMMs.
        return ops.multi_head_attention_forward(
            query, key, value, self.embed_dim, *params,
            *attention_options(key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal,
                               self.training, self.batch_first, self.dropout, fast_path_allowed()),
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
        params = _parameters_of(self)
        options = decoding_options(key_padding_mask, self.dropout, self.training, self.batch_first)
        if isinstance(cache, KeyValueCache):  # (positional, as in forward: one call a token)
            return ops.attention_with_cache(query, cache.keys, cache.values, cache.lengths, *params, *options,
                                            new_lengths)
        if new_lengths is not None:
            raise ValueError("forward_with_cache: new_lengths is for a KeyValueCache")
        if isinstance(cache, StaticKeyValue):
            return ops.attention_with_static_key_value(query, cache.keys, cache.values, *params, *options)
        cache_type = f"{type(cache).__module__}.{type(cache).__qualname__}"
        raise TypeError(
            f"cache must be a torchmha.KeyValueCache or torchmha.StaticKeyValue, not {cache_type} "
            "(the torchmha.cpp classes go with torchmha.cpp modules)"
        )

    def project_key_value(self, key: Tensor, value: Optional[Tensor] = None) -> StaticKeyValue:
        """Projects a fixed memory (key (S, N, kdim), value (S, N, vdim), batch_first: (N, S, *);
        value defaults to key) once into a :class:`torchmha.StaticKeyValue` for forward_with_cache."""
        return StaticKeyValue(*ops.project_key_value(key, value, *_parameters_of(self), self.batch_first))


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
