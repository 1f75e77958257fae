"""torchmha's blocked attention kernel (csrc/cpu/blocked_attention_kernel.cpp): attention without its
weights by blocks of queries and keys (flash attention's running softmax), forward and backward,
float32 and bfloat16/float16 (computed in float32). The core takes it where it beats SDPA on the
running machine; this suite runs it wherever it applies (conftest.py), and the rule itself is
checked below. The ops against float64 on odd sizes, masks and causal; the module through them."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

from helpers import assert_close, mha_pair, run_python_with

ops = torch.ops.torchmha
needs_the_kernel = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                      reason="the CPU runs the ATen composition")
HEAD_DIMS = (1, 3, 7, 8, 64, 80, 128)
MASKS = ("none", "float (L, S)", "float per sequence", "float per head", "-inf entries", "a fully masked row")
LOW_PRECISION = (torch.bfloat16, torch.float16)


def make_mask(kind, N, H, L, S, dtype):
    """An additive mask of one kind, as the core passes it (4-D, or 2-D that SDPA broadcasts)."""
    if kind == "none":
        return None
    if kind == "float (L, S)":
        return torch.randn(L, S, dtype=dtype)
    if kind == "float per sequence":
        return torch.randn(N, 1, L, S, dtype=dtype)
    mask = torch.randn(N, H, L, S, dtype=dtype)
    if kind in ("-inf entries", "a fully masked row"):
        mask.masked_fill_(torch.rand(N, H, L, S) < 0.4, float("-inf"))
        mask[..., 0] = 0.0
    if kind == "a fully masked row":
        mask[:, :, L // 2] = float("-inf")
    return mask


@st.composite
def cases(draw):
    return dict(
        N=draw(st.integers(1, 3)), H=draw(st.integers(1, 3)), L=draw(st.integers(1, 90)),
        S=draw(st.sampled_from([1, 2, 17, 64, 255, 300])), D=draw(st.sampled_from(HEAD_DIMS)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        mask=draw(st.sampled_from(MASKS)), causal=draw(st.booleans()),
    )


def inputs(c, requires_grad=False):
    N, H, L, S, D, dtype = c["N"], c["H"], c["L"], c["S"], c["D"], c["dtype"]
    q, k, v = (torch.randn(N, H, n, D, dtype=dtype, requires_grad=requires_grad) for n in (L, S, S))
    mask = None if c["causal"] else make_mask(c["mask"], N, H, L, S, dtype)
    return q, k, v, mask


def sdpa(q, k, v, mask, causal, dtype=torch.float64):
    """SDPA's math backend at `dtype` (SDPA's rows with no allowed key are zeros, like the kernel's)."""
    cast = (lambda t: None if t is None else t.to(dtype))  # differentiable: gradients reach the inputs
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(cast(q), cast(k), cast(v), cast(mask), is_causal=causal)


def assert_within_torch_error(actual, inputs_, expected64, what):
    """float32: 1e-5 of float64. bfloat16/float16: no further from float64 than SDPA at that dtype
    (twice its error, plus one rounding of the largest value or of 1)."""
    dtype = actual.dtype
    if dtype == torch.float32:
        assert_close(actual.double(), expected64, torch.float32, what)
        return
    torch_error = (sdpa(*inputs_, dtype=dtype).double() - expected64).abs().max().item()
    ours_error = (actual.double() - expected64).abs().max().item()
    bound = 2 * torch_error + torch.finfo(dtype).eps * max(expected64.abs().max().item(), 1.0)
    assert ours_error <= bound, f"{what}: error {ours_error:.3g} against torch's {torch_error:.3g} ({dtype})"


@needs_the_kernel
@given(cases())
def test_forward_matches_float64(c):
    q, k, v, mask = inputs(c)
    heads, lse = ops.blocked_attention(q, k, v, mask, c["causal"])
    expected = sdpa(q, k, v, mask, c["causal"])
    assert heads.dtype == q.dtype and heads.shape == q.shape
    assert heads.permute(2, 0, 1, 3).is_contiguous()  # (L, N, H, D) memory, the output projection's order
    assert_within_torch_error(heads, (q, k, v, mask, c["causal"]), expected, "heads")
    if c["dtype"] == torch.float32:  # the log-sum-exp the backward reads; +inf for a row with no key
        scores = q.double() @ k.double().transpose(2, 3) / c["D"] ** 0.5
        scores = scores + (0 if mask is None else mask.double())
        if c["causal"]:
            scores = scores.masked_fill(torch.ones(c["L"], c["S"], dtype=torch.bool).triu(1), float("-inf"))
        expected_lse = torch.logsumexp(scores, -1)
        expected_lse[expected_lse == float("-inf")] = float("inf")
        assert_close(lse.double(), expected_lse, torch.float32, "log-sum-exp")


@needs_the_kernel
@given(cases())
def test_backward_matches_autograd_in_float64(c):
    q, k, v, mask = inputs(c, requires_grad=True)
    grad = torch.randn_like(q)
    with torch.no_grad():
        heads, lse = ops.blocked_attention(q, k, v, mask, c["causal"])
        got = ops.blocked_attention_backward(grad, q, k, v, mask, c["causal"], heads, lse)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64 = sdpa(q64, k64, v64, mask, c["causal"])
    expected = torch.autograd.grad(out64, (q64, k64, v64), grad.double())
    for name, ours, ref, x in zip("qkv", got, expected, (q, k, v)):
        assert ours.dtype == x.dtype and ours.shape == x.shape
        if c["dtype"] == torch.float32:
            assert_close(ours.double(), ref, torch.float32, f"d{name}")
        else:  # against torch's gradient at that dtype, through its own autograd
            xs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            torch_grads = torch.autograd.grad(sdpa(*xs, mask, c["causal"], dtype=c["dtype"]), xs, grad)
            torch_error = (torch_grads["qkv".index(name)].double() - ref).abs().max().item()
            ours_error = (ours.double() - ref).abs().max().item()
            bound = 2 * torch_error + torch.finfo(c["dtype"]).eps * max(ref.abs().max().item(), 1.0)
            assert ours_error <= bound, f"d{name}: error {ours_error:.3g} against torch's {torch_error:.3g}"


@needs_the_kernel
@pytest.mark.parametrize("L, S, D, causal", [(300, 700, 64, False), (513, 513, 32, True), (130, 40, 128, True)])
def test_many_blocks_of_queries_and_keys(L, S, D, causal):
    """More query blocks than threads and more key blocks than one (the running softmax's rescaling)."""
    c = dict(N=2, H=2, L=L, S=S, D=D, dtype=torch.float32, mask="float per head", causal=causal)
    q, k, v, mask = inputs(c)
    heads, _ = ops.blocked_attention(q, k, v, mask, causal)
    assert_close(heads.double(), sdpa(q, k, v, mask, causal), torch.float32)


@needs_the_kernel
def test_rows_with_no_allowed_key_are_zeros_with_zero_gradients():
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.zeros(1, 2, 5, 5)
    mask[:, :, 2] = float("-inf")
    heads, lse = ops.blocked_attention(q.detach(), k.detach(), v.detach(), mask, False)
    assert (heads[:, :, 2] == 0).all() and (lse[:, :, 2] == float("inf")).all()
    dq, dk, dv = ops.blocked_attention_backward(torch.ones_like(q), q.detach(), k.detach(), v.detach(), mask, False,
                                                heads, lse)
    assert (dq[:, :, 2] == 0).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def opcheck_samples():
    f32 = dict(dtype=torch.float32)
    q, k, v = (torch.randn(2, 2, n, 8, **f32) for n in (5, 7, 7))
    mask = torch.randn(2, 1, 5, 7, **f32)
    heads, lse = ops.blocked_attention(q, k, v, mask, False)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    bf_heads, bf_lse = ops.blocked_attention(*bf, None, True)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # (N, L, H, D) memory
    return [
        (ops.blocked_attention.default, (q, k, v, mask, False)),
        (ops.blocked_attention.default, (*bf, None, True)),
        (ops.blocked_attention.default, (*strided, None, False)),
        (ops.blocked_attention.default, (*strided, mask, False, True)),  # heads in (N, L, H, D) memory
        (ops.blocked_attention_backward.default, (torch.randn_like(q), q, k, v, mask, False, heads, lse)),
        (ops.blocked_attention_backward.default, (torch.randn_like(bf[0]), *bf, None, True, bf_heads, bf_lse)),
    ]


@pytest.mark.parametrize("index", range(6))
def test_opcheck(index):
    op, args = opcheck_samples()[index]
    opcheck(op, args)


@needs_the_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_major", [False, True])
def test_heads_come_in_the_order_asked_for(dtype, batch_major):
    """(L, N, H, D) memory, the order torch's (L, N, E) output projection reads, or (N, L, H, D)."""
    q, k, v = (torch.randn(2, 3, n, 8, dtype=dtype) for n in (5, 7, 7))
    heads, lse = ops.blocked_attention(q, k, v, None, False, batch_major)
    expected, expected_lse = ops.blocked_attention(q, k, v, None, False)
    assert (heads.transpose(1, 2) if batch_major else heads.permute(2, 0, 1, 3)).is_contiguous()
    assert torch.equal(heads, expected) and torch.equal(lse, expected_lse)


@pytest.mark.parametrize("why, call, error", [
    ("keys of another batch",
     lambda q, kv: ops.blocked_attention(q, kv.repeat(2, 1, 1, 1)[:3], kv, None, False), "must match the size"),
    ("values of another length",
     lambda q, kv: ops.blocked_attention(q, kv, kv[:, :, :3], None, False), "must match the size|batch2"),
    ("a mask of another batch",
     lambda q, kv: ops.blocked_attention(q, kv, kv, torch.randn(3, 2, 4, 5), False), "must match the size"),
], ids=["keys of another batch", "values of another length", "a mask of another batch"])
def test_shapes_that_do_not_fit_raise_atens_error(why, call, error):
    """Read through raw pointers: shapes that disagree take the composition, which raises."""
    q, kv = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(RuntimeError, match=error):
        call(q, kv)


# ------------------------------------------------------------------------------- in the module
def profiled_training(module, x, **kwargs):
    with torch.profiler.profile() as prof:
        out, _ = module(x, x, x, need_weights=False, **kwargs)
        out.square().sum().backward()
    return {e.name for e in prof.events()}


@needs_the_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_training_through_the_kernels_matches_torch(dtype, kind):
    N, L, E, H = 2, 70, 48, 3
    ref, ours = mha_pair(E, H, batch_first=True, dtype=dtype)
    x = torch.randn(N, L, E, dtype=dtype)
    kwargs = dict(key_padding_mask=torch.rand(N, L) < 0.2) if kind == "padding" else dict(
        attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype), is_causal=True)
    results = []
    for module in (ref, ours):
        xx = x.clone().requires_grad_()
        out, _ = module(xx, xx, xx, need_weights=False, **kwargs)
        (out.float() ** 2).sum().backward()
        results.append((out, xx.grad, module.in_proj_weight.grad.clone()))
    names = profiled_training(ours, x.clone().requires_grad_(), **kwargs)
    assert {"torchmha::blocked_attention", "torchmha::blocked_attention_backward"} <= names
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in names
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    for what, ours_t, ref_t in zip(("output", "input gradient", "in_proj gradient"), results[1], results[0]):
        scale = max(ref_t.abs().max().item(), 1.0)
        assert (ours_t.double() - ref_t.double()).abs().max().item() <= tolerance * scale, what


@needs_the_kernel
def test_second_derivatives_go_through_sdpas_math():
    """Under create_graph the backward differentiates SDPA's math, so a second derivative exists
    and is torch's (torch's module needs SDPA's math backend for it in float32: its CPU flash
    kernel has no double backward)."""
    ref, ours = mha_pair(16, 2, batch_first=True, dtype=torch.float32)
    x = torch.randn(2, 9, 16)
    results = []
    for module in (ref, ours):
        xx = x.clone().requires_grad_()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out, _ = module(xx, xx, xx, need_weights=False)
        (grad,) = torch.autograd.grad(out.sin().sum(), xx, create_graph=True)
        (second,) = torch.autograd.grad((grad**2).sum(), xx)
        results.append((grad, second))
    assert_close(results[1][0], results[0][0], torch.float32, "gradient")
    assert_close(results[1][1], results[0][1], torch.float32, "second derivative")


# ------------------------------------------------------------------------------- the rule
RULE_CHECK = """
import torch, torchmha
def runs_kernel(dtype, L, causal=False, train=False):
    m = torchmha.MultiheadAttention(64, 1, batch_first=True, dtype=dtype).train(train)
    x = torch.randn(1, L, 64, dtype=dtype, requires_grad=train)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype) if causal else None
    with torch.profiler.profile() as prof, torch.set_grad_enabled(train):
        m(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)
    return any(e.name == "torchmha::blocked_attention" for e in prof.events())
amd, intel, fp16 = AMD, INTEL, FP16
cases = [(torch.bfloat16, 128, False, False, True), (torch.float16, 256, False, True, True),
         (torch.float16, 256, False, False, not fp16), (torch.float16, 64, False, False, False),
         (torch.float16, 128, True, False, not fp16), (torch.float16, 16, False, True, True),
         (torch.bfloat16, 16, False, False, False), (torch.float32, 128, False, False, True),
         (torch.float32, 1024, False, False, amd), (torch.float32, 512, False, False, amd or intel), (torch.float32, 64, False, False, False),
         (torch.float32, 128, True, False, True), (torch.float32, 16, True, False, False),
         (torch.float32, 128, False, True, True), (torch.float32, 2048, False, True, amd),
         (torch.float32, 32, False, True, False), (torch.float32, 1024, True, True, True)]
for dtype, L, causal, train, expected in cases:
    assert runs_kernel(dtype, L, causal, train) == expected, (dtype, L, causal, train)
"""


AVX2_RULE_CHECK = RULE_CHECK.split("amd, intel, fp16")[0] + """
cases = [(torch.bfloat16, 128, False, False, True), (torch.bfloat16, 512, False, False, True),
         (torch.bfloat16, 1024, False, False, False), (torch.bfloat16, 1024, True, False, True),
         (torch.bfloat16, 2048, True, False, False), (torch.bfloat16, 1024, False, True, True),
         (torch.bfloat16, 16, False, False, True), (torch.bfloat16, 8, False, False, False),
         (torch.float16, 16, False, False, True), (torch.float16, 1024, False, False, True),
         (torch.float32, 512, False, False, True), (torch.float32, 1024, False, False, False),
         (torch.float32, 1024, True, False, True), (torch.float32, 2048, True, False, False)]
for dtype, L, causal, train, expected in cases:
    assert runs_kernel(dtype, L, causal, train) == expected, (dtype, L, causal, train)
"""


@needs_the_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2")
def test_the_avx2_copy_keeps_sdpa_where_it_was_measured_faster():
    """The AVX2 copy (the AMD EPYC Zen 3; TORCHMHA_CPU_CAPABILITY=avx2 puts it on any CPU), on AMD
    without AMX: float32 forward from 128^2 and bfloat16's from 16^2, both up to 512^2 scores a head
    (causal up to 1024^2); bfloat16 training without an upper bound; float16 (no AVX512-FP16) forward
    from 16^2 without one."""
    run_python_with(AVX2_RULE_CHECK, set_env={"TORCHMHA_CPU_CAPABILITY": "avx2", "TORCHMHA_CPU_VENDOR": "amd",
                                               "TORCHMHA_AMX": "0", "TORCHMHA_AVX512_FP16": "0"},
                    unset=("TORCHMHA_BLOCKED_KERNEL",))


SDPA_COPY_CHECK = """
import torch, torchmha
from torch.testing import assert_close
def copies(dtype, L, causal=False, train=False):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(64, 1, batch_first=True, dtype=dtype).train(train)
    m = torchmha.MultiheadAttention(64, 1, batch_first=True, dtype=dtype).train(train)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(1, L, 64, dtype=dtype, requires_grad=train)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype) if causal else None
    with torch.profiler.profile() as prof, torch.set_grad_enabled(train):
        out, _ = m(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)
    with torch.set_grad_enabled(train):
        expected, _ = ref(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # (of the values' magnitude)
    assert_close(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    names = [e.name for e in prof.events()]
    assert "aten::scaled_dot_product_attention" in names or "torchmha::blocked_attention" in names, names
    return names.count("aten::clone") == 3
cases = CASES
for dtype, L, causal, train, expected in cases:
    assert copies(dtype, L, causal, train) == expected, (dtype, L, causal, train)
"""


@needs_the_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2")
@pytest.mark.parametrize("vendor,forced,cases", [
    ("amd", None, "[(torch.float32, 1024, False, False, True), (torch.float32, 512, False, False, False), "
                  "(torch.float32, 1024, True, False, False), (torch.float32, 1024, False, True, False), "
                  "(torch.bfloat16, 1024, False, False, False)]"),
    ("intel", None, "[(torch.float32, 1024, False, False, False)]"),
    ("amd", "0", "[(torch.float32, 1024, False, False, False)]"),
    ("intel", "1", "[(torch.float32, 64, False, False, True), (torch.bfloat16, 64, True, True, True)]"),
], ids=["amd-rule", "intel", "forced-off", "forced-on"])
def test_sdpa_gets_contiguous_heads_where_it_was_measured_faster(vendor, forced, cases):
    """Where SDPA runs on the AMD EPYC Zen 3 (the AVX2 copy, forced here on any CPU): float32, forward,
    not causal, from 1024^2 scores a head, q, k and v copied to (N, H, L, D) first (three clones), with
    torch's results; views elsewhere, and on other vendors (not measured). TORCHMHA_SDPA_CONTIGUOUS
    forces either way."""
    env = {"TORCHMHA_CPU_CAPABILITY": "avx2", "TORCHMHA_CPU_VENDOR": vendor, "TORCHMHA_AMX": "0",
           "TORCHMHA_AVX512_FP16": "0"}
    if forced is not None:
        env |= {"TORCHMHA_SDPA_CONTIGUOUS": forced, "TORCHMHA_BLOCKED_KERNEL": "0"}
    run_python_with(SDPA_COPY_CHECK.replace("CASES", cases), set_env=env,
                    unset=("TORCHMHA_BLOCKED_KERNEL", "TORCHMHA_SDPA_CONTIGUOUS"))


@needs_the_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the rule was measured with AVX-512")
def test_the_kernel_runs_where_it_was_measured_faster_than_sdpa():
    """Without the suite's setting: bfloat16 from 128^2 scores a head, float16 in training (and
    forward from 128^2 without AVX512-FP16), float32 causal from 128^2; float32 otherwise from 64^2
    (training) or 128^2 (forward), without a bound on AMD, up to 512^2 (both) on Intel, up to 512^2
    and 256^2 on other vendors; SDPA elsewhere (blocked_attention_kernel.cpp, benchmarks/README). Each vendor's rule is
    checked as on the CPUs measured (the AMD EPYC without AVX512-FP16, the Intel Xeon with it),
    forced by TORCHMHA_CPU_VENDOR and TORCHMHA_AVX512_FP16, without AMX (TORCHMHA_AMX=0); then this
    CPU."""
    unset = ("TORCHMHA_BLOCKED_KERNEL", "TORCHMHA_CPU_VENDOR", "TORCHMHA_AVX512_FP16")
    for vendor in ("amd", "intel", "other"):
        code = RULE_CHECK.replace("AMD", str(vendor == "amd")).replace("INTEL", str(vendor == "intel"))
        code = code.replace("FP16", str(vendor == "intel"))
        run_python_with(code, set_env={"TORCHMHA_CPU_VENDOR": vendor, "TORCHMHA_AMX": "0",
                                       "TORCHMHA_AVX512_FP16": str(int(vendor == "intel"))}, unset=unset)
    cpuinfo = open("/proc/cpuinfo").read()
    this_cpu = RULE_CHECK.replace("AMD", str("AuthenticAMD" in cpuinfo)).replace("INTEL", str("GenuineIntel" in cpuinfo)).replace("FP16", str("avx512_fp16" in cpuinfo))
    run_python_with(this_cpu, set_env={"TORCHMHA_AMX": "0"}, unset=unset)
