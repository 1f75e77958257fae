"""The TORCHMHA_* settings (csrc/common/settings.cpp, docs/kernel_rules.md): each malformed value is
a ValueError naming the setting, and each setting forces the choice it is documented to force.
Settings are read once per process, so every check runs in a fresh interpreter."""

import os
import re

import pytest
import torch

from helpers import run_python_with

needs_avx512 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                  reason="needs ATen's AVX-512 capability")

# A call that consults each setting's rule (the suite's TORCHMHA_BLOCKED_KERNEL=1 is unset below,
# or the blocked rule, and the AMX and vendor answers it reads, would never be consulted).
TRIGGERS = {
    "TORCHMHA_BLOCKED_KERNEL": "m = torchmha.MultiheadAttention(8, 1); x = torch.randn(4, 1, 8); "
                               "m(x, x, x, need_weights=False)",
    "TORCHMHA_SDPA_CONTIGUOUS": "m = torchmha.MultiheadAttention(8, 1); x = torch.randn(4, 1, 8); "
                                "m(x, x, x, need_weights=False)",
    "TORCHMHA_TRANSPOSED_KEYS": "m = torchmha.MultiheadAttention(8, 1).eval(); x = torch.randn(4, 1, 8)\n"
                                "with torch.no_grad(): m(x, x, x)",
    "TORCHMHA_MIN_KERNEL_SCORES": "m = torchmha.MultiheadAttention(8, 1).eval(); x = torch.randn(4, 1, 8); m(x, x, x)",
    "TORCHMHA_DECODE_KERNEL_MAX_ROWS": "q = torch.randn(1, 1, 1, 8); c = torch.zeros(1, 1, 4, 8); "
                                       "torch.ops.torchmha.decode_attention(q, q, q, c, c.clone(), "
                                       "torch.tensor([0]), None, None, 0.0)",
    "TORCHMHA_DECODE_STATIC_SHAPES": "q = torch.randn(1, 1, 1, 8); c = torch.zeros(1, 1, 4, 8); "
                                     "torch.ops.torchmha.decode_attention(q, q, q, c, c.clone(), "
                                     "torch.tensor([0]), None, None, 1e-12)",
    "TORCHMHA_PREFILL_BLOCKED": "q = torch.randn(1, 1, 64, 8); c = torch.zeros(1, 1, 64, 8); "
                                "torch.ops.torchmha.decode_attention(q, q, q, c, c.clone(), "
                                "torch.tensor([0]), None, None, 0.0)",
    "TORCHMHA_STATIC_KERNEL": "m = torchmha.MultiheadAttention(8, 1); kv = m.project_key_value(torch.randn(3, 1, 8))"
                              "\nwith torch.no_grad(): m.forward_with_cache(torch.randn(1, 1, 8), kv)",
    "TORCHMHA_SMALL_LINEAR": "torch.ops.torchmha.small_linear(torch.randn(1, 8), torch.randn(4, 8), None)",
    "TORCHMHA_FLOAT32_GEMM": "x = torch.randn(16, 8, dtype=torch.float16); torch.ops.torchmha.small_linear(x, x[:4], None)",
    "TORCHMHA_AVX512_BF16": "x = torch.randn(1, 8, dtype=torch.bfloat16); "
                            "torch.ops.torchmha.small_linear(x, torch.randn(4, 8, dtype=torch.bfloat16), None)",
    "TORCHMHA_AMX_LINEAR": "x = torch.randn(3, 32, dtype=torch.bfloat16); "
                           "torch.ops.torchmha.small_linear(x, torch.randn(16, 32, dtype=torch.bfloat16), None)",
    "TORCHMHA_RESIDUAL_NORM": "m = torchmha.CachedDecoder(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer("
                              "8, 1, 16, 0.0), 1, enable_nested_tensor=False).eval())\n"
                              "with torch.no_grad(): m(torch.randn(1, 1, 8), m.new_state(1, 2))",
    "TORCHMHA_KERNEL_STEP": "m = torchmha.CachedDecoder(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer("
                            "8, 1, 16, 0.0), 1, enable_nested_tensor=False).eval())\n"
                            "with torch.no_grad(): m(torch.randn(1, 1, 8), m.new_state(1, 2))",
    "TORCHMHA_VNNI": "q, s = torch.ops.torchmha.quantize_weight(torch.randn(4, 8)); "
                     "torch.ops.torchmha.quantized_linear(torch.randn(1, 8), q, s, None)",
    "TORCHMHA_AVX512_HALVES": "q, s = torch.ops.torchmha.quantize_weight(torch.randn(4, 8)); "
                              "torch.ops.torchmha.quantized_linear(torch.randn(1, 8), q, s, None)",
    # (VNNI off, as the suite's TORCHMHA_VNNI=1 would take the row before the digits' rule is read)
    "TORCHMHA_INT16_DIGITS": "import os; os.environ['TORCHMHA_VNNI'] = '0'; "
                             "q, s = torch.ops.torchmha.quantize_weight(torch.randn(4, 8)); "
                             "torch.ops.torchmha.quantized_linear(torch.randn(1, 8), q, s, None)",
    "TORCHMHA_LINEAR_BLOCKED_ROWS": "torch.ops.torchmha.small_linear(torch.randn(9, 8), torch.randn(4, 8), None)",
    "TORCHMHA_PREFETCH_L2": "torch.ops.torchmha.small_linear(torch.randn(1, 8), torch.randn(4, 8), None)",
    "TORCHMHA_PREFETCH_ORDER": "torch.ops.torchmha.small_linear(torch.randn(1, 8), torch.randn(4, 8), None)",
    "TORCHMHA_CPU_CAPABILITY": "m = torchmha.MultiheadAttention(8, 1).eval(); x = torch.randn(4, 1, 8); m(x, x, x)",
    "TORCHMHA_AMX": "x = torch.randn(1, 1, 256, 8, dtype=torch.bfloat16); "
                    "torchmha.MultiheadAttention(8, 1, dtype=torch.bfloat16)(x[0], x[0], x[0], need_weights=False)",
    "TORCHMHA_AVX512_FP16": "x = torch.randn(1, 256, 8, dtype=torch.float16); m = torchmha.MultiheadAttention(8, 1, "
                            "dtype=torch.float16)\nwith torch.no_grad(): m(x, x, x, need_weights=False)",
    "TORCHMHA_CPU_VENDOR": "m = torchmha.MultiheadAttention(8, 1); x = torch.randn(256, 1, 8); "
                           "m(x, x, x, need_weights=False)",
    "TORCHMHA_FAST_PATH_SDPA": "m = torchmha.MultiheadAttention(8, 2, batch_first=True).eval(); "
                               "x = torch.randn(1, 4, 8)\nwith torch.no_grad(): m(x, x, x, need_weights=False)",
    "TORCHMHA_FAST_PATH_WEIGHTS_KERNEL": "m = torchmha.MultiheadAttention(8, 2, batch_first=True).eval(); "
                                         "x = torch.randn(1, 4, 8)\nwith torch.no_grad(): m(x, x, x)",
    "TORCHMHA_BRGEMM_MAX_MACS": "m = torchmha.MultiheadAttention(8, 1).eval(); x = torch.randn(4, 1, 8); m(x, x, x)",
    # (the explicit kernel's backward: its forward reads no K in place where it transposes the keys)
    "TORCHMHA_BLAS_GEMM": "m = torchmha.MultiheadAttention(8, 1); x = torch.randn(4, 1, 8, requires_grad=True)\n"
                          "m(x, x, x)[0].sum().backward()",
}

SWITCH = "must be 0 or 1"
COUNT = "must be a non-negative integer"
MALFORMED = [
    ("TORCHMHA_BLOCKED_KERNEL", "yes", SWITCH),
    ("TORCHMHA_SDPA_CONTIGUOUS", "copy", SWITCH),
    ("TORCHMHA_TRANSPOSED_KEYS", "kt", SWITCH),
    ("TORCHMHA_MIN_KERNEL_SCORES", "2e5", COUNT + " (scores a head)"),
    ("TORCHMHA_DECODE_KERNEL_MAX_ROWS", "many", COUNT + " (new rows a step)"),
    ("TORCHMHA_DECODE_KERNEL_MAX_ROWS", "-1", COUNT),
    ("TORCHMHA_DECODE_STATIC_SHAPES", "static", SWITCH),
    ("TORCHMHA_PREFILL_BLOCKED", "auto", SWITCH),
    ("TORCHMHA_STATIC_KERNEL", "always", SWITCH),
    ("TORCHMHA_SMALL_LINEAR", "off", SWITCH),
    ("TORCHMHA_VNNI", "on", SWITCH),
    ("TORCHMHA_AVX512_HALVES", "zen4", SWITCH),
    ("TORCHMHA_INT16_DIGITS", "16", SWITCH),
    ("TORCHMHA_LINEAR_BLOCKED_ROWS", "all", COUNT + " (rows of x)"),
    ("TORCHMHA_PREFETCH_L2", "l2", SWITCH),
    ("TORCHMHA_PREFETCH_ORDER", "block", SWITCH),
    ("TORCHMHA_RESIDUAL_NORM", "fused", SWITCH),
    ("TORCHMHA_KERNEL_STEP", "kernels", SWITCH),
    ("TORCHMHA_AVX512_BF16", "yes", SWITCH),
    ("TORCHMHA_AMX_LINEAR", "tiles", SWITCH),
    ("TORCHMHA_FLOAT32_GEMM", "float", SWITCH),
    ("TORCHMHA_CPU_CAPABILITY", "avx512f", "must be one of avx512, avx2, default"),
    ("TORCHMHA_AMX", "true", SWITCH),
    ("TORCHMHA_AVX512_FP16", "yes", SWITCH),
    ("TORCHMHA_CPU_VENDOR", "zen", "must be one of intel, amd, hygon, other"),
    ("TORCHMHA_FAST_PATH_SDPA", "2", SWITCH),
    ("TORCHMHA_FAST_PATH_WEIGHTS_KERNEL", "no", SWITCH),
    ("TORCHMHA_BRGEMM_MAX_MACS", "1M", COUNT + " (multiply-adds a product)"),
    ("TORCHMHA_BLAS_GEMM", "mkl", SWITCH),
]


def test_every_setting_has_a_malformed_case():
    assert {name for name, _, _ in MALFORMED} == set(TRIGGERS)


@pytest.mark.parametrize("name,value,message", MALFORMED, ids=[f"{n}={v}" for n, v, _ in MALFORMED])
def test_a_malformed_setting_is_a_value_error_naming_it(name, value, message):
    code = f"""
import torch, torchmha
try:
    {TRIGGERS[name].replace(chr(10), chr(10) + '    ')}
except ValueError as error:
    assert {name!r} in str(error) and {message!r} in str(error) and "'{value}'" in str(error), error
else:
    raise SystemExit("no error")
"""
    # The suite's TORCHMHA_BLOCKED_KERNEL=1 is dropped (set_env puts it back where it is the one tested).
    run_python_with(code, set_env={name: value}, unset=("TORCHMHA_BLOCKED_KERNEL",))


def test_an_empty_setting_is_no_setting():
    code = f"import torch, torchmha\n{TRIGGERS['TORCHMHA_MIN_KERNEL_SCORES']}"
    run_python_with(code, set_env={"TORCHMHA_MIN_KERNEL_SCORES": ""})


# --------------------------------------------------------------------- what each setting forces
PROFILED = """
import torch, torchmha
def ops(fn):
    with torch.profiler.profile() as prof:
        out = fn()
    return [e.name for e in prof.events()], out
"""


@needs_avx512
def test_cpu_capability_lowers_only_torchmha_and_default_turns_its_kernels_off():
    code = PROFILED + """
m = torchmha.MultiheadAttention(8, 1).eval()
x = torch.randn(4, 1, 8)
names, out = ops(lambda: m(x, x, x))
assert ("torchmha::attention_with_weights" in names) == KERNEL, names
assert torch.backends.cpu.get_cpu_capability() == "AVX512"  # ATen's own is untouched
"""
    run_python_with(code.replace("KERNEL", "True"), set_env={"TORCHMHA_CPU_CAPABILITY": "avx2"})
    run_python_with(code.replace("KERNEL", "False"), set_env={"TORCHMHA_CPU_CAPABILITY": "default"})


def test_cpu_capability_cannot_rise_above_atens():
    code = """
import torch, torchmha
m = torchmha.MultiheadAttention(8, 1).eval()
x = torch.randn(4, 1, 8)
try:
    m(x, x, x)
except ValueError as error:
    assert "TORCHMHA_CPU_CAPABILITY=avx2 is above ATen's capability" in str(error), error
else:
    raise SystemExit("no error")
"""
    run_python_with(code, set_env={"TORCHMHA_CPU_CAPABILITY": "avx2", "ATEN_CPU_CAPABILITY": "default"})


BLOCKED_TAKEN = PROFILED + """
def blocked(dtype, L, train=False):
    m = torchmha.MultiheadAttention(64, 1, batch_first=True, dtype=dtype).train(train)
    x = torch.randn(1, L, 64, dtype=dtype, requires_grad=train)
    with torch.set_grad_enabled(train):
        names, _ = ops(lambda: m(x, x, x, need_weights=False))
    return "torchmha::blocked_attention" in names
"""


@needs_avx512
def test_avx512_fp16_setting_moves_the_float16_forward_rule():
    """With AVX512-FP16, a float16 forward keeps SDPA (its GEMMs run natively); without, the kernel
    runs from 128^2 scores a head."""
    code = BLOCKED_TAKEN + "assert blocked(torch.float16, 256) == EXPECTED"
    unset = ("TORCHMHA_BLOCKED_KERNEL",)
    env = {"TORCHMHA_AMX": "0"}
    run_python_with(code.replace("EXPECTED", "False"), set_env={**env, "TORCHMHA_AVX512_FP16": "1"}, unset=unset)
    run_python_with(code.replace("EXPECTED", "True"), set_env={**env, "TORCHMHA_AVX512_FP16": "0"}, unset=unset)


@needs_avx512
def test_amx_setting_moves_the_reduced_precision_rule():
    """With AMX, bfloat16 keeps SDPA (its GEMMs would run on the tiles); without, the kernel runs
    from 128^2 scores a head."""
    code = BLOCKED_TAKEN + "assert blocked(torch.bfloat16, 256) == EXPECTED"
    unset = ("TORCHMHA_BLOCKED_KERNEL",)
    run_python_with(code.replace("EXPECTED", "False"), set_env={"TORCHMHA_AMX": "1"}, unset=unset)
    run_python_with(code.replace("EXPECTED", "True"), set_env={"TORCHMHA_AMX": "0"}, unset=unset)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs the AVX2 copy")
def test_amd_without_avx512_keeps_sdpa_at_large_float32_sizes():
    """On an AMD CPU running the AVX2 copy (Zen 3, measured: blocked_attention_kernel.cpp) SDPA wins
    float32 from 1024^2 scores a head (causal forward from 2048^2); the kernel below. Forced on any
    x86 CPU: TORCHMHA_CPU_CAPABILITY=avx2 lowers the copy, TORCHMHA_CPU_VENDOR=amd names the vendor."""
    code = BLOCKED_TAKEN + """
assert blocked(torch.float32, 512) and not blocked(torch.float32, 1024)
assert blocked(torch.float32, 512, True) and not blocked(torch.float32, 1024, True)
"""
    causal = PROFILED + """
def causal_blocked(L, train=False):
    m = torchmha.MultiheadAttention(64, 1, batch_first=True).train(train)
    x = torch.randn(1, L, 64, requires_grad=train)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L)
    with torch.set_grad_enabled(train):
        names, _ = ops(lambda: m(x, x, x, need_weights=False, attn_mask=mask, is_causal=True))
    return "torchmha::blocked_attention" in names
assert causal_blocked(1024) and not causal_blocked(2048) and causal_blocked(2048, True)
"""
    env = {"TORCHMHA_CPU_VENDOR": "amd", "TORCHMHA_CPU_CAPABILITY": "avx2"}
    unset = ("TORCHMHA_BLOCKED_KERNEL",)
    run_python_with(code, set_env=env, unset=unset)
    run_python_with(causal, set_env=env, unset=unset)
    # The other vendors stop at 256^2 (forward): Hygon named as itself, not taken for AMD.
    intel_sizes = BLOCKED_TAKEN + "assert blocked(torch.float32, 256) and not blocked(torch.float32, 512)"
    for vendor in ("intel", "hygon", "other"):
        run_python_with(intel_sizes, set_env={**env, "TORCHMHA_CPU_VENDOR": vendor}, unset=unset)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs the AVX2 copy")
def test_the_vendor_is_read_from_the_cpu():
    """Unforced, the rule sees this CPU's vendor (CPUID, as /proc/cpuinfo's vendor_id): with the AVX2
    copy a float32 forward at 512^2 takes the kernel on AMD only."""
    vendor = next(line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id"))
    code = BLOCKED_TAKEN + f"assert blocked(torch.float32, 512) == {vendor == 'AuthenticAMD'}"
    run_python_with(code, set_env={"TORCHMHA_CPU_CAPABILITY": "avx2"},
                    unset=("TORCHMHA_BLOCKED_KERNEL", "TORCHMHA_CPU_VENDOR"))


@needs_avx512
def test_vendor_setting_moves_the_float32_rule():
    """float32 without a causal mask: beyond 512^2 scores a head the kernel on AMD, SDPA on Intel; at
    512^2 (a forward) the kernel on both (each measured on its CPU: blocked_attention_kernel.cpp);
    Hygon (Zen cores, not measured) and other vendors keep SDPA from 512^2 (the Intel sizes from
    before the kernel's K^T copy)."""
    code = BLOCKED_TAKEN + ("assert blocked(torch.float32, 1024) == BEYOND and blocked(torch.float32, 1024, True) == BEYOND\n"
                            "assert blocked(torch.float32, 512) == AT_512")
    unset = ("TORCHMHA_BLOCKED_KERNEL",)
    for vendor, beyond, at_512 in (("amd", True, True), ("intel", False, True), ("hygon", False, False),
                                   ("other", False, False)):
        expected = code.replace("BEYOND", str(beyond)).replace("AT_512", str(at_512))
        run_python_with(expected, set_env={"TORCHMHA_CPU_VENDOR": vendor}, unset=unset)


FUSED = PROFILED + """
m = torchmha.MultiheadAttention(16, 2, batch_first=True).eval()
x = torch.randn(2, 5, 16)
with torch.no_grad():
    names, _ = ops(lambda: m(x, x, x, need_weights=WEIGHTS))
assert ("aten::_native_multi_head_attention" in names) == FUSED, names
"""


def fused(weights: bool, expected: bool) -> str:
    return FUSED.replace("WEIGHTS", str(weights)).replace("FUSED", str(expected))


def test_fast_path_sdpa_setting_keeps_the_fused_kernel():
    run_python_with(fused(False, False), unset=("TORCHMHA_FAST_PATH_SDPA",))
    run_python_with(fused(False, True), set_env={"TORCHMHA_FAST_PATH_SDPA": "0"})


@needs_avx512
def test_fast_path_weights_kernel_setting_forces_either_side():
    """0 keeps the fused kernel; 1 takes ours even where TORCHMHA_MIN_KERNEL_SCORES says the size
    is too small for it."""
    run_python_with(fused(True, False), unset=("TORCHMHA_FAST_PATH_WEIGHTS_KERNEL",))
    run_python_with(fused(True, True), set_env={"TORCHMHA_FAST_PATH_WEIGHTS_KERNEL": "0"})
    run_python_with(fused(True, True), set_env={"TORCHMHA_MIN_KERNEL_SCORES": "1000000"})
    run_python_with(fused(True, False), set_env={"TORCHMHA_MIN_KERNEL_SCORES": "1000000",
                                                 "TORCHMHA_FAST_PATH_WEIGHTS_KERNEL": "1"})


MICRO_GEMMS = PROFILED + """
torch.manual_seed(0)
q, k, v, grad = (torch.randn(1, 2, 96, 64) for _ in range(4))
def forward_and_backward():
    heads, lse = torch.ops.torchmha.blocked_attention(q, k, v, None, False)
    return heads, torch.ops.torchmha.blocked_attention_backward(grad, q, k, v, None, False, heads, lse)
names, (heads, grads) = ops(forward_and_backward)
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
reference = torch.nn.functional.scaled_dot_product_attention(*leaves)
torch.testing.assert_close(heads, reference)
torch.testing.assert_close(grads, torch.autograd.grad(reference, leaves, grad))
inside = [n for n in names if n.startswith("aten::") and n.endswith("mm")]
assert bool(inside) == ATEN, inside
"""


@needs_avx512
@pytest.mark.parametrize("env,aten", [({}, False), ({"TORCHMHA_BRGEMM_MAX_MACS": "0"}, True),
                                      ({"TORCHMHA_BLAS_GEMM": "0"}, True)], ids=["default", "no brgemm", "no blas"])
def test_micro_gemm_settings_move_products_to_aten(env, aten):
    """By default the blocked kernel's products (forward and backward) are brgemm and the BLAS GEMM
    on raw pointers (no ATen op); each setting sends its share to ATen's mm/addmm, with the same
    numbers."""
    run_python_with(MICRO_GEMMS.replace("ATEN", str(aten)), set_env=env)


def test_kernel_step_setting_leaves_every_step_to_the_composition():
    """TORCHMHA_KERNEL_STEP=0: a decoding step of one position runs the composition, whose kernels
    are reached through their ops; unset, the kernel step calls them directly (no op)."""
    code = """
import torch, torchmha
m = torchmha.CachedDecoder(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 1, 16, 0.0), 1,
                                                       enable_nested_tensor=False).eval())
state = m.new_state(1, 2)
with torch.inference_mode(), torch.profiler.profile() as prof:
    m(torch.randn(1, 1, 8), state)
names = [e.name for e in prof.events()]
assert ("torchmha::small_linear" in names) == {}, names
"""
    run_python_with(code.format(True), set_env={"TORCHMHA_KERNEL_STEP": "0"})
    run_python_with(code.format(False), unset=("TORCHMHA_KERNEL_STEP",))


@pytest.mark.skipif(not (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_vnni_supported()),
                    reason="needs AVX512-VNNI")
def test_vnni_setting_moves_int8_rows_off_the_integer_path():
    """x = (1e8, 1, -1e8) against weights of one: the integer digits sum it exactly (1), the float
    loop rounds 1e8 + 1 back to 1e8 (0). TORCHMHA_VNNI=1 takes the digits, 0 the float loop; unset,
    the digits on AMD only (measured: small_linear_kernel.cpp), as TORCHMHA_CPU_VENDOR says, and not
    where AVX-512 runs in halves (Zen 4, as TORCHMHA_AVX512_HALVES says)."""
    code = """
import torch, torchmha
q = torch.ones(1, 3, dtype=torch.int8)
y = torch.ops.torchmha.quantized_linear(torch.tensor([[1e8, 1.0, -1e8]]), q, torch.ones(1), None)
assert y.item() == {}, y
"""
    run_python_with(code.format(1.0), set_env={"TORCHMHA_VNNI": "1", "TORCHMHA_CPU_VENDOR": "intel",
                                               "TORCHMHA_AVX512_HALVES": "1"})
    run_python_with(code.format(0.0), set_env={"TORCHMHA_VNNI": "0", "TORCHMHA_CPU_VENDOR": "amd",
                                               "TORCHMHA_AVX512_HALVES": "0"})
    for vendor, halves, sum_of_x in (("amd", "0", 1.0), ("amd", "1", 0.0), ("intel", "0", 0.0)):
        run_python_with(code.format(sum_of_x), set_env={"TORCHMHA_CPU_VENDOR": vendor, "TORCHMHA_AVX512_HALVES": halves},
                        unset=("TORCHMHA_VNNI",))


@pytest.mark.skipif(
    not (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()),
    reason="needs AVX512-BF16")
def test_bfloat16_weights_take_the_float_loop_below_3_rows_where_avx512_runs_in_halves():
    """bfloat16 x = 1e-39 (a subnormal) against bfloat16 weights of 2^100: vdpbf16ps reads it as zero,
    the float loop gives 2.5e-9. Unset, the dot products at every row count, but from 3 rows where
    AVX-512 runs in halves (Zen 4: measured, small_linear_kernel.cpp); TORCHMHA_AVX512_BF16=1 at any."""
    code = """
import torch, torchmha
w = torch.full((1, 2), 2.0**100, dtype=torch.bfloat16)
def dot_products(rows):
    y = torch.ops.torchmha.small_linear(torch.full((rows, 2), 1e-39, dtype=torch.bfloat16), w, None)
    return bool((y == 0).all())
assert [dot_products(r) for r in (1, 2, 3, 8)] == {}
"""
    run_python_with(code.format([False, False, True, True]), set_env={"TORCHMHA_AVX512_HALVES": "1"},
                    unset=("TORCHMHA_AVX512_BF16",))
    run_python_with(code.format([True] * 4), set_env={"TORCHMHA_AVX512_HALVES": "0"}, unset=("TORCHMHA_AVX512_BF16",))
    run_python_with(code.format([True] * 4), set_env={"TORCHMHA_AVX512_HALVES": "1", "TORCHMHA_AVX512_BF16": "1"})
    # Unforced, the answer is the CPU's: AMD family 25 (0x19) with AVX-512 is Zen 4.
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    zen4 = "AuthenticAMD" in cpuinfo and re.search(r"^cpu family\s*:\s*25$", cpuinfo, re.M) is not None
    run_python_with(code.format([not zen4, not zen4, True, True]),
                    unset=("TORCHMHA_AVX512_BF16", "TORCHMHA_AVX512_HALVES"))


@pytest.mark.parametrize("name", ["TORCHMHA_PREFETCH_L2", "TORCHMHA_PREFETCH_ORDER"])
def test_prefetch_setting_moves_no_result(tmp_path, name):
    """The prefetch settings move only where the small-batch kernels' prefetches land, never a
    value: TORCHMHA_PREFETCH_L2 into L2 or L1 (the AVX-512 copy's two instantiations of the float
    loop, small_linear_kernel.cpp's weights_to_l2), TORCHMHA_PREFETCH_ORDER the rows ahead as one
    block or each row (prefetch_in_order: the float loop and the bfloat16 dot products). Every
    weight dtype, 1-8 rows and a block of 12, K whole (512) and in spans with a tail (1100), O past
    a block, bias, equal to the bit under 1 and 0."""
    code = """
import sys, torch, torchmha
torch.manual_seed(0)
ops, out = torch.ops.torchmha, []
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for K in (1100, 512):
        w, b = torch.randn(301, K).to(dtype), torch.randn(301).to(dtype)
        q, s = ops.quantize_weight(w.float())
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12):
            x = torch.randn(rows, K).to(dtype)
            out += [ops.small_linear(x, w, b), ops.quantized_linear(x, q, s, b)]
torch.save(out, sys.argv[1] if len(sys.argv) > 1 else {path!r})
"""
    for value in ("0", "1"):
        run_python_with(code.format(path=str(tmp_path / value)), set_env={name: value,
                                                                          "TORCHMHA_LINEAR_BLOCKED_ROWS": "16"})
    off, on = torch.load(tmp_path / "0"), torch.load(tmp_path / "1")
    assert len(off) == 108
    for a, b in zip(off, on):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2")
def test_int16_digits_setting_moves_one_int8_row_off_the_float_loop():
    """The probe above at one row, VNNI off: the 16-bit digits sum it exactly (1), the float loop
    gives 0. Unset, the digits where torchmha's AVX2 copy runs (ATEN_CPU_CAPABILITY=avx2 puts it
    there on any CPU), the float loop on AVX-512; TORCHMHA_INT16_DIGITS=1 takes the digits there too,
    0 never. Two rows take the float loop either way."""
    code = """
import torch, torchmha
q = torch.ones(1, 3, dtype=torch.int8)
x = torch.tensor([[1e8, 1.0, -1e8]])
assert torch.ops.torchmha.quantized_linear(x, q, torch.ones(1), None).item() == {}
assert torch.ops.torchmha.quantized_linear(x.repeat(2, 1), q, torch.ones(1), None).eq(0).all()
"""
    no_vnni = {"TORCHMHA_VNNI": "0"}
    run_python_with(code.format(1.0), set_env={**no_vnni, "ATEN_CPU_CAPABILITY": "avx2"},
                    unset=("TORCHMHA_INT16_DIGITS",))
    run_python_with(code.format(1.0), set_env={**no_vnni, "TORCHMHA_INT16_DIGITS": "1"})
    run_python_with(code.format(0.0), set_env={**no_vnni, "TORCHMHA_INT16_DIGITS": "0", "ATEN_CPU_CAPABILITY": "avx2"})
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        run_python_with(code.format(0.0), set_env=no_vnni, unset=("TORCHMHA_INT16_DIGITS",))


LINEAR_BLOCKS = PROFILED + """
def blocks(rows, dtype, O=24, K=40, int8=True):
    w = torch.randn(O, K)
    x = torch.randn(rows, K, dtype=dtype)
    if int8:
        q, s = torch.ops.torchmha.quantize_weight(w)
        call = lambda: torch.ops.torchmha.quantized_linear(x, q, s, None)
    else:
        call = lambda: torch.ops.torchmha.small_linear(x, w.to(dtype), None)
    names, _ = ops(call)
    # (a block at a time narrows x and y; where only the float loop runs the blocks are one call)
    gemm = any(name in names for name in ("aten::linear", "aten::addmm", "aten::mm"))
    assert not (gemm and "aten::narrow" in names), names
    return not gemm
"""


# Per vendor, as measured with AVX-512 (small_linear_kernel.cpp): the most rows that int8 weights
# take in blocks with float32/float16 x, and float32 and float16 weights of 512x512 (float32's
# 4096x1025, past 16 MiB, in the last column; the cap is in bytes: float16's 4096x2048 is under it).
# "amd-halves": Zen 4, whose AVX-512 runs in halves (TORCHMHA_AVX512_HALVES=1), float weights 64 rows.
BLOCK_LIMITS = {"amd": (1024, 1024, 1024, 64), "amd-halves": (1024, 64, 64, 64), "intel": (64, 32, 0, 16),
                "other": (32, 0, 0, 0), "amd-avx2": (128, 128, 128, 128)}


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs the AVX2 copy")
@pytest.mark.parametrize("vendor", ["amd", "amd-halves", "intel", "other"])
def test_rows_past_the_kernel_go_in_blocks_up_to_the_rule_then_to_a_gemm(vendor):
    """Past 8 rows, the kernel takes a call in blocks of 8 (narrowed views of x and y) up to a limit, and a
    GEMM (a linear) takes it beyond. With AVX-512, for float32 and float16 x: on AMD int8 weights and
    float weights of 2^18 elements up to 16 MiB up to 1024 rows (64 where AVX-512 runs in halves, Zen 4),
    larger float weights up to 64; on Intel int8 up to 64 rows, float32 up to 32 (16 past 16 MiB) and float16 none; on AMD with the AVX2
    copy int8 and float weights of 2^18 elements up to 128 rows, bfloat16 too; elsewhere and for
    bfloat16, 32 int8 rows and no float blocks, but bfloat16 weights of 256 KiB to 2 MiB up to 16 rows where AMX tiles
    run (any vendor: the hardware decides; measured: small_linear_kernel.cpp). TORCHMHA_CPU_VENDOR names
    the vendor (with the AVX2 copy every vendor but AMD gets "elsewhere"); the row setting moves the limit."""
    limits = BLOCK_LIMITS[vendor if torch.backends.cpu.get_cpu_capability() == "AVX512" else
                          "amd-avx2" if vendor.startswith("amd") else "other"]
    cpu = {"TORCHMHA_CPU_VENDOR": vendor.split("-")[0], "TORCHMHA_AVX512_HALVES": str(int(vendor == "amd-halves"))}
    code = LINEAR_BLOCKS + f"""
int8, f32, f16, huge = {limits}
def up_to(limit, dtype, *shape):
    return all(blocks(rows, dtype, *shape) == (rows <= limit) for rows in (9, limit, limit + 1) if rows > 8)
for dtype, float_limit in ((torch.float32, f32), (torch.float16, f16)):
    assert up_to(int8, dtype) and up_to(float_limit, dtype, 512, 512, False)
    assert not blocks(9, dtype, 511, 512, False)  # (under 2^18 elements)
assert up_to(huge, torch.float32, 4096, 1025, False)
assert up_to(f32, torch.float32, 4096, 1024, False) and up_to(f16, torch.float16, 4096, 2048, False)  # (16 MiB)
tiles = (torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()
         and torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
if {limits == BLOCK_LIMITS["amd-avx2"]}:  # (AMD, the AVX2 copy: bfloat16 as float16)
    assert up_to(128, torch.bfloat16) and up_to(128, torch.bfloat16, 512, 512, False)
    assert up_to(128, torch.bfloat16, 1025, 1024, False) and not blocks(9, torch.bfloat16, 511, 512, False)
else:
    assert up_to(32, torch.bfloat16) and up_to(16 if tiles else 0, torch.bfloat16, 512, 512, False)
    assert not blocks(9, torch.bfloat16, 256, 480, False) and not blocks(9, torch.bfloat16, 1025, 1024, False)  # (256 KiB-2 MiB)
"""
    run_python_with(code, set_env=cpu, unset=("TORCHMHA_LINEAR_BLOCKED_ROWS",))
    forced = LINEAR_BLOCKS + \
        "assert blocks(16, torch.float32) and not blocks(17, torch.float32) and not blocks(17, torch.bfloat16)\n" \
        "assert blocks(16, torch.bfloat16, int8=False) and not blocks(17, torch.float32, int8=False)"
    run_python_with(forced, set_env={"TORCHMHA_LINEAR_BLOCKED_ROWS": "16", **cpu})


# A linear layer on 64 rows (past the small-batch kernel; a weight under the 2^18 elements of its
# blocks), once in each of the two ways.
REDUCED_LINEAR = """
import torch, torch.nn.functional as F, torchmha
torch.manual_seed(0)
x, w, b = (torch.randn(*shape, dtype=torch.{dtype}) for shape in ((64, {K}), ({O}, {K}), ({O},)))
ours = torch.ops.torchmha.small_linear(x, w, b)
in_float32, torch_own = F.linear(x.float(), w.float(), b.float()).to(x.dtype), F.linear(x, w, b)
"""
# int8 weights past the kernel's blocks: the reference dequantizes to x's dtype, then the same rule.
REDUCED_INT8_LINEAR = REDUCED_LINEAR + """
q, scale = torch.ops.torchmha.quantize_weight(w)
w = (q.float() * scale[:, None]).to(x.dtype)
ours = torch.ops.torchmha.quantized_linear(x, q, scale, b)
in_float32, torch_own = F.linear(x.float(), w.float(), b.float()).to(x.dtype), F.linear(x, w, b)
"""


def test_float32_gemm_setting_moves_reduced_precision_linears():
    """TORCHMHA_FLOAT32_GEMM=1: float16 linears computed in float32 and rounded once; 0: torch's own;
    unset, TORCHMHA_AVX512_FP16=1 (a CPU with AVX512-FP16): torch's own. The same for int8 weights'
    dequantizing reference."""
    # (K = 3200: at 96 the Intel Xeon with AVX512-FP16, whose float16 GEMM sums in float32, rounds both alike)
    check = REDUCED_LINEAR.format(dtype="float16", O=80, K=3200) + "assert not torch.equal(in_float32, torch_own)\n"
    run_python_with(check + "assert torch.equal(ours, in_float32)", set_env={"TORCHMHA_FLOAT32_GEMM": "1"})
    run_python_with(check + "assert torch.equal(ours, torch_own)", set_env={"TORCHMHA_FLOAT32_GEMM": "0"})
    # unforced, the float16 answer reads cpu_has_avx512_fp16 (and so its setting): torch's own GEMM
    run_python_with(check + "assert torch.equal(ours, torch_own)", set_env={"TORCHMHA_AVX512_FP16": "1"},
                    unset=("TORCHMHA_FLOAT32_GEMM",))
    int8 = REDUCED_INT8_LINEAR.format(dtype="float16", O=80, K=3200) + "assert not torch.equal(in_float32, torch_own)\n"
    rows = {"TORCHMHA_LINEAR_BLOCKED_ROWS": "8"}  # (the 64 rows past the blocks)
    run_python_with(int8 + "assert torch.equal(ours, in_float32)", set_env={**rows, "TORCHMHA_FLOAT32_GEMM": "1"})
    run_python_with(int8 + "assert torch.equal(ours, torch_own)", set_env={**rows, "TORCHMHA_FLOAT32_GEMM": "0"})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_rule_reads_the_cpu(dtype):
    """Unforced: bfloat16 keeps torch's GEMM where the CPU has AVX-512 BW/VL/DQ (oneDNN's path),
    float16 where it has AVX512-FP16 or AMX-FP16; elsewhere float32 (as /proc/cpuinfo's flags say)."""
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    fast = ({"avx512bw", "avx512vl", "avx512dq"} <= flags if dtype == "bfloat16"
            else bool({"avx512_fp16", "amx_fp16"} & flags))
    scope = {}
    exec(REDUCED_LINEAR.format(dtype=dtype, O=80, K=3200), scope)
    if torch.equal(scope["in_float32"], scope["torch_own"]):
        pytest.skip("torch's GEMM and float32's round alike here: the two ways cannot be told apart")
    assert torch.equal(scope["ours"], scope["torch_own"] if fast else scope["in_float32"])
