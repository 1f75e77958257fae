"""int8 weights for decoding (csrc/core/small_linear.cpp, csrc/cpu/small_linear_kernel.cpp): quantize_weight
(symmetric, a float32 scale per output channel) and quantized_linear, y = (x W_q^T) * scale + b, by the CPU
kernel for up to 8 rows of x (on AVX512-VNNI, up to 4 rows as exact integers: linear_kernel_vnni.cpp; on
AMX-INT8, the same integers for 2-8 rows on tiles: linear_kernel_amx.cpp; on AVX512-BF16, 5-8 rows of
bfloat16 x by bfloat16 dot products: linear_kernel_bf16.cpp; on AVX2, one row as exact 16-bit digits:
linear_kernel_int16.cpp), in blocks of 8 rows
up to a limit (test_settings.py), and by the dequantizing reference elsewhere."""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import torchmha  # noqa: F401  (registers the ops)

ops = torch.ops.torchmha


def dequantized(q, scale):
    return q.double() * scale.double()[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_quantize_weight_rounds_each_row_to_its_own_scale(dtype):
    w = torch.randn(40, 33, dtype=dtype) * torch.logspace(-3, 2, 40, dtype=dtype)[:, None]
    w[7] = 0  # an all-zero row
    q, scale = ops.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (40,)
    assert q.abs().max() <= 127 and (q.abs().amax(1)[w.abs().amax(1) > 0] == 127).all()
    assert q[7].eq(0).all() and scale[7] == 1
    # round to nearest: within half a step of the row's own scale (plus float32's rounding of w / scale)
    err = (dequantized(q, scale) - w.double()).abs()
    assert (err <= scale.double()[:, None] * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 32, 33, 40])
@pytest.mark.parametrize("K, O, bias", [(64, 40, True), (37, 13, False), (200, 9, True), (512, 2048, True), (1100, 301, True)])
def test_quantized_linear_is_linear_with_the_dequantized_weight(dtype, rows, K, O, bias):
    """Kernel rows (1-8: integer digits for 1-4 on VNNI, float beyond), blocks of kernel rows (9, 32;
    33 and 40 too for float32 and float16 on AMD with AVX-512) and the reference's (33, 40; all
    past 8 in the test below); K with a tail past whole vectors, and in spans (1100). Against
    float64 on the same int8 weights, within twice the error of F.linear in the dtype with the
    dequantized weight."""
    x = torch.randn(rows, K, dtype=dtype)
    q, scale = ops.quantize_weight(torch.randn(O, K) / K**0.5)
    b = torch.randn(O, dtype=dtype) if bias else None
    exact = F.linear(x.double(), dequantized(q, scale), None if b is None else b.double())
    torch_own = (F.linear(x, dequantized(q, scale).to(dtype), b).double() - exact).abs().max()
    ours = ops.quantized_linear(x, q, scale, b)
    assert ours.dtype == dtype and ours.shape == (rows, O)
    assert (ours.double() - exact).abs().max() <= 2 * torch_own + 1e-5 * exact.abs().max()


def relative_error(ours, x, q, scale, b=None):
    """|ours - exact| over what float32 rounding scales with, sum_k |x_k| |w_k| + |b|."""
    w = dequantized(q, scale)
    exact = F.linear(x.double(), w, None if b is None else b.double())
    size = F.linear(x.double().abs(), w.abs(), None if b is None else b.double().abs())
    return ((ours.double() - exact).abs() / size.clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("rows", [1, 3, 4, 6])
@pytest.mark.parametrize("K", [1, 63, 64, 65, 130, 2048])
def test_float32_error_within_float32_rounding(rows, K):
    """x over twelve decades, with the largest |x| where the weights are small, and weights of -128
    (the integer path's extreme digit and weight): float32's own error, not the digits' rounding."""
    torch.manual_seed(K + rows)
    x = torch.randn(rows, K) * torch.logspace(-6, 6, K)[torch.randperm(K)]
    q, scale = ops.quantize_weight(torch.randn(23, K))
    q[0] = -128
    q[1, : K // 2] = 0
    b = torch.randn(23)
    assert relative_error(ops.quantized_linear(x, q, scale, b), x, q, scale, b) < 2e-6


def test_digit_sums_past_int32_in_rows_past_2_16():
    """Past 2^16 columns one digit's dot product can pass int32 (here the lowest digit's, 255 * -128
    * 65999: x[0] = 2^29 sets the step to 1, every other x is -128), so the integer path widens the
    sums to int64 before adding them; up to 2^16 it adds them in int32."""
    for K in (65536, 66000):
        x = torch.full((1, K), -128.0)
        x[0, 0] = 2.0**29
        q = torch.full((2, K), 127, dtype=torch.int8)
        scale = torch.tensor([1e-9, 3e-9])
        assert relative_error(ops.quantized_linear(x, q, scale, None), x, q, scale) < 2e-6


@pytest.mark.parametrize("K", [4096, 4097, 8192, 12303])
def test_int16_digit_sums_at_their_longest_rows(K):
    """One row on AVX2's 16-bit digits (linear_kernel_int16.cpp): x[0] = 2^28 sets the step to 1,
    every other x is 32767 (the low digit's largest) against weights of -128, where each int32 lane
    gains the most; a span of 4096 columns sums in int32, and the spans in int64. Five features: one
    pass of four and one alone. Exact but for float32's rounding."""
    x = torch.full((1, K), 32767.0)
    x[0, 0] = 2.0**28
    q = torch.full((5, K), -128, dtype=torch.int8)
    q[1, K // 2] = 127  # (each feature its own sum)
    scale = torch.tensor([1e-9, 3e-9, 1.0, 2.0, 0.5])
    assert relative_error(ops.quantized_linear(x, q, scale, None), x, q, scale) < 2e-6


def test_zero_tiny_huge_and_non_finite_rows():
    """A row of zeros; tiny and huge rows (scaled exactly by powers of two); inf and
    NaN in x give torch's inf/NaN (the integer path cannot hold them and hands the call to the float
    path)."""
    q, scale = ops.quantize_weight(torch.randn(5, 70))
    for x in (torch.zeros(2, 70), torch.full((1, 70), 1e-30), torch.randn(3, 70) * 1e36):
        assert relative_error(ops.quantized_linear(x, q, scale, None), x, q, scale) < 2e-6
    for bad in (float("inf"), float("nan")):
        x = torch.randn(2, 70)
        x[1, 3] = bad
        ours = ops.quantized_linear(x, q, scale, None)
        torch.testing.assert_close(ours, F.linear(x, dequantized(q, scale).float()), equal_nan=True)


def test_without_vnni_the_float_conversion_computes_the_same():
    """TORCHMHA_VNNI=0: int8 rows converted to float (the path of Intel CPUs and CPUs without AVX512-VNNI)."""
    from helpers import run_python_with
    import pathlib
    code = ("import sys; sys.path.insert(0, %r); import test_quantized_linear as t; "
            "[t.test_float32_error_within_float32_rounding(r, K) for r in (1, 4) for K in (65, 2048)]; "
            "t.test_zero_tiny_huge_and_non_finite_rows()")
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_VNNI": "0"})


def test_int16_digits_compute_what_the_other_paths_do():
    """TORCHMHA_INT16_DIGITS=1 with VNNI off: one row on the 16-bit digits on any CPU with AVX2 or
    AVX-512 (by default only where torchmha's AVX2 copy runs)."""
    from helpers import run_python_with
    import pathlib
    code = ("import sys; sys.path.insert(0, %r); import test_quantized_linear as t, torch; "
            "[t.test_float32_error_within_float32_rounding(1, K) for K in (1, 63, 64, 65, 130, 2048)]; "
            "[t.test_int16_digit_sums_at_their_longest_rows(K) for K in (4096, 4097, 8192, 12303)]; "
            "[t.test_quantized_linear_is_linear_with_the_dequantized_weight(d, 1, K, O, b) "
            "for d in (torch.float32, torch.bfloat16) for K, O, b in ((37, 13, False), (200, 9, True), (1100, 301, True))]; "
            "t.test_zero_tiny_huge_and_non_finite_rows()")
    run_python_with(code % str(pathlib.Path(__file__).parent),
                    set_env={"TORCHMHA_VNNI": "0", "TORCHMHA_INT16_DIGITS": "1"})


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs AVX-512")
def test_one_row_takes_four_features_a_pass_in_the_float_loop():
    """At one row the float loop sums four output features a pass (four accumulators each, against
    sixteen one at a time; docs/kernel_rules.md): 2^30 at column 0 and -2^30 at column 64 meet in one
    accumulator and cancel before the 1 at column 16 is added (1.0); in sixteen accumulators the 1
    is lost beside 2^30 first (0.0). Exact integers (VNNI, the reference) give 1.0 too."""
    from helpers import run_python_with
    code = ("import torch, torchmha\n"
            "x = torch.zeros(1, 512); x[0, 0], x[0, 64], x[0, 16] = 2.0 ** 30, -2.0 ** 30, 1.0\n"
            "w = torch.zeros(4, 512, dtype=torch.int8); w[0, 0] = w[0, 64] = w[0, 16] = 1\n"
            "y = torch.ops.torchmha.quantized_linear(x, w, torch.ones(4), None)\n"
            "assert y[0, 0].item() == 1.0 and y[0, 1:].eq(0).all(), y\n")
    run_python_with(code, set_env={"TORCHMHA_VNNI": "0"}, unset=("TORCHMHA_AMX_LINEAR",))


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2")
def test_avx2_copy_takes_three_int8_features_a_pass_from_two_rows():
    """On torchmha's AVX2 copy (ATEN_CPU_CAPABILITY=avx2), VNNI off, 2-4 rows of int8 weights take
    the float loop three features a pass (docs/kernel_rules.md): products 2^25 at column 0 and
    -2^25 at column 8 cancel in one accumulator before the 1 at column 32 joins (1.0); one feature
    a pass (two or four accumulators a row) loses the 1 beside 2^25 first (0.0)."""
    from helpers import run_python_with
    code = ("import torch, torchmha\n"
            "w = torch.zeros(3, 64, dtype=torch.int8); w[:, 0] = w[:, 8] = 64; w[:, 32] = 1\n"
            "for rows in (2, 3, 4):\n"
            "    x = torch.zeros(rows, 64); x[:, 0], x[:, 8], x[:, 32] = 2.0 ** 19, -2.0 ** 19, 1.0\n"
            "    y = torch.ops.torchmha.quantized_linear(x, w, torch.ones(3), None)\n"
            "    assert y.eq(1.0).all(), (rows, y)\n")
    run_python_with(code, set_env={"ATEN_CPU_CAPABILITY": "avx2", "TORCHMHA_VNNI": "0"},
                    unset=("TORCHMHA_CPU_CAPABILITY", "TORCHMHA_AMX_LINEAR"))


def test_the_reference_past_the_blocks_computes_the_same():
    """TORCHMHA_LINEAR_BLOCKED_ROWS=8: every call past the kernel's 8 rows dequantizes for a GEMM."""
    from helpers import run_python_with
    import pathlib
    code = ("import sys, torch; sys.path.insert(0, %r); import test_quantized_linear as t; "
            "[t.test_quantized_linear_is_linear_with_the_dequantized_weight(d, r, K, O, b) "
            "for d in (torch.float32, torch.bfloat16, torch.float16) for r in (9, 33) "
            "for K, O, b in ((37, 13, False), (512, 2048, True), (1100, 301, True))]")
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_LINEAR_BLOCKED_ROWS": "8"})


def test_without_avx512_bf16_the_float_loop_computes_bfloat16_rows_the_same():
    """TORCHMHA_AVX512_BF16=0: 5-8 rows of bfloat16 x through the float loop (Intel CPUs, CPUs without AVX512-BF16)."""
    from helpers import run_python_with
    import pathlib
    code = ("import sys, torch; sys.path.insert(0, %r); import test_quantized_linear as t; "
            "[t.test_quantized_linear_is_linear_with_the_dequantized_weight(torch.bfloat16, r, K, O, b) "
            "for r in (5, 8) for K, O, b in ((37, 13, False), (512, 2048, True))]")
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_AVX512_BF16": "0"})


@pytest.mark.skipif(
    not (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()),
    reason="needs AVX512-BF16")
def test_bfloat16_dot_products_take_int8_weights_two_features_a_pass_from_6_rows_where_avx512_runs_in_halves():
    """One feature whose sum depends on its accumulators: 2^24 (x = 2^18 against 64) at column 0, 1
    at 32, -2^24 at 64. Two features a pass leave one accumulator a feature at 8 rows, where 2^24
    absorbs the 1 before cancelling (0); one a pass leaves two, the 1 in the second (1).
    bfloat16_features_a_pass: two from 6 rows where AVX-512 runs in halves (TORCHMHA_AVX512_HALVES),
    else one (the dot products forced on: an AMD vendor, VNNI's exact digits and AMX's tiles off)."""
    from helpers import run_python_with
    code = """
import torch, torchmha
q = torch.zeros(16, 96, dtype=torch.int8)
q[:, 0], q[:, 32], q[:, 64] = 64, 1, -64
def sums(rows):
    x = torch.ones(rows, 96)
    x[:, 0] = x[:, 64] = 2.0**18
    return torch.ops.torchmha.quantized_linear(x.bfloat16(), q, torch.ones(16), None)[:, 0].float().tolist()
assert sums(8) == [{}] * 8 and sums(5) == [1.0] * 5, (sums(8), sums(5))
"""
    forced = {"TORCHMHA_CPU_VENDOR": "amd", "TORCHMHA_AVX512_BF16": "1", "TORCHMHA_VNNI": "0", "TORCHMHA_AMX_LINEAR": "0"}
    run_python_with(code.format(0.0), set_env={**forced, "TORCHMHA_AVX512_HALVES": "1"})
    run_python_with(code.format(1.0), set_env={**forced, "TORCHMHA_AVX512_HALVES": "0"})


@pytest.mark.skipif(
    not (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()),
    reason="needs AVX512-BF16")
@pytest.mark.parametrize("vendor, setting, dot_products", [("amd", None, True), ("intel", None, False),
                                                            ("intel", "1", True), ("amd", "0", False)])
def test_bfloat16_rows_take_dot_products_on_amd_or_where_set(vendor, setting, dot_products):
    """5 rows of bfloat16 x = 1e-39 (a subnormal) against int8 weights of one scaled by 2^100:
    vdpbf16ps reads subnormal inputs as zero, the float loop gives 1.28e-9. Unset, the dot products
    run on AMD only (measured: small_linear_kernel.cpp); TORCHMHA_AVX512_BF16 moves them."""
    from helpers import run_python_with
    code = f"""
import torch, torchmha
x = torch.full((5, 2), 1e-39, dtype=torch.bfloat16)
q, scale = torch.ones(1, 2, dtype=torch.int8), torch.full((1,), 2.0**100)
y = torch.ops.torchmha.quantized_linear(x, q, scale, None)
assert bool((y == 0).all()) == {dot_products}, y
"""
    setting = {"TORCHMHA_AVX512_BF16": setting} if setting else {}
    run_python_with(code, set_env={"TORCHMHA_CPU_VENDOR": vendor, **setting}, unset=("TORCHMHA_AVX512_BF16",))


needs_amx_int8 = pytest.mark.skipif(
    not (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_vnni_supported()
         and torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()),
    reason="needs AMX-INT8 and the tile state from Linux")


@needs_amx_int8
def test_amx_tiles_sum_int8_rows_as_the_vnni_kernel_does():
    """The tiles (blocks of 16 features) and the VNNI kernel (the features past them, at most 4 rows)
    compute the same exact integers: features 33-47 of a 48-feature call (all on tiles) equal, bit
    for bit, a call on those 15 weight rows alone (all on VNNI), for 2-8 rows, float32 and bfloat16
    x, with bias, K of one and of many k-steps."""
    from helpers import run_python_with
    code = """
import torch, torchmha
ops = torch.ops.torchmha
for K in (64, 2048):
    q, scale = ops.quantize_weight(torch.randn(48, K))
    q[0] = -128
    b = torch.randn(48)
    for rows in range(2, 9):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows, K) * torch.logspace(-3, 3, K)).to(dtype)
            tiles = ops.quantized_linear(x, q, scale, b.to(dtype))[:, 33:]
            vnni = torch.cat([ops.quantized_linear(x[r:r + 4], q[33:], scale[33:], b[33:].to(dtype))
                              for r in range(0, rows, 4)])
            assert torch.equal(tiles, vnni), (K, rows, dtype, (tiles - vnni).abs().max())
"""
    run_python_with(code, set_env={"TORCHMHA_VNNI": "1"}, unset=("TORCHMHA_AMX_LINEAR",))


@needs_amx_int8
def test_amx_tiles_take_int8_rows_from_two_rows():
    """Integer x (|x| < 2^20) against random int8 weights: the integer digits give each dot product
    exactly (then rounded once to float32), the float loop's float32 sums round on the way (some of
    the 128 outputs differ). With VNNI off (Intel's default), the tiles take 2-8 rows (the float loop
    1: measured, docs/kernel_rules.md); TORCHMHA_AMX_LINEAR=1 takes them from 1 row, 0 never."""
    from helpers import run_python_with
    code = """
import torch, torchmha
torch.manual_seed(0)
x = torch.randint(-2**20, 2**20, (8, 2048)).float()
q = torch.randint(-127, 128, (16, 2048), dtype=torch.int8)
def exact(rows):
    y = torch.ops.torchmha.quantized_linear(x[:rows], q, torch.ones(16), None)
    return torch.equal(y, (x[:rows].double() @ q.double().T).float())
"""
    intel = {"TORCHMHA_CPU_VENDOR": "intel"}
    run_python_with(code + "assert not exact(1) and exact(2) and exact(8)", set_env=intel,
                    unset=("TORCHMHA_VNNI", "TORCHMHA_AMX_LINEAR"))
    run_python_with(code + "assert exact(1)", set_env={**intel, "TORCHMHA_AMX_LINEAR": "1"}, unset=("TORCHMHA_VNNI",))
    run_python_with(code + "assert not exact(8)", set_env={**intel, "TORCHMHA_AMX_LINEAR": "0"},
                    unset=("TORCHMHA_VNNI",))


def test_strided_rows_and_batched_input():
    """A packed in-projection's rows (a narrowed view of the int8 weight and its scale), (T, N, K) input."""
    q, scale = ops.quantize_weight(torch.randn(96, 32))
    x = torch.randn(2, 3, 32).transpose(0, 1)
    ours = ops.quantized_linear(x, q[32:64], scale[32:64], None)
    torch.testing.assert_close(ours, F.linear(x, dequantized(q[32:64], scale[32:64]).float()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight, scale, message", [
    (torch.zeros(4, 8, dtype=torch.int8), torch.ones(3), "float32 scale of shape \\(4,\\)"),
    (torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, dtype=torch.float64), "float32 scale"),
    (torch.zeros(4, 8), torch.ones(4), "a scale goes with an int8"),
])
def test_a_scale_that_does_not_fit_is_a_value_error(weight, scale, message):
    with pytest.raises(ValueError, match=message):
        ops.quantized_linear(torch.randn(1, 8), weight, scale, None)


def test_quantize_weight_refuses_what_is_not_a_floating_matrix():
    with pytest.raises(ValueError, match="2-D floating weight"):
        ops.quantize_weight(torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="2-D floating weight"):
        ops.quantize_weight(torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    q, scale = ops.quantize_weight(torch.randn(10, 24))
    opcheck(ops.quantized_linear, (torch.randn(3, 24, dtype=dtype), q, scale, torch.randn(10, dtype=dtype)))
    opcheck(ops.quantize_weight, (torch.randn(10, 24, dtype=dtype),))
