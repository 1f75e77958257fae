"""The C++ modules themselves (torch::python::bind_module), for interop with C++ code.

These are LibTorch modules seen from Python (torch.nn.cpp-style wrappers), not torch.nn.Modules:
use torchmha.MultiheadAttention & co. in Python models, and these to check or move weights
between a C++ module and its Python counterpart with :func:`copy_parameters`.
"""

import torch

from ._C import cpp as _cpp

MultiheadAttention = _cpp.MultiheadAttention
MultiheadAttentionV1 = _cpp.MultiheadAttentionV1
MultiheadAttentionV2 = _cpp.MultiheadAttentionV2
MultiheadAttentionV3 = _cpp.MultiheadAttentionV3
MultiheadAttentionV4 = _cpp.MultiheadAttentionV4
# Decoding caches and layers (kv_cache.h, cross_attention.h, transformer_block.h)
CrossAttention = _cpp.CrossAttention
TransformerBlock = _cpp.TransformerBlock
KeyValueCache = _cpp.KeyValueCache
StaticKeyValue = _cpp.StaticKeyValue



def _unwrap(module):
    # The classes above are torch.nn.cpp.ModuleWrapper subclasses; the C++ object is .cpp_module.
    return getattr(module, "cpp_module", module)


def save_state_dict(module, path) -> None:
    """Runs the C++ ``torchmha::save_state_dict`` on a C++ module of this namespace: writes its
    parameters and buffers by name in torch.save's format, which ``torch.load(path)`` reads back
    as a dict for ``load_state_dict`` of torchmha's or torch's Python modules."""
    _cpp.save_state_dict(_unwrap(module), str(path))


def load_state_dict(module, path) -> None:
    """Runs the C++ ``torchmha::load_state_dict``: loads into a C++ module of this namespace a
    file written by ``torch.save(dict(python_module.state_dict()), path)`` (a plain dict: LibTorch
    cannot unpickle the OrderedDict that state_dict() returns) or by save_state_dict.
    Strict: names and shapes must match (RuntimeError listing the differences)."""
    _cpp.load_state_dict(_unwrap(module), str(path))


def copy_parameters(src, dst) -> None:
    """Copies every parameter of ``src`` into the parameter of the same name in ``dst``; either
    may be a C++ module from this namespace or a Python module (torchmha's or torch's). Names
    and shapes must match exactly (a KeyError or ValueError says which do not)."""
    src_params, dst_params = dict(src.named_parameters()), dict(dst.named_parameters())
    if src_params.keys() != dst_params.keys():
        raise KeyError(
            f"parameter names differ: only in source {sorted(src_params.keys() - dst_params.keys())}, "
            f"only in destination {sorted(dst_params.keys() - src_params.keys())}"
        )
    with torch.no_grad():
        for name, value in src_params.items():
            target = dst_params[name]
            if target.shape != value.shape:
                raise ValueError(f"parameter {name}: source shape {tuple(value.shape)} != destination {tuple(target.shape)}")
            target.copy_(value)
