"""torchmha.cpp: the C++ modules seen from Python, weight copies between C++ and Python, the import
order, and the same calls, good and bad, through the C++ and the Python classes (same result, or
the same exception with the same message)."""

import contextlib
import functools
import subprocess
import sys
import warnings
from typing import NamedTuple

import pytest
import torch

import torchmha
from helpers import assert_close, causal_mask, decode, mha_pair, padding_mask


def test_cpp_and_python_modules_agree_after_copying_weights():
    cpp = torchmha.cpp.MultiheadAttention(8, 2, add_bias_kv=True, kdim=3, vdim=5, batch_first=True)
    py = torchmha.MultiheadAttention(8, 2, add_bias_kv=True, kdim=3, vdim=5, batch_first=True)
    ref = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, kdim=3, vdim=5, batch_first=True)
    torchmha.cpp.copy_parameters(cpp, py)
    torchmha.cpp.copy_parameters(py, ref)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 6, 3), torch.randn(2, 6, 5)
    out_cpp, w_cpp = cpp.forward(q, k, v)
    out_py, w_py = py(q, k, v)
    assert_close(out_cpp, out_py, torch.float32)
    assert_close(w_cpp, w_py, torch.float32)
    assert_close(ref(q, k, v)[0], out_py, torch.float32)
    # And the other way: Python weights into the C++ module.
    fresh = torchmha.cpp.MultiheadAttention(8, 2, add_bias_kv=True, kdim=3, vdim=5, batch_first=True)
    torchmha.cpp.copy_parameters(ref, fresh)
    assert_close(fresh.forward(q, k, v)[0], out_py, torch.float32)


@pytest.mark.parametrize("name,args,call", [
    ("MultiheadAttentionV1", (8,), lambda m, x: m(x)),
    ("MultiheadAttentionV2", (8, 2), lambda m, x: m(x)),
    ("MultiheadAttentionV3", (8, 2), lambda m, x: m(x, x, x)),
    ("MultiheadAttentionV4", (8, 2), lambda m, x: m(x, x, x)),
])
def test_cpp_versions_agree_with_python_versions(name, args, call):
    cpp = getattr(torchmha.cpp, name)(*args)
    py = getattr(torchmha, name)(*args)
    torchmha.cpp.copy_parameters(py, cpp)
    x = torch.randn(5, 2, 8)
    assert_close(call(cpp.forward, x), call(py, x), torch.float32)


def test_cpp_module_decoding_matches_python():
    E, H, N, L = 16, 4, 3, 11
    ref, ours = mha_pair(E, H, dtype=torch.float32, seed=5)
    cpp_mha = torchmha.cpp.MultiheadAttention(E, H)
    torchmha.cpp.copy_parameters(ours, cpp_mha)
    cpp_mha.eval()
    x = torch.randn(L, N, E)
    kpm = padding_mask(N, L)
    expected = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(L), need_weights=False)[0]
    cache = torchmha.cpp.KeyValueCache.for_module(cpp_mha, N, L)
    with torch.no_grad():
        actual = decode(cpp_mha, x, cache, 2, False, kpm)
    assert cache.length == L and cache.keys.shape == (N, H, L, E // H)
    assert_close(actual, expected, torch.float32)


def test_cpp_cross_attention_matches_python():
    py = torchmha.CrossAttention(12, context_dim=6, heads=3, dim_head=5)
    cpp = torchmha.cpp.CrossAttention(12, context_dim=6, heads=3, dim_head=5)
    torchmha.cpp.copy_parameters(py, cpp)
    x, context = torch.randn(2, 7, 12), torch.randn(2, 9, 6)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 4:] = False
    assert_close(cpp.forward(x, context, keep), py(x, context, keep), torch.float32)
    assert_close(cpp.forward_with_cache(x, cpp.project_context(context), keep), py(x, context, keep), torch.float32)


def test_cpp_transformer_block_matches_python():
    py = torchmha.TransformerBlock(16, 4, forward_expansion=2, norm_first=True).eval()
    cpp = torchmha.cpp.TransformerBlock(16, 4, forward_expansion=2, norm_first=True)
    torchmha.cpp.copy_parameters(py, cpp)
    cpp.eval()
    x = torch.randn(2, 5, 16)
    assert_close(cpp.forward(x, causal_mask(5)), py(x, causal_mask(5)), torch.float32)


def test_copy_parameters_rejects_mismatches():
    with pytest.raises(KeyError, match="only in source"):
        torchmha.cpp.copy_parameters(torchmha.cpp.MultiheadAttention(8, 2, kdim=3), torchmha.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match="in_proj_weight"):
        torchmha.cpp.copy_parameters(torchmha.cpp.MultiheadAttention(8, 2), torchmha.MultiheadAttention(4, 2))


def test_cpp_module_initialises_like_torch():
    """Same seed, same parameters: LibTorch's Linear and init functions draw like torch's."""
    torch.manual_seed(11)
    cpp = torchmha.cpp.MultiheadAttention(8, 2, add_bias_kv=True)
    torch.manual_seed(11)
    ref = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    cpp_params = dict(cpp.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(cpp_params[name], p), name


def test_cpp_errors_reach_python_with_torchs_types():
    cpp = torchmha.cpp.MultiheadAttention(8, 2)
    x = torch.randn(4, 2, 8)
    with pytest.raises(AssertionError, match="query"):
        cpp.forward(x[None], x[None], x[None])
    with pytest.raises(ValueError):
        torchmha.cpp.MultiheadAttention(8, 0)


def test_import_before_torch():
    """torchmha imported before torch works: its __init__.py imports torch before the extension
    (without that line, _C fails to load: 'referenced unknown base type "torch::nn::Module"')."""
    code = "import torchmha, torch; m = torchmha.MultiheadAttention(4, 2); x = torch.randn(3, 1, 4); print(m(x, x, x)[0].shape)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([3, 1, 4])" in result.stdout


# --------------------------------------------------------- the same calls in both languages
# Each pair (a Python class of torchmha, its torchmha.cpp twin) is built in float64 with the same
# parameters; each call runs on both, and both must give equal results (1e-10), or raise the same
# exception type with the same message. A call is `call(module, namespace)`, the namespace being
# torchmha or torchmha.cpp (for the caches). Calls a side rejects in Python before its core (a
# TypeError for a cache of the other language) do not belong here.

F64 = torch.float64


class Failed(NamedTuple):
    """A call that raised: its type and message (C++ backtrace stripped)."""

    type: type
    message: str


def attempt(fn):
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - the type and message are what is compared
        message = str(error).split("Exception raised from")[0].rstrip()
        return Failed(type(error), message)


def steps(cache, *calls):
    """Runs the calls one after another (an error does not stop the next), recording after each
    its result or error and the cache's keys, values and length."""
    record = []
    for call in calls:
        record.append(attempt(call))
        record.append((cache.keys.clone(), cache.values.clone(), cache.length))
    return record


def flat(result):
    """A result as a flat list of tensors, numbers, None and Failed, either language's classes alike."""
    if isinstance(result, (torch.Tensor, Failed)) or result is None:
        return [result]
    if isinstance(result, (torchmha.KeyValueCache, torchmha.cpp.KeyValueCache)):
        return [result.keys, result.values, result.length]
    if isinstance(result, torchmha.cpp.StaticKeyValue):
        return [result.keys, result.values]
    if isinstance(result, (tuple, list)):  # torchmha.StaticKeyValue is a NamedTuple
        return [item for r in result for item in flat(r)]
    return [result]


def assert_same_outcome(python_result, cpp_result):
    python_items, cpp_items = flat(python_result), flat(cpp_result)
    describe = [type(i).__name__ for i in python_items], [type(i).__name__ for i in cpp_items]
    assert len(python_items) == len(cpp_items), f"Python returned {describe[0]}, C++ {describe[1]}"
    for index, (p, c) in enumerate(zip(python_items, cpp_items)):
        where = f"item {index} of {len(python_items)}"
        if isinstance(p, Failed) or isinstance(c, Failed):
            assert p == c, f"{where}: Python {p}, C++ {c}"
        elif isinstance(p, torch.Tensor):
            assert isinstance(c, torch.Tensor), f"{where}: Python a tensor, C++ {c!r}"
            assert (p.shape, p.dtype) == (c.shape, c.dtype), f"{where}: Python {p.shape} {p.dtype}, C++ {c.shape} {c.dtype}"
            torch.testing.assert_close(c, p, atol=1e-10, rtol=0, equal_nan=True, msg=lambda text: f"{where} (C++ vs Python): {text}")
        else:
            assert p == c, f"{where}: Python {p!r}, C++ {c!r}"


def twins(python_class, cpp_class, *args, **kwargs):
    """(Python module, C++ module) in float64 with the same random parameters (biases included)."""
    python_module = python_class(*args, **kwargs, dtype=F64)
    with torch.no_grad():
        for parameter in python_module.parameters():
            parameter.normal_(std=0.5)
    cpp_module = cpp_class(*args, **kwargs)
    cpp_module.to(F64)  # positional dtype; converts in place
    torchmha.cpp.copy_parameters(python_module, cpp_module)
    return python_module, cpp_module


@contextlib.contextmanager
def torch_fast_path_disabled():
    """torch.backends.mha.set_fastpath_enabled(False): torch, and torchmha's Python classes, leave
    the fused inference path."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def randn(*shape):
    return torch.randn(*shape, dtype=F64)


MHA_CONFIGS = {
    "plain": dict(embed_dim=8, num_heads=2),
    "batch_first": dict(embed_dim=8, num_heads=2, batch_first=True),
    "kdim_vdim": dict(embed_dim=8, num_heads=2, kdim=3, vdim=5),
    "kdim_vdim_batch_first": dict(embed_dim=8, num_heads=4, kdim=6, vdim=6, batch_first=True),
    "bias_kv_zero_attn": dict(embed_dim=8, num_heads=4, add_bias_kv=True, add_zero_attn=True),
    "no_bias": dict(embed_dim=12, num_heads=3, bias=False),
    "dropout": dict(embed_dim=8, num_heads=2, dropout=0.3, batch_first=True),
}


def multihead_attention_calls(config):
    """Calls of MultiheadAttention.forward for a module of `config`: N=2, L=4, S=5."""
    E, H = config["embed_dim"], config["num_heads"]
    kdim, vdim = config.get("kdim", E), config.get("vdim", E)
    batch_first = config.get("batch_first", False)

    def seq(length, features, batch=2):
        return randn(batch, length, features) if batch_first else randn(length, batch, features)

    x, k, v = seq(4, E), seq(5, kdim), seq(5, vdim)
    bool_mask = torch.rand(4, 5) > 0.6
    bool_mask[:, 0] = False
    kpm = torch.rand(2, 5) > 0.6
    kpm[:, 0] = False
    fully_padded = torch.zeros(2, 5, dtype=torch.bool)
    fully_padded[1] = True
    calls = {
        "keys and values": lambda m: m(x, k, v),
        "bool key_padding_mask": lambda m: m(x, k, v, key_padding_mask=kpm),
        "float key_padding_mask": lambda m: m(x, k, v, key_padding_mask=randn(2, 5)),
        "bool attn_mask": lambda m: m(x, k, v, attn_mask=bool_mask),
        "float 3-D attn_mask": lambda m: m(x, k, v, attn_mask=randn(2 * H, 4, 5)),
        "both bool masks, need_weights=False": lambda m: m(x, k, v, key_padding_mask=kpm, attn_mask=bool_mask, need_weights=False),
        "per-head weights": lambda m: m(x, k, v, average_attn_weights=False),
        "fully padded sample": lambda m: m(x, k, v, key_padding_mask=fully_padded, need_weights=False),
        "unbatched": lambda m: m(randn(4, E), randn(5, kdim), randn(5, vdim)),
        "NaN in query": lambda m: m(x.clone().fill_(float("nan")), k, v),
        "empty batch": lambda m: m(seq(4, E, 0), seq(5, kdim, 0), seq(5, vdim, 0)),
        # bad
        "query 4-D": lambda m: m(x[None], k[None], v[None]),
        "query 1-D": lambda m: m(randn(E), randn(kdim), randn(vdim)),
        "key 2-D for a 3-D query": lambda m: m(x, k[0], v),
        "query embedding E+1": lambda m: m(seq(4, E + 1), k, v),
        "key embedding kdim+1": lambda m: m(x, seq(5, kdim + 1), v),
        "value embedding vdim+1": lambda m: m(x, k, seq(5, vdim + 1)),
        "key/value lengths differ": lambda m: m(x, k, seq(6, vdim)),
        "key batch differs from query": lambda m: m(x, seq(5, kdim, 3), seq(5, vdim, 3)),
        "attn_mask (L, L) for S != L": lambda m: m(x, k, v, attn_mask=bool_mask[:, :4]),
        "attn_mask 3-D wrong heads": lambda m: m(x, k, v, attn_mask=torch.zeros(H, 4, 5, dtype=torch.bool)),
        "attn_mask 4-D": lambda m: m(x, k, v, attn_mask=torch.zeros(2, H, 4, 5, dtype=torch.bool)),
        "attn_mask int64": lambda m: m(x, k, v, attn_mask=torch.zeros(4, 5, dtype=torch.int64)),
        "attn_mask float32": lambda m: m(x, k, v, attn_mask=torch.zeros(4, 5)),
        "key_padding_mask uint8": lambda m: m(x, k, v, key_padding_mask=torch.zeros(2, 5, dtype=torch.uint8)),
        "key_padding_mask of length L": lambda m: m(x, k, v, key_padding_mask=kpm[:, :4]),
        "key_padding_mask batch 3": lambda m: m(x, k, v, key_padding_mask=torch.zeros(3, 5, dtype=torch.bool)),
        "is_causal without attn_mask": lambda m: m(x, k, v, is_causal=True, need_weights=False),
        "float32 inputs": lambda m: m(x.float(), k.float(), v.float()),
        "meta inputs": lambda m: m(x.to("meta"), k.to("meta"), v.to("meta")),
    }
    if kdim == E and vdim == E:
        causal = causal_mask(4)
        calls.update({
            "self-attention": lambda m: m(x, x, x),
            "self-attention, is_causal with its mask": lambda m: m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False),
            "self-attention, fully padded sample": lambda m: m(x, x, x, key_padding_mask=fully_padded[:, :4], need_weights=False),
        })
    return calls


def version_calls():
    """name -> (python class, C++ class, constructor args, kwargs, calls); L=4, N=2, E=8."""
    x, kv = randn(4, 2, 8), randn(5, 2, 8)
    mask = torch.rand(4, 4) > 0.6
    mask[:, 0] = False
    k3, v5 = randn(5, 2, 3), randn(5, 2, 5)
    return {
        "V1": (torchmha.MultiheadAttentionV1, torchmha.cpp.MultiheadAttentionV1, (8,), {}, {
            "batched": lambda m: m(x),
            "unbatched": lambda m: m(x[:, 0]),
            "4-D": lambda m: m(x[None]),
            "1-D": lambda m: m(x[0, 0]),
            "embedding 6": lambda m: m(randn(4, 2, 6)),
            "float32": lambda m: m(x.float()),
        }),
        "V2": (torchmha.MultiheadAttentionV2, torchmha.cpp.MultiheadAttentionV2, (8, 2), dict(dropout=0.2), {
            "no mask": lambda m: m(x),
            "bool mask": lambda m: m(x, mask),
            "float 3-D mask": lambda m: m(x, randn(4, 4, 4)),
            "mask of another shape": lambda m: m(x, torch.zeros(3, 3, dtype=torch.bool)),
            "3-D mask wrong heads": lambda m: m(x, torch.zeros(2, 4, 4, dtype=torch.bool)),
            "int mask": lambda m: m(x, torch.zeros(4, 4, dtype=torch.int64)),
            "float32 mask": lambda m: m(x, torch.zeros(4, 4)),
            "embedding 6": lambda m: m(randn(4, 2, 6)),
        }),
        "V3": (torchmha.MultiheadAttentionV3, torchmha.cpp.MultiheadAttentionV3, (8, 2), dict(kdim=3, vdim=5), {
            "general": lambda m: m(x, k3, v5),
            "with mask": lambda m: m(x, k3, v5, mask[:, :1].expand(4, 5).contiguous()),
            "unbatched": lambda m: m(x[:, 0], k3[:, 0], v5[:, 0]),
            "key of embedding 4": lambda m: m(x, randn(5, 2, 4), v5),
            "value of embedding 3": lambda m: m(x, k3, randn(5, 2, 3)),
            "key/value lengths differ": lambda m: m(x, k3, randn(6, 2, 5)),
            "mask (L, L) for S != L": lambda m: m(x, k3, v5, mask),
        }),
        "V3 same dims": (torchmha.MultiheadAttentionV3, torchmha.cpp.MultiheadAttentionV3, (8, 4), {}, {
            "self": lambda m: m(x, x, x),
            "encoder-decoder": lambda m: m(x, kv, kv),
            "key batch 3": lambda m: m(x, randn(5, 3, 8), randn(5, 3, 8)),
        }),
        "V4": (torchmha.MultiheadAttentionV4, torchmha.cpp.MultiheadAttentionV4, (8, 2), {}, {
            "self": lambda m: m(x, x, x),
            "encoder-decoder": lambda m: m(x, kv, kv),
            "general": lambda m: m(x, kv, randn(5, 2, 8)),
            "with mask": lambda m: m(x, x, x, mask),
            "unbatched query, batched key": lambda m: m(x[:, 0], kv, kv),
            "key/value lengths differ": lambda m: m(x, kv, randn(6, 2, 8)),
            "3-D mask wrong heads": lambda m: m(x, x, x, torch.zeros(2, 4, 4, dtype=torch.bool)),
            "int mask": lambda m: m(x, x, x, torch.zeros(4, 4, dtype=torch.int32)),
            "query 4-D": lambda m: m(x[None], kv[None], kv[None]),
        }),
    }


def cross_attention_calls():
    """name -> (constructor args, kwargs, calls); N=2, L=7, S=9."""
    x, context = randn(2, 7, 12), randn(2, 9, 6)
    keep = torch.rand(2, 9) > 0.3
    keep[:, 0] = True
    nothing_kept = keep.clone()
    nothing_kept[1] = False
    with_context = {
        "with context": lambda m: m(x, context),
        "with mask": lambda m: m(x, context, keep),
        "a sample keeps no key": lambda m: m(x, context, nothing_kept),
        "projected context": lambda m: m.project_context(context),
        "cached step": lambda m: m.forward_with_cache(x[:, :1], m.project_context(context), keep),
        "float mask": lambda m: m(x, context, keep.double()),
        "mask of another length": lambda m: m(x, context, keep[:, :8]),
        "context embedding 5": lambda m: m(x, randn(2, 9, 5)),
        "query embedding 11": lambda m: m(randn(2, 7, 11), context),
        "unbatched": lambda m: m(x[0], context[0]),
        "context batch 3": lambda m: m(x, randn(3, 9, 6)),
        "cached step, context batch 3": lambda m: m.forward_with_cache(x[:, :1], m.project_context(randn(3, 9, 6))),
        "project 2-D context": lambda m: m.project_context(context[0]),
        "no context (context_dim differs)": lambda m: m(x),
        "float32 query": lambda m: m(x.float(), context),
    }
    y = randn(3, 5, 8)
    own_context = {
        "no context": lambda m: m(y),
        "no context, with mask": lambda m: m(y, None, torch.ones(3, 5, dtype=torch.bool)),
        "4-D": lambda m: m(y[None]),
    }
    return {
        "context_dim 6": ((12,), dict(context_dim=6, heads=3, dim_head=5), with_context),
        "own context": ((8,), dict(heads=2, dim_head=4, dropout=0.25), own_context),
    }


def transformer_block_calls():
    """name -> (constructor args, kwargs, calls); N=2, L=5, E=16, 4 heads."""
    x = randn(2, 5, 16)
    kpm = torch.rand(2, 5) > 0.7
    kpm[:, 0] = False
    fully_padded = torch.zeros(2, 5, dtype=torch.bool)
    fully_padded[1] = True
    calls = {
        "no mask": lambda m: m(x),
        "causal bool mask": lambda m: m(x, causal_mask(5)),
        "float 3-D mask": lambda m: m(x, randn(8, 5, 5)),
        "key_padding_mask": lambda m: m(x, None, kpm),
        "both masks": lambda m: m(x, causal_mask(5), kpm),
        "fully padded sample": lambda m: m(x, None, fully_padded),
        "unbatched": lambda m: m(x[0]),
        "mask of another shape": lambda m: m(x, torch.zeros(4, 4, dtype=torch.bool)),
        "key_padding_mask of another length": lambda m: m(x, None, kpm[:, :4]),
        "int mask": lambda m: m(x, torch.zeros(5, 5, dtype=torch.int64)),
        "float32 key_padding_mask": lambda m: m(x, None, torch.zeros(2, 5)),
        "embedding 12": lambda m: m(randn(2, 5, 12)),
        "4-D": lambda m: m(x[None]),
        "float32 input": lambda m: m(x.float()),
    }
    return {
        "post-norm": ((16, 4), dict(forward_expansion=2), calls),
        "pre-norm with dropout": ((16, 4), dict(forward_expansion=3, norm_first=True, dropout=0.1), calls),
    }


def cache_calls(config):
    """Decoding with a KeyValueCache, project_key_value and a StaticKeyValue, for a MultiheadAttention
    of `config` (E=8); each returns the step outcomes and the cache after each step."""
    E, H = config["embed_dim"], config["num_heads"]
    kdim, vdim = config.get("kdim", E), config.get("vdim", E)
    batch_first = config.get("batch_first", False)
    D = E // H

    def seq(length, features=E, batch=2):
        return randn(batch, length, features) if batch_first else randn(length, batch, features)

    def cut(t, start, stop):
        return t[:, start:stop] if batch_first else t[start:stop]

    x = seq(6)
    kpm = torch.rand(2, 6) > 0.7
    kpm[:, 0] = False

    def decoding(max_length, *chunks, batch=2, mask=None, make=None):
        def call(m, ns):
            cache = make(m, ns) if make else ns.KeyValueCache.for_module(m, batch, max_length)
            return steps(cache, *(
                (lambda start=start, stop=stop: m.forward_with_cache(cut(x, start, stop), cache, None if mask is None else mask[:, :stop]))
                for start, stop in chunks))
        return call

    def on_cache(max_length, *calls):
        def call(m, ns):
            cache = ns.KeyValueCache.for_module(m, 2, max_length)
            return steps(cache, *(lambda c=c: c(m, cache) for c in calls))
        return call

    memory, memory_value = seq(5, kdim), seq(5, vdim)
    memory_kpm = torch.rand(2, 5) > 0.7
    memory_kpm[:, 0] = False
    calls = {
        "project memory": lambda m, ns: m.project_key_value(memory, memory_value),
        "project memory, value defaults to key": lambda m, ns: m.project_key_value(memory),
        "attend to projected memory": lambda m, ns: m.forward_with_cache(x, m.project_key_value(memory, memory_value), memory_kpm),
        "project 2-D memory": lambda m, ns: m.project_key_value(memory[0], memory_value[0]),
        "project memory of embedding kdim+1": lambda m, ns: m.project_key_value(seq(5, kdim + 1), memory_value),
        "project key/value of other lengths": lambda m, ns: m.project_key_value(memory, seq(6, vdim)),
        "memory of batch 3": lambda m, ns: m.forward_with_cache(x, m.project_key_value(seq(5, kdim, 3), seq(5, vdim, 3))),
        "memory key_padding_mask of another length": lambda m, ns: m.forward_with_cache(
            x, m.project_key_value(memory, memory_value), memory_kpm[:, :4]),
        "memory split into other heads": lambda m, ns: m.forward_with_cache(
            x, ns.StaticKeyValue(randn(2, 2 * H, 5, D // 2), randn(2, 2 * H, 5, D // 2))),
        # self-attention caches
        "decode 3 + 1 + 2": decoding(6, (0, 3), (3, 4), (4, 6)),
        "decode one at a time with padding": decoding(8, *((t, t + 1) for t in range(6)), mask=kpm),
        "full cache": decoding(4, (0, 3), (3, 5)),
        "cache of batch 3": decoding(4, (0, 1), batch=3),
        "key_padding_mask of another length": decoding(4, (0, 1), (1, 2), mask=kpm[:, 1:]),
        "float32 key_padding_mask": decoding(4, (0, 1), mask=torch.zeros(2, 6)),
        "float32 cache": decoding(4, (0, 1), make=lambda m, ns: ns.KeyValueCache(2, H, 4, D, dtype=torch.float32)),
        "cache split into other heads": decoding(4, (0, 1), make=lambda m, ns: ns.KeyValueCache(2, 2 * H, 4, D // 2, dtype=F64)),
        "empty step": decoding(4, (0, 0), (0, 2)),
        "reset, then a new batch size": on_cache(
            4,
            lambda m, c: m.forward_with_cache(cut(x, 0, 3), c),
            lambda m, c: c.reset(),
            lambda m, c: m.forward_with_cache(cut(x, 0, 2), c),
            lambda m, c: c.reset(batch_size=3),
            lambda m, c: m.forward_with_cache(seq(2, E, 3), c),
            lambda m, c: c.reset(batch_size=0),
        ),
        "mixed lengths, reorder, reset a slot": on_cache(
            6,
            lambda m, c: m.forward_with_cache(cut(x, 0, 3), c, new_lengths=torch.tensor([3, 1])),
            lambda m, c: m.forward_with_cache(cut(x, 3, 4), c),
            lambda m, c: c.reorder(torch.tensor([1, 1])),
            lambda m, c: m.forward_with_cache(cut(x, 4, 5), c),
            lambda m, c: c.reset(torch.tensor([0])),
            lambda m, c: m.forward_with_cache(cut(x, 0, 2), c, new_lengths=torch.tensor([2, 1])),
            lambda m, c: c.lengths,
            lambda m, c: c.length,
        ),
        "query 4-D": on_cache(4, lambda m, c: m.forward_with_cache(x[None], c)),
        "query 2-D": on_cache(4, lambda m, c: m.forward_with_cache(x[0], c)),
        "query embedding E+2": on_cache(4, lambda m, c: m.forward_with_cache(seq(1, E + 2), c)),
        "cache of no positions": lambda m, ns: ns.KeyValueCache(2, H, 0, D),
        "cache of negative batch": lambda m, ns: ns.KeyValueCache(-1, H, 4, D),
    }
    if config == CACHE_CONFIGS["plain"]:
        calls["cache made without dtype, default dtype float64"] = decoding(
            4, (0, 2), make=lambda m, ns: _with_default_dtype(F64, lambda: ns.KeyValueCache(2, H, 4, D)))
    return calls


def _with_default_dtype(dtype, fn):
    with default_dtype(dtype):
        return fn()


CACHE_CONFIGS = {
    "plain": dict(embed_dim=8, num_heads=2),
    "batch_first": dict(embed_dim=8, num_heads=2, batch_first=True),
    "kdim_vdim": dict(embed_dim=8, num_heads=2, kdim=3, vdim=5),
    "bias_kv": dict(embed_dim=8, num_heads=2, add_bias_kv=True),
    "zero_attn, batch_first": dict(embed_dim=8, num_heads=2, add_zero_attn=True, batch_first=True),
    "dropout": dict(embed_dim=8, num_heads=2, dropout=0.5),
}


def cross_language_cases():
    """id -> (make the two modules, make the unit's calls, the call's name, torch's fast path switched
    off). The calls are made afresh in the test, under its seed."""
    cases = {}

    def add(unit, config_name, make, calls_of, fast_path_off_for=None):
        for name in calls_of():
            cases[f"{unit}[{config_name}] {name}"] = (make, calls_of, name, False)
        if fast_path_off_for in calls_of():
            cases[f"{unit}[{config_name}] {fast_path_off_for}, torch's fast path switched off"] = (
                make, calls_of, fast_path_off_for, True)

    for config_name, config in MHA_CONFIGS.items():
        add("MultiheadAttention", config_name,
            functools.partial(twins, torchmha.MultiheadAttention, torchmha.cpp.MultiheadAttention, **config),
            functools.partial(_without_namespace, multihead_attention_calls, config),
            fast_path_off_for="self-attention, fully padded sample")
    for unit, (python_class, cpp_class, args, kwargs, _) in version_calls().items():
        add(unit, ", ".join(map(str, args)), functools.partial(twins, python_class, cpp_class, *args, **kwargs),
            functools.partial(_without_namespace, lambda unit=unit: version_calls()[unit][4]))
    for config_name, (args, kwargs, _) in cross_attention_calls().items():
        add("CrossAttention", config_name, functools.partial(twins, torchmha.CrossAttention, torchmha.cpp.CrossAttention, *args, **kwargs),
            functools.partial(_without_namespace, lambda name=config_name: cross_attention_calls()[name][2]))
    for config_name, (args, kwargs, _) in transformer_block_calls().items():
        add("TransformerBlock", config_name,
            functools.partial(twins, torchmha.TransformerBlock, torchmha.cpp.TransformerBlock, *args, **kwargs),
            functools.partial(_without_namespace, lambda name=config_name: transformer_block_calls()[name][2]),
            fast_path_off_for="fully padded sample")
    for config_name, config in CACHE_CONFIGS.items():
        add("decoding", config_name,
            functools.partial(twins, torchmha.MultiheadAttention, torchmha.cpp.MultiheadAttention, **config),
            functools.partial(cache_calls, config))
    return cases


def _without_namespace(calls_of, *args):
    """Calls of a module alone, as calls of (module, namespace)."""
    return {name: (lambda m, ns, call=call: call(m)) for name, call in calls_of(*args).items()}


CROSS_LANGUAGE_CASES = cross_language_cases()


def _fast_path_off(call, module, namespace):
    with torch_fast_path_disabled():
        return call(module, namespace)


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("name", list(CROSS_LANGUAGE_CASES))
def test_python_and_cpp_classes_behave_alike(name, mode):
    make, calls_of, call_name, fast_path_off = CROSS_LANGUAGE_CASES[name]
    python_module, cpp_module = make()
    call = calls_of()[call_name]
    if fast_path_off:
        call = functools.partial(_fast_path_off, call)
    python_module.train(mode == "train")
    cpp_module.train(mode == "train")
    results = []
    for module, namespace in ((python_module, torchmha), (cpp_module, torchmha.cpp)):
        torch.manual_seed(5)  # the same draws on both sides (inputs a call makes, dropout)
        with torch.set_grad_enabled(mode == "train"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mixed-mask-dtype warning (its own channel per language)
            results.append(attempt(lambda: call(module, namespace)))
    assert_same_outcome(*results)


@pytest.mark.parametrize("unit", ["MultiheadAttention", "TransformerBlock"])
def test_mixed_mask_dtypes_warn_through_pythons_warnings_in_both_languages(unit):
    """torch's deprecation warning for a bool key_padding_mask with a float attn_mask: a UserWarning
    that Python's warning filters see, from the Python and the C++ classes alike."""
    x = randn(2, 4, 8)
    padding, mask = torch.zeros(2, 4, dtype=torch.bool), torch.zeros(4, 4, dtype=F64)
    if unit == "MultiheadAttention":
        modules = twins(torchmha.MultiheadAttention, torchmha.cpp.MultiheadAttention, 8, 2, batch_first=True)
        call = lambda m: m(x, x, x, key_padding_mask=padding, attn_mask=mask)  # noqa: E731
    else:
        modules = twins(torchmha.TransformerBlock, torchmha.cpp.TransformerBlock, 8, 2)
        call = lambda m: m(x, mask, padding)  # noqa: E731
    for module, language in zip(modules, ("Python", "C++")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(module)
        messages = [str(w.message) for w in caught]
        assert any(m.startswith("Support for mismatched key_padding_mask and attn_mask is deprecated") for m in messages), (
            f"{language}: no warning among {messages}")
