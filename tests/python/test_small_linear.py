"""The small-batch linear op (csrc/core/small_linear.cpp, csrc/cpu/small_linear_kernel.cpp): a decoding step's
linear layers, y = x W^T + b for at most 8 rows of x (more in blocks of 8 where its rule says), by
torchmha's CPU kernel."""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import torchmha  # noqa: F401  (registers the ops)
from helpers import run_python_with

op = torch.ops.torchmha.small_linear
needs_avx512_bf16 = pytest.mark.skipif(
    not (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()),
    reason="needs AVX512-BF16")
needs_amx_bf16 = pytest.mark.skipif(
    not (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()
         and torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()),
    reason="needs AMX-BF16 and the tile state from Linux")
# Against float64: the kernel's error within a small multiple of torch's own (F.linear in the dtype).
SLACK = {torch.float32: 1e-5, torch.bfloat16: 0, torch.float16: 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("K, O, bias", [(64, 40, True), (37, 13, False), (512, 2048, True), (1100, 301, True)])
def test_small_linear_matches_linear(dtype, rows, K, O, bias):
    """Every row count the kernel unrolls (on AVX-512, 4-8 rows sum their outputs in one tree of 8-16
    vectors), K with a tail past whole vectors, O past the block of
    output features, with and without bias; K in spans with their sums carried (1100 from 5 rows:
    spans of 768 or 512, the last with a tail; O past a block of 256 features, and odd)."""
    x = torch.randn(rows, K, dtype=dtype)
    w = torch.randn(O, K, dtype=dtype) / K**0.5
    b = torch.randn(O, dtype=dtype) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    ours = op(x, w, b)
    torch_own = (F.linear(x, w, b).double() - exact).abs().max()
    assert ours.dtype == dtype and ours.shape == (rows, O)
    assert (ours.double() - exact).abs().max() <= 2 * torch_own + SLACK[dtype] + 1e-6


def test_without_avx512_bf16_the_float_loop_computes_the_same():
    """TORCHMHA_AVX512_BF16=0: bfloat16 rows widened to float (the path of CPUs without AVX512-BF16)."""
    code = ("import sys, torch; sys.path.insert(0, %r); import test_small_linear as t; "
            "[t.test_small_linear_matches_linear(torch.bfloat16, r, K, O, b) for r in (1, 3, 8) "
            "for K, O, b in ((37, 13, False), (512, 2048, True))]")
    import pathlib
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_AVX512_BF16": "0"})


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2")
def test_avx2_copy_takes_three_features_a_pass_from_four_rows_or_three_converted():
    """On torchmha's AVX2 copy (ATEN_CPU_CAPABILITY=avx2 puts it there on any CPU) the float loop
    takes three features a pass at 4 rows of float32 weights, and from 3 of bfloat16 and float16
    (docs/kernel_rules.md). The probe tells its one accumulator a row from one feature's two or
    four: products 2^25 at column 0 and -2^25 at column 8 meet in one accumulator and cancel
    before the 1 at column 32 joins (1.0); with two or four, column 32 lands in column 0's
    accumulator and the 1 is lost beside 2^25 first (0.0)."""
    code = """
import torch, torchmha
for dtype, three_from in ((torch.float32, 4), (torch.bfloat16, 3), (torch.float16, 3)):
    for rows in (2, 3, 4):
        x = torch.zeros(rows, 64); x[:, 0], x[:, 8], x[:, 32] = 2.0 ** 12, -2.0 ** 12, 1.0
        w = torch.zeros(3, 64); w[:, 0], w[:, 8], w[:, 32] = 2.0 ** 13, 2.0 ** 13, 1.0
        y = torch.ops.torchmha.small_linear(x.to(dtype), w.to(dtype), None)
        assert y.float().eq(1.0 if rows >= three_from else 0.0).all(), (dtype, rows, y)
"""
    run_python_with(code, set_env={"ATEN_CPU_CAPABILITY": "avx2"}, unset=("TORCHMHA_CPU_CAPABILITY",))


@needs_avx512_bf16
def test_avx512_bf16_setting_moves_bfloat16_rows_to_the_float_loop():
    """x = 1e-39 (a bfloat16 subnormal) against a weight of 2^100: vdpbf16ps reads subnormal inputs as
    zero (docs/kernel_rules.md), the float loop gives torch's 1.28e-9; TORCHMHA_AVX512_BF16=0 gives the
    float loop's answer. (One row: where AVX-512 runs in halves the rule takes the float loop there,
    so the rule is read as on Zen 5.)"""
    code = """
import torch, torchmha
x = torch.tensor([[1e-39, 0.0]], dtype=torch.bfloat16)
w = torch.tensor([[2.0**100, 1.0]], dtype=torch.bfloat16)
y = torch.ops.torchmha.small_linear(x, w, None).item()
assert (y > 1e-9) == {}, y
"""
    run_python_with(code.format(False), set_env={"TORCHMHA_AVX512_HALVES": "0"},
                    unset=("TORCHMHA_AVX512_BF16",))  # (the rule, not the suite's 1)
    run_python_with(code.format(True), set_env={"TORCHMHA_AVX512_BF16": "0"})


# One output feature whose sum depends on the order of its additions (exactly 14): AMX's tiles add
# each pair of products to the running sum in turn, so 2^24 absorbs the ones before -2^24 cancels
# it (0); the dot products and the float loop keep the ones in other lanes (13). (2^24 as 4096^2
# for float16.)
ORDER_PROBE = """
import torch, torchmha
w = torch.zeros(16, 32)
w[:, 0], w[:, 2:30:2], w[:, 30] = 4096.0, 1.0, -4096.0
def sums(rows, dtype=torch.bfloat16):
    x = torch.ones(rows, 32)
    x[:, 0] = x[:, 30] = 4096.0
    return torch.ops.torchmha.small_linear(x.to(dtype), w.to(dtype), None)[:, 0].tolist()
"""


@needs_amx_bf16
def test_amx_tiles_take_bfloat16_weights_from_three_rows_and_float16_from_five():
    """With AMX-BF16, bfloat16 weights go to the tiles from 3 rows of x (the dot products at 1-2),
    float16 weights from 5 (the float loop at 1-4; docs/kernel_rules.md); TORCHMHA_AMX_LINEAR=1 takes
    them from 1 row, 0 never."""
    half = "torch.float16"
    run_python_with(ORDER_PROBE + f"assert sums(2) == [13.0] * 2 and sums(3) == [0.0] * 3 and sums(8) == [0.0] * 8\n"
                    f"assert sums(4, {half}) != [0.0] * 4 and sums(5, {half}) == [0.0] * 5 and sums(8, {half}) == [0.0] * 8",
                    unset=("TORCHMHA_AMX_LINEAR",))
    run_python_with(ORDER_PROBE + f"assert sums(1) == [0.0] and sums(1, {half}) == [0.0]",
                    set_env={"TORCHMHA_AMX_LINEAR": "1"})
    run_python_with(ORDER_PROBE + f"assert sums(8) == [13.0] * 8 and sums(8, {half}) != [0.0] * 8",
                    set_env={"TORCHMHA_AMX_LINEAR": "0"})


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs AVX-512")
def test_float16_weights_take_two_features_a_pass_from_6_rows_where_avx512_runs_in_halves():
    """One feature whose sum depends on its accumulators: 2^24 (4096^2) at column 0, 1 at 16,
    -2^24 at 32. Two features a pass leave the float loop one accumulator a feature at 8 rows, where
    2^24 absorbs the 1 before cancelling (0); one a pass leaves two, the 1 in the second (1).
    half_pairs: two from 6 rows where AVX-512 runs in halves (TORCHMHA_AVX512_HALVES), else one
    (AMX's tiles off, which would take these rows)."""
    code = """
import torch, torchmha
w = torch.zeros(16, 48, dtype=torch.float16)
w[:, 0], w[:, 16], w[:, 32] = 4096.0, 1.0, -4096.0
def sums(rows):
    x = torch.ones(rows, 48, dtype=torch.float16)
    x[:, 0] = x[:, 32] = 4096.0
    return torch.ops.torchmha.small_linear(x, w, None)[:, 0].float().tolist()
assert sums(8) == [{}] * 8 and sums(5) == [1.0] * 5, (sums(8), sums(5))
"""
    run_python_with(code.format(0.0), set_env={"TORCHMHA_AVX512_HALVES": "1", "TORCHMHA_AMX_LINEAR": "0"})
    run_python_with(code.format(1.0), set_env={"TORCHMHA_AVX512_HALVES": "0", "TORCHMHA_AMX_LINEAR": "0"})


AMX_PARITY = """
import sys; sys.path.insert(0, %r)
import torch, torch.nn.functional as F, test_small_linear as t
for dtype in (torch.bfloat16, torch.float16):
    for rows in range(1, 9):
        for K, O, bias in ((32, 16, False), (64, 40, True), (512, 2048, True), (2048, 512, False), (96, 301, True)):
            t.test_small_linear_matches_linear(dtype, rows, K, O, bias)
        t.test_strided_weight_rows_and_batched_input(dtype)
        x = torch.randn(rows, 64, dtype=dtype)
        x[-1, 5], x[0, 7] = float("nan"), float("inf")
        w = torch.randn(48, 64, dtype=dtype)
        w[3, 7], w[20, 9], w[40, 11] = 0.0, float("inf"), 6e-8  # (a float16 subnormal)
        ours, torch_own = torch.ops.torchmha.small_linear(x, w, None), F.linear(x.float(), w.float()).to(dtype)
        assert torch.equal(ours.isnan(), torch_own.isnan()) and torch.equal(ours.isinf(), torch_own.isinf())
"""


@needs_amx_bf16
def test_amx_tiles_match_linear():
    """The tiles on every row count (TORCHMHA_AMX_LINEAR=1), bfloat16 and float16 weights: K of one and
    of many tiles, output features past the last 16 (on the dot products or the float loop), bias, a
    packed in-projection's strided rows, NaN and inf in x and in the weights where torch has them."""
    import pathlib
    run_python_with(AMX_PARITY % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_AMX_LINEAR": "1"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_weight_rows_and_batched_input(dtype):
    """A packed in-projection's q rows (a narrowed view, row stride K) and a (T, N, K) input."""
    packed = torch.randn(3 * 32, 32, dtype=dtype)
    x = torch.randn(2, 3, 32, dtype=dtype).transpose(0, 1)  # not contiguous
    # (float32 to 1e-5 absolute, as before; bfloat16 and float16 to their dtype's own tolerance)
    tolerance = {"atol": 1e-5, "rtol": 0} if dtype == torch.float32 else {}
    torch.testing.assert_close(op(x, packed[32:64], None), F.linear(x, packed[32:64]), **tolerance)


def linear_ops_in_a_step(grad):
    """Which linear op a decoding step of a torchmha module runs: (small_linear calls, addmm calls)."""
    mha = torchmha.MultiheadAttention(32, 4).eval()
    cache = torchmha.KeyValueCache.for_module(mha, 2, 8)
    with torch.set_grad_enabled(grad), torch.profiler.profile() as prof:
        mha.forward_with_cache(torch.randn(1, 2, 32), cache)
    names = [e.name for e in prof.events()]
    return names.count("torchmha::small_linear"), names.count("aten::addmm")


def test_a_step_takes_the_kernel_without_gradients_and_aten_with():
    """Inference: both projections through the op (and no ATen GEMM); with gradients, at::linear
    (the op has no autograd formula)."""
    assert linear_ops_in_a_step(grad=False) == (2, 0)
    small, addmm = linear_ops_in_a_step(grad=True)
    assert small == 0 and addmm == 2


def test_setting_keeps_aten():
    code = ("import sys; sys.path.insert(0, %r); import test_small_linear as t; "
            "s, a = t.linear_ops_in_a_step(False); assert s == 0 and a == 2, (s, a)")
    import pathlib
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_SMALL_LINEAR": "0"})


def test_blocks_of_rows_compute_the_same_and_refuse_what_linear_refuses():
    """TORCHMHA_LINEAR_BLOCKED_ROWS=1024 (on any CPU with the kernel): rows past 8 in blocks of 8,
    the last one short (9, 17, 63), batched and not contiguous (60 rows), each block written into
    its own rows of the output; bad input past 8 rows still gets F.linear's answer or error."""
    code = """
import re, sys, pytest, torch, torch.nn.functional as F; sys.path.insert(0, %r); import test_small_linear as t
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rows in (9, 17, 63):
        for O in (96, 300):
            t.test_small_linear_matches_linear(dtype, rows, 512, O, True)
x, w = torch.randn(20, 3, 32).transpose(0, 1), torch.randn(48, 32)
torch.testing.assert_close(t.op(x, w, None), F.linear(x, w), atol=1e-5, rtol=0)
x, vector = torch.randn(20, 8), torch.randn(8)
torch.testing.assert_close(t.op(x, vector, None), F.linear(x, vector))
for bad in (torch.randn(4, 7), torch.randn(4, 8, 2)):
    with pytest.raises(RuntimeError) as theirs:
        F.linear(x, bad)
    with pytest.raises(type(theirs.value), match=re.escape(str(theirs.value))):
        t.op(x, bad, None)
"""
    import pathlib
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_LINEAR_BLOCKED_ROWS": "1024"})


def test_more_rows_than_the_kernel_takes_are_aten():
    x, w = torch.randn(9, 16), torch.randn(8, 16)
    torch.testing.assert_close(op(x, w, None), F.linear(x, w), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    opcheck(op, (torch.randn(3, 24, dtype=dtype), torch.randn(10, 24, dtype=dtype), torch.randn(10, dtype=dtype)))
