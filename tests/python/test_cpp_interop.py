"""The C++ modules seen from Python, weight copies between C++ and Python, and the import order."""

import subprocess
import sys

import pytest
import torch

import torchmha
from conftest import assert_close


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
    code = "import torchmha, torch; m = torchmha.MultiheadAttention(4, 2); x = torch.randn(3, 1, 4); print(m(x, x, x)[0].shape)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([3, 1, 4])" in result.stdout
