"""Cached generation with the Transformer models people already have (C++: cached_decoder.h).

``CachedDecoder(model)`` wraps an ``nn.Transformer`` (its decoder), an ``nn.TransformerDecoder``
or an ``nn.TransformerEncoder`` run causally, and runs its layers one step at a time over a
key/value cache, in one C++ op a step (``torch.ops.torchmha.decoder_step``)::

    dec = torchmha.CachedDecoder(model.eval())
    state = dec.new_state(batch_size, max_length, memory=memory)
    y = dec(prompt, state)          # prefill: the model's output at the prompt's positions
    y_t = dec(x_t, state)           # then one (or more) positions at a time

The parameters are the model's own, read on every step; nothing is copied. With
``weight_dtype=torch.int8`` the layers' linear weights are read as int8 copies instead (one scale
per output channel), made once and made again when a weight changes.
"""

import functools
import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._ops import ops, rules
from .kv_cache import Slots, as_slot_index
from .multihead_attention import MultiheadAttention

_ATTENTIONS = (nn.MultiheadAttention, MultiheadAttention)
# The activations the C++ step computes, by the callables torch's layers are built with.
_ACTIVATION_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", F.gelu: "gelu", F.silu: "silu"}


# Other callables, each registered once as an op Tensor(Tensor) that the C++ step calls through
# the dispatcher (a fake kernel keeps it traceable): id -> (the callable, kept alive so that its
# id stays its own; the op's name).
_CUSTOM_ACTIVATIONS: dict = {}


def _activation_name(activation) -> str:
    if activation in _ACTIVATION_FUNCTIONS:
        return _ACTIVATION_FUNCTIONS[activation]
    if type(activation) is nn.ReLU:
        return "relu"
    if type(activation) is nn.SiLU:
        return "silu"
    if type(activation) is nn.GELU:
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    if not callable(activation):
        raise TypeError(f"CachedDecoder: the layers' activation must be a string or a callable, not "
                        f"{_type_name(activation)}")
    if id(activation) not in _CUSTOM_ACTIVATIONS:
        _CUSTOM_ACTIVATIONS[id(activation)] = (activation, _register_activation(activation))
    return "op:" + _CUSTOM_ACTIVATIONS[id(activation)][1]


def _register_activation(activation) -> str:
    name = f"torchmha_activations::activation_{len(_CUSTOM_ACTIVATIONS)}"

    @torch.library.custom_op(name, mutates_args=())
    def apply(x: Tensor) -> Tensor:
        y = activation(x)
        # an op's output may not alias its input (an in-place or identity activation would)
        return y.clone() if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else y

    apply.register_fake(lambda x: torch.empty_like(x))
    return name


def _type_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_type(module, allowed: tuple, what: str) -> None:
    if type(module) not in allowed:
        names = " or ".join(f"{t.__module__}.{t.__qualname__}" for t in allowed)
        raise TypeError(f"CachedDecoder: {what} must be exactly {names}, not {_type_name(module)}")


def _stack_of(model: nn.Module) -> Tuple[List[nn.Module], Optional[nn.Module], bool]:
    """(layers, final norm, is_decoder) of a supported model, or TypeError naming its type."""
    if type(model) is nn.Transformer:
        model = model.decoder
    if type(model) is nn.TransformerDecoder:
        layer_type, decoder = nn.TransformerDecoderLayer, True
    elif type(model) is nn.TransformerEncoder:
        layer_type, decoder = nn.TransformerEncoderLayer, False
    else:
        raise TypeError(
            "CachedDecoder takes an nn.Transformer, nn.TransformerDecoder or nn.TransformerEncoder, "
            f"not {_type_name(model)}"
        )
    layers = list(model.layers)
    if not layers:
        raise ValueError("CachedDecoder: the model has no layers")
    for i, layer in enumerate(layers):
        _check_type(layer, (layer_type,), f"layer {i}")
        attentions = (layer.self_attn, layer.multihead_attn) if decoder else (layer.self_attn,)
        for attention in attentions:
            _check_type(attention, _ATTENTIONS, f"layer {i}'s attention")
            if not attention._qkv_same_embed_dim or attention.bias_k is not None or attention.add_zero_attn:
                raise TypeError(f"CachedDecoder: layer {i}'s attention must have torch's layer configuration "
                                "(packed in-projection, no bias_k/bias_v, no add_zero_attn)")
        norms = (layer.norm1, layer.norm2, layer.norm3) if decoder else (layer.norm1, layer.norm2)
        for module, allowed, what in [(layer.linear1, (nn.Linear,), "linear1"), (layer.linear2, (nn.Linear,), "linear2"),
                                      *[(n, (nn.LayerNorm,), "norm") for n in norms]]:
            _check_type(module, allowed, f"layer {i}'s {what}")
    if model.norm is not None:
        _check_type(model.norm, (nn.LayerNorm,), "the final norm")
    return layers, model.norm, decoder


def _lookup(d: dict, name: str, entries: Optional[list]):
    """d[name], recorded as (d, name, value) in entries (when given) for _entries_unchanged."""
    value = d[name]
    if entries is not None:
        entries.append((d, name, value))
    return value


def _p(module: nn.Module, name: str, entries: Optional[list]) -> Optional[Tensor]:
    # The module's dict, not nn.Module.__getattr__ (about a microsecond a name, 18 names a layer).
    parameters = module.__dict__["_parameters"]
    if name in parameters:
        return _lookup(parameters, name, entries)
    if entries is not None:
        entries.append(None)  # a plain attribute (functional_call may leave one): not checked, read again
    return getattr(module, name)


def _attention_params(attention: nn.Module, entries: Optional[list]) -> list:
    out_proj = _lookup(attention.__dict__["_modules"], "out_proj", entries)
    return [_p(attention, "in_proj_weight", entries), _p(attention, "in_proj_bias", entries),
            _p(out_proj, "weight", entries), _p(out_proj, "bias", entries)]


def _module_params(module: Optional[nn.Module], entries: Optional[list]) -> list:
    return [None, None] if module is None else [_p(module, "weight", entries), _p(module, "bias", entries)]


class _Int8Weights:
    """The int8 copies of the layers' linear weights and their scales, in the ops' parameter order
    (torch.ops.torchmha.decoder_quantize), and the stamps of the weights they were made from: their
    ids (replaced), versions (written in place) and data pointers (given new data, moved or cast by
    module.to())."""

    def __init__(self, params: List[Optional[Tensor]]) -> None:
        self.weights, self.scales = ops.decoder_quantize(params)
        self.slots = [i for i, w in enumerate(self.weights) if w is not None]
        self.stamps = self._stamps(params)
        if any(params[i].is_inference() for i in self.slots):  # (no version to stamp: -1)
            warnings.warn("CachedDecoder: the model's weights are inference tensors (made under "
                          "torch.inference_mode), which keep no version counter, so a step cannot see a change "
                          "written into them in place (load_state_dict under inference_mode, for one); call "
                          "refresh() after one", stacklevel=3)

    def _stamps(self, params: List[Optional[Tensor]]) -> List[int]:
        return rules._tensor_stamps(params, self.slots)

    def fresh(self, params: List[Optional[Tensor]]) -> bool:
        return self._stamps(params) == self.stamps

    def apply(self, params: List[Optional[Tensor]]) -> List[Optional[Tensor]]:
        """params with the int8 copies in the weights' places."""
        for i in self.slots:
            params[i] = self.weights[i]
        return params


class DecoderState:
    """What a generation holds between steps (from :meth:`CachedDecoder.new_state`).

    ``keys``, ``values``: (layers, N, H, max_length, head_dim), the self-attention caches;
    ``lengths``: (N,) int64, the positions filled per sequence; a decoder's ``memory_keys``,
    ``memory_values`` (layers, N, H, S, head_dim), projected once, and ``memory_padding`` (N, S),
    additive.
    """

    def __init__(self, decoder: "CachedDecoder", keys: Tensor, values: Tensor,
                 memory: Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]) -> None:
        self._decoder = decoder
        self.keys, self.values = keys, values
        self.lengths = torch.zeros(keys.shape[1], dtype=torch.long, device=keys.device)
        self.memory_keys, self.memory_values, self.memory_padding = memory

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]

    def _cache(self) -> tuple:
        """The decoder ops' DecoderCache (csrc/include/torchmha/attention_arguments.h), in schema order."""
        return self.keys, self.values, self.lengths, self.memory_keys, self.memory_values, self.memory_padding

    def reorder(self, indices: Tensor) -> None:
        """Beam search: sequence i becomes old sequence ``indices[i]``: its caches, length, memory
        and memory mask (in place)."""
        ops.decoder_reorder(*self._cache(), indices)

    def reset(self, slots: Slots = None, memory: Optional[Tensor] = None,
              memory_key_padding_mask: Optional[Tensor] = None) -> None:
        """Empties the sequences ``slots`` (an int, a list of ints, a 1-D integer tensor or a bool
        mask; all if None), so new ones start there while the others go on. A decoder's new
        sequences may bring their own ``memory`` (in the model's layout, batch = the slots named;
        at most the state's memory length, the rest masked) and its padding mask; without it they
        keep the memory they had."""
        slots = as_slot_index(slots, self.lengths.device)
        new = (None, None, None)
        if memory is not None:
            new = self._decoder._project_memory(memory, memory_key_padding_mask)
        elif memory_key_padding_mask is not None:
            raise ValueError("CachedDecoder state.reset: memory_key_padding_mask goes with a new memory")
        ops.decoder_reset(*self._cache(), slots, *new)

    def __repr__(self) -> str:
        layers, n, h, m, d = self.keys.shape
        memory = "" if self.memory_keys is None else f", memory_length={self.memory_keys.shape[3]}"
        return (f"DecoderState(layers={layers}, batch_size={n}, num_heads={h}, max_length={m}, head_dim={d}"
                f"{memory}, lengths={self.lengths.tolist()})")


class CachedDecoder(nn.Module):
    """Incremental generation through ``model``'s layers with a key/value cache.

    ``model``: an ``nn.Transformer`` (its decoder and the decoder's final norm), an
    ``nn.TransformerDecoder``, or an ``nn.TransformerEncoder`` run causally (a decoder-only
    model), whose layers are exactly torch's ``nn.TransformerDecoderLayer`` /
    ``nn.TransformerEncoderLayer`` (their attention torch's or torchmha's). Any configuration
    torch's layers have: norm_first, any activation (relu, gelu and silu computed in C++, any other
    callable called from the step through an op registered for it), bias=False, batch_first,
    layer_norm_eps, a final LayerNorm or none, any float dtype, the model's device.

    Each call ``dec(tgt, state, new_lengths=None)`` appends ``tgt``'s positions to each sequence and
    returns the model's output there: equal to the model's causal forward over each sequence's own
    prefix. It runs in one op (``torch.ops.torchmha.decoder_step``) reading the model's current
    parameters; the layers' structure (types, activations, norm_first, the norms' eps) is read at
    construction. The model must be in eval mode.

    ``weight_dtype=torch.int8`` reads int8 copies of the layers' linear weights instead (the
    attentions' in- and out-projections, linear1, linear2): symmetric, one float32 scale per
    output channel (``torch.ops.torchmha.quantize_weight``). Activations, biases, norms and the caches keep
    the model's dtype; the model's parameters are left as they are. A step notices a weight that
    changed since (trained further, loaded, replaced, moved) and quantizes again; ``refresh()``
    does so at once, and is needed after a write through ``.data`` (which no version counter
    sees), after a write in place into inference tensors (a model made under
    ``torch.inference_mode`` keeps no version counter: the decoder warns) and, under
    ``torch.compile``, after any change. On the CPU a step reads a quarter of float32's weight
    bytes; elsewhere the int8 weights are dequantized per layer (the same result, not faster).
    """

    def __init__(self, model: nn.Module, weight_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        layers, final_norm, decoder = _stack_of(model)
        self.model = model
        self.is_decoder = decoder
        self._layers = layers
        self._final_norm = final_norm
        first = layers[0].self_attn
        self.num_heads: int = first.num_heads
        self.head_dim: int = first.head_dim
        self.batch_first: bool = first.batch_first
        # The layers' structure, read once (33 us a step when it was read on every step, for 6
        # layers), as torch's layers fix their fast path's activation at construction; the
        # parameters are read on every step.
        self._activations = [_activation_name(layer.activation) for layer in layers]
        self._norm_first = [bool(layer.norm_first) for layer in layers]
        self._eps = [float(getattr(layer, name).eps) if hasattr(layer, name) else 1e-5
                     for layer in layers for name in ("norm1", "norm2", "norm3")]
        self._final_eps = None if final_norm is None else float(final_norm.eps)
        if weight_dtype not in (None, torch.int8):
            raise ValueError(f"CachedDecoder: weight_dtype must be None (the model's own weights) or torch.int8, "
                             f"not {weight_dtype}")
        self.weight_dtype: Optional[torch.dtype] = weight_dtype
        self._int8: Optional[_Int8Weights] = None
        # The last walk over the modules: the (dict, key, value) entries it read and the parameters,
        # served while every entry still holds (parameter_list). It keeps the last step's
        # parameters alive until the next step or parameter_list() after a replacement.
        self._last_read: Optional[Tuple[list, List[Optional[Tensor]]]] = None
        self.refresh()

    def refresh(self) -> None:
        """With weight_dtype=torch.int8: quantizes the layers' linear weights again, from the
        model's parameters now (a step also does so when it sees that one changed)."""
        if self.weight_dtype is torch.int8:
            self._int8 = _Int8Weights(self.parameter_list())

    def _step_params(self) -> Tuple[List[Optional[Tensor]], List[Optional[Tensor]]]:
        """The ops' params and weight_scales: the model's parameters, with the int8 copies (made
        again if a weight changed) in the weights' places."""
        params = self.parameter_list()
        if self._int8 is None:
            return params, []
        # (torch.compile cannot trace the stamps' data pointers: a compiled step serves the int8
        # weights as they are; refresh() after a change)
        if not torch.compiler.is_compiling() and not self._int8.fresh(params):
            self._int8 = _Int8Weights(params)
        return self._int8.apply(params), self._int8.scales

    def parameter_list(self) -> List[Optional[Tensor]]:
        """The layers' parameters in the op's order (functional.h: 18 a layer, then the final
        norm's), read from the modules now.

        A walk over the modules (their _modules and _parameters dicts) records each entry it read;
        while one C++ call (rules._entries_unchanged) finds every entry as it was, the walk's list
        is served again. After a step's weights have streamed through the caches every object a
        walk touches is a miss: the walk cost 33-52 us more a step than the check (int8, bfloat16
        and float32 steps of the generation model, AMD EPYC; benchmarks/README.md)."""
        if torch.compiler.is_compiling():  # (dynamo cannot trace the C++ check)
            return self._read_parameters(None)
        if self._last_read is not None and rules._entries_unchanged(self._last_read[0]):
            return list(self._last_read[1])
        entries: list = []
        params = self._read_parameters(entries)
        self._last_read = None if any(e is None for e in entries) else (entries, params)
        return list(params)

    def _read_parameters(self, entries: Optional[list]) -> List[Optional[Tensor]]:
        """The walk over the modules, recording in entries each dict entry it read."""
        params: List[Optional[Tensor]] = []
        for layer in self._layers:
            modules = layer.__dict__["_modules"]
            child = functools.partial(_lookup, modules, entries=entries)
            params += _attention_params(child("self_attn"), entries)
            params += _attention_params(child("multihead_attn"), entries) if self.is_decoder else [None] * 4
            params += _module_params(child("linear1"), entries) + _module_params(child("linear2"), entries)
            params += _module_params(child("norm1"), entries) + _module_params(child("norm2"), entries)
            params += _module_params(child("norm3") if self.is_decoder else None, entries)
        return params + _module_params(self._final_norm, entries)

    def _project_memory(self, memory: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        if not self.is_decoder:
            raise ValueError("CachedDecoder: an encoder has no memory; new_state and reset take memory only "
                             "for a decoder (nn.Transformer, nn.TransformerDecoder)")
        params, scales = self._step_params()
        return ops.decoder_memory(memory, params, self.num_heads, self.batch_first, mask, scales)

    def new_state(self, batch_size: int, max_length: int, memory: Optional[Tensor] = None,
                  memory_key_padding_mask: Optional[Tensor] = None) -> DecoderState:
        """An empty state for ``batch_size`` sequences of up to ``max_length`` positions. A
        decoder needs its ``memory`` (in the model's layout), projected here once per layer, and
        takes torch's ``memory_key_padding_mask`` (N, S): bool (True = ignore) or float (added)."""
        weight = self._layers[0].self_attn.out_proj.weight
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(f"CachedDecoder.new_state: batch_size and max_length must be positive, "
                             f"but got {batch_size} and {max_length}")
        if self.is_decoder and memory is None:
            raise ValueError("CachedDecoder.new_state: a decoder needs memory (the encoder's output)")
        projected = (None, None, None)
        if memory is not None:
            projected = self._project_memory(memory, memory_key_padding_mask)
            if projected[0].shape[1] != batch_size:
                raise ValueError(f"CachedDecoder.new_state: memory {tuple(memory.shape)} holds "
                                 f"{projected[0].shape[1]} sequences, but batch_size is {batch_size}")
        shape = (len(self._layers), batch_size, self.num_heads, max_length, self.head_dim)
        keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        return DecoderState(self, keys, torch.zeros_like(keys), projected)

    def forward(self, tgt: Tensor, state: DecoderState, new_lengths: Optional[Tensor] = None) -> Tensor:
        """Appends ``tgt`` ((T, N, E), batch_first (N, T, E)) to the sequences of ``state`` and returns
        the model's output at those positions; sequence n takes its first ``new_lengths[n]``
        ((N,) int64; all T if None), and its rows past that are zeros."""
        params, scales = self._step_params()
        return ops.decoder_step(
            tgt, params, *state._cache(), self.num_heads, self._activations, self._norm_first,
            self._eps, self._final_eps, self.batch_first, self.model.training, new_lengths, scales,
        )
