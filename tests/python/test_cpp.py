"""torchmha.cpp: the C++ modules seen from Python, weight copies between C++ and Python, and the
import order."""

import subprocess
import sys

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
