"""torchmha's explicit-weights kernel (csrc/cpu/explicit_attention_kernel.cpp): where the weights are
returned and no gradient or dropout is needed (eval, no_grad, inference_mode), the attention runs
through blocks of query rows without the (N, H, L, S) scores. Its results against torch's module,
odd sizes and every kind of mask, and the proof that it runs, and only there."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import assert_close, mha_pair, run_python_with

HEAD_DIMS = (1, 3, 7, 8, 16, 80, 128)
MASKS = ("none", "bool attn_mask", "float attn_mask", "3-D attn_mask", "padding", "padding and attn_mask",
         "a fully masked row")


def make_masks(kind, N, H, L, S, dtype):
    """(attn_mask, key_padding_mask) of one kind; only 'a fully masked row' hides every key of a query."""
    attn = padding = None
    if kind in ("bool attn_mask", "padding and attn_mask"):
        attn = torch.rand(L, S) < 0.3
        attn[:, 0] = False
    if kind == "float attn_mask":
        attn = torch.randn(L, S, dtype=dtype)
    if kind == "3-D attn_mask":
        attn = torch.randn(N * H, L, S, dtype=dtype)
    if kind in ("padding", "padding and attn_mask"):
        padding = torch.rand(N, S) < 0.3
        padding[:, 0] = False
    if kind == "a fully masked row":
        attn = torch.zeros(L, S, dtype=torch.bool)
        attn[L // 2] = True
    return attn, padding


@st.composite
def cases(draw):
    H = draw(st.integers(1, 4))
    return dict(
        N=draw(st.integers(1, 3)), H=H, D=draw(st.sampled_from(HEAD_DIMS)), L=draw(st.integers(1, 40)),
        S=draw(st.integers(1, 40)), dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        average=draw(st.booleans()), batch_first=draw(st.booleans()), mask=draw(st.sampled_from(MASKS)),
        self_attention=draw(st.booleans()),
    )


def run_both(c, seed=0):
    """Torch's module and ours on the same weights and inputs, eval and no_grad: (expected, got)."""
    N, H, L, S, E, dtype = c["N"], c["H"], c["L"], c["S"], c["H"] * c["D"], c["dtype"]
    if c.get("self_attention"):
        S = L
    ref, ours = mha_pair(E, H, dtype=dtype, batch_first=c["batch_first"], seed=seed)
    ref.eval(), ours.eval()
    query = torch.randn(N, L, E, dtype=dtype)
    key = query if c.get("self_attention") else torch.randn(N, S, E, dtype=dtype)
    if not c["batch_first"]:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    attn, padding = make_masks(c["mask"], N, H, L, S, dtype)
    kwargs = dict(attn_mask=attn, key_padding_mask=padding, average_attn_weights=c["average"])
    with torch.no_grad():
        return ref(query, key, key, **kwargs), ours(query, key, key, **kwargs)


@given(cases())
def test_matches_torch(c):
    (expected_out, expected_w), (out, w) = run_both(c)
    assert_close(out, expected_out, c["dtype"], "output")
    assert_close(w, expected_w, c["dtype"], "weights")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("average", [True, False])
def test_many_row_blocks_on_every_thread(dtype, average):
    """Long enough for many blocks of rows per sequence (the block holds about 256 KiB of
    scores), split over the threads, with a mask that differs per sequence and per row."""
    c = dict(N=3, H=4, D=16, L=300, S=1500, dtype=dtype, average=average, batch_first=False,
             mask="padding and attn_mask")
    (expected_out, expected_w), (out, w) = run_both(c)
    assert_close(out, expected_out, dtype, "output")
    assert_close(w, expected_w, dtype, "weights")


# The kernel's inner loop is built for AVX2 and AVX-512; elsewhere the composition runs.
needs_the_kernel = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                      reason="the CPU runs the ATen composition")


def profiled(module, x, **kwargs):
    """The op names one forward runs, and the most memory any one of them kept allocated."""
    with torch.profiler.profile(profile_memory=True) as prof:
        module(x, x, x, **kwargs)
    events = prof.events()
    return {e.name for e in events}, max(e.cpu_memory_usage for e in events)


@needs_the_kernel
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "eval, parameters frozen"])
def test_runs_without_the_per_head_scores(mode):
    N, H, L, E = 2, 4, 96, 32
    _, ours = mha_pair(E, H, batch_first=True)
    ours.eval()
    x = torch.randn(N, L, E, dtype=torch.float64)
    if mode == "eval, parameters frozen":
        ours.requires_grad_(False)
    context = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode()}.get(mode, torch.enable_grad())
    with context:
        names, most_memory = profiled(ours, x)
    assert "torchmha::attention_with_weights" in names
    assert "aten::softmax" not in names and "aten::_softmax" not in names
    assert most_memory < N * H * L * L * 8, f"{most_memory} bytes, the per-head scores are {N * H * L * L * 8}"


@needs_the_kernel
@pytest.mark.parametrize("batch_major", [False, True])
def test_heads_come_in_the_order_asked_for(batch_major):
    """(L, N, H, D) memory, the order torch's (L, N, E) output projection reads, or (N, L, H, D)."""
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (5, 7, 7))
    heads, weights = torch.ops.torchmha.attention_with_weights(q, k, v, None, True, batch_major)
    expected, expected_weights = torch.ops.torchmha.attention_with_weights(q, k, v, None, True)
    assert (heads.transpose(1, 2) if batch_major else heads.permute(2, 0, 1, 3)).is_contiguous()
    assert torch.equal(heads, expected) and torch.equal(weights, expected_weights)


@needs_the_kernel
def test_batch_first_inference_merges_the_heads_without_a_copy():
    """torch's fused path returns (N, L, E) contiguous; the kernel writes the heads in that order,
    so the output projection reads them in place."""
    N, H, L, E = 2, 4, 16, 32
    _, ours = mha_pair(E, H, batch_first=True)
    ours.eval()
    x = torch.randn(N, L, E, dtype=torch.float64)
    with torch.no_grad(), torch.profiler.profile(record_shapes=True) as prof:
        ours(x, x, x)
    copies = [e.input_shapes for e in prof.events() if e.name in ("aten::copy_", "aten::clone")]
    assert [N, L, E] not in [shape for shapes in copies for shape in shapes], copies


@st.composite
def training_cases(draw):
    c = draw(cases())
    c["dtype"] = torch.float64
    c["use"] = draw(st.sampled_from(["output and weights", "output", "weights"]))
    return c


@given(training_cases())
def test_gradients_match_torch(c):
    """In training (dropout 0) the kernels run as one autograd node whose backward recomputes the
    probabilities block by block: the output, the weights and every gradient (inputs and
    parameters) are torch's."""
    assert_gradients_match_torch(c)


@pytest.mark.parametrize("average", [True, False])
def test_gradients_over_many_row_blocks(average):
    """4096 keys make row blocks of 32 rows in double: dK and dV add up over four blocks."""
    c = dict(N=2, H=2, D=8, L=100, S=4096, dtype=torch.float64, average=average, batch_first=False, mask="padding",
             use="output and weights")
    assert_gradients_match_torch(c)


def assert_gradients_match_torch(c):
    N, H, L, S, E, dtype = c["N"], c["H"], c["L"], c["S"], c["H"] * c["D"], c["dtype"]
    ref, ours = mha_pair(E, H, dtype=dtype)
    query, key = torch.randn(L, N, E, dtype=dtype), torch.randn(S, N, E, dtype=dtype)
    attn, padding = make_masks(c["mask"], N, H, L, S, dtype)
    results = []
    for module in (ref, ours):
        q, k = query.clone().requires_grad_(), key.clone().requires_grad_()
        out, weights = module(q, k, k, attn_mask=attn, key_padding_mask=padding, average_attn_weights=c["average"])
        generator = torch.Generator().manual_seed(1)
        loss = 0
        if c["use"] != "weights":
            loss = loss + (out * torch.randn(out.shape, dtype=dtype, generator=generator)).sum()
        if c["use"] != "output":
            loss = loss + (weights.nan_to_num() * torch.randn(weights.shape, dtype=dtype, generator=generator)).sum()
        loss.backward()
        results.append({"output": out, "weights": weights, "grad query": q.grad, "grad key": k.grad,
                        **{f"grad {n}": p.grad for n, p in module.named_parameters() if p.grad is not None}})
    expected, got = results
    assert expected.keys() == got.keys()
    for name in expected:
        assert_close(got[name], expected[name], dtype, name)


def test_second_derivatives_match_torch():
    """Under create_graph the node's backward differentiates the composition, so gradients of
    gradients (a gradient penalty) are torch's too."""
    ref, ours = mha_pair(12, 3)
    x = torch.randn(6, 2, 12, dtype=torch.float64)
    results = []
    for module in (ref, ours):
        xx = x.clone().requires_grad_()
        out, weights = module(xx, xx, xx)
        (grad,) = torch.autograd.grad((out**2).sum() + (weights**2).sum(), xx, create_graph=True)
        (second,) = torch.autograd.grad((grad**2).sum(), xx)
        results.append((grad, second))
    assert_close(results[1][0], results[0][0], torch.float64, "gradient")
    assert_close(results[1][1], results[0][1], torch.float64, "second derivative")


@needs_the_kernel
def test_training_keeps_no_per_head_scores():
    N, H, L, E = 2, 4, 96, 32
    _, ours = mha_pair(E, H, batch_first=True)
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)
    names, most_memory = profiled(ours, x)
    assert "torchmha::attention_with_weights" in names and "aten::softmax" not in names
    assert most_memory < N * H * L * L * 8, f"{most_memory} bytes, the per-head scores are {N * H * L * L * 8}"


@pytest.mark.parametrize("why", ["dropout", "forward-mode AD", "a float mask that needs its gradient"])
def test_the_composition_where_the_kernels_cannot_serve(why):
    """The kernels draw no dropout, know no forward-mode tangent and give no gradient to the mask:
    those calls take the composition (whose gradients and dropout draws are torch's, tested
    elsewhere)."""
    E, H = 16, 4
    _, ours = mha_pair(E, H, dropout=0.5 if why == "dropout" else 0.0)
    ours.train(why == "dropout")
    x = torch.randn(5, 2, E, dtype=torch.float64)
    if why == "forward-mode AD":
        import torch.autograd.forward_ad as fwAD

        with torch.no_grad(), fwAD.dual_level():
            dual = fwAD.make_dual(x, torch.randn_like(x))
            with torch.profiler.profile() as prof:
                out, _ = ours(dual, dual, dual)
            assert fwAD.unpack_dual(out).tangent is not None
        names = {e.name for e in prof.events()}
    elif why == "dropout":
        names, _ = profiled(ours, x)
    else:
        mask = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
        names, _ = profiled(ours, x, attn_mask=mask)
    assert "torchmha::attention_with_weights" not in names
    assert "aten::softmax" in names


@needs_the_kernel
def test_the_kernels_serve_every_size_unless_a_threshold_is_set():
    """float and double take the kernels at every size (they beat or tie the composition there);
    TORCHMHA_MIN_KERNEL_SCORES keeps the composition below that many scores a head."""
    code = """
import torch, torchmha
for dtype in (torch.float64, torch.float32):
    for length in (2, 16, 400):
        m = torchmha.MultiheadAttention(8, 1, dtype=dtype).eval()
        x = torch.randn(length, 1, 8, dtype=dtype)
        with torch.no_grad(), torch.profiler.profile() as prof:
            m(x, x, x)
        ran = any(e.name == "torchmha::attention_with_weights" for e in prof.events())
        assert ran == (length * length >= THRESHOLD), (dtype, length, ran)
"""
    run_python_with(code.replace("THRESHOLD", "0"), unset=("TORCHMHA_MIN_KERNEL_SCORES",))
    run_python_with(code.replace("THRESHOLD", "1000"), set_env={"TORCHMHA_MIN_KERNEL_SCORES": "1000"})


@needs_the_kernel
@pytest.mark.parametrize("transposed", ["0", "1"], ids=["in-place-gemm", "transposed-keys"])
def test_both_products_of_the_scores_match_torch(transposed):
    """Q K^T either way (explicit_attention_kernel.cpp, transposes_keys): brgemm over each head's K^T,
    and the call on one thread below 2^22 multiply-adds, or the BLAS GEMM reading K in place, forced
    by TORCHMHA_TRANSPOSED_KEYS. Small calls and ones split over threads in blocks of rows, masks,
    both head orders, with and without the average."""
    code = f"""
import sys
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
import torch
from helpers import assert_close
from test_explicit_attention import run_both
for N, H, D, L, S, mask in [(1, 4, 64, 16, 16, "none"), (2, 3, 7, 33, 40, "padding and attn_mask"),
                            (3, 2, 16, 300, 100, "3-D attn_mask"), (1, 8, 64, 128, 128, "a fully masked row"),
                            (2, 2, 16, 260, 200, "float attn_mask")]:
    for average in (True, False):
        c = dict(N=N, H=H, D=D, L=L, S=S, dtype=torch.float32, average=average, batch_first=average, mask=mask)
        (expected_out, expected_w), (out, w) = run_both(c)
        assert_close(out, expected_out, torch.float32, "output")
        assert_close(w, expected_w, torch.float32, "weights")
"""
    run_python_with(code, set_env={"TORCHMHA_TRANSPOSED_KEYS": transposed})


TRANSPOSED_KEYS_RULE = """
import torch
def reads_k_in_place(dtype, S):
    q, k = torch.randn(1, 4, 16, 64, dtype=dtype), torch.randn(1, 4, S, 64, dtype=dtype)
    with torch.no_grad(), torch.profiler.profile() as prof:
        torch.ops.torchmha.attention_with_weights(q, k, k, None, True)
    # (TORCHMHA_BLAS_GEMM=0: the GEMM in place runs as ATen's addmm; brgemm is no op)
    return any(e.name.startswith("aten::") and e.name.endswith("mm") for e in prof.events())
for dtype, S, expected in CASES:
    assert reads_k_in_place(dtype, S) == expected, (dtype, S)
"""


@needs_the_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2")
@pytest.mark.parametrize("vendor,forced,cases", [
    ("amd", None, "[(torch.float32, 16, False), (torch.float32, 128, False), (torch.float32, 129, True), "
                  "(torch.float64, 16, True)]"),
    ("intel", None, "[(torch.float32, 16, True)]"),
    ("amd", "0", "[(torch.float32, 16, True)]"),
    ("intel", "1", "[(torch.float32, 16, False), (torch.float32, 200, False), (torch.float64, 16, True)]"),
], ids=["amd-avx2", "intel", "forced-off", "forced-on"])
def test_keys_are_transposed_where_it_was_measured_faster(vendor, forced, cases):
    """transposes_keys: float32 up to 128 keys on AMD running the AVX2 copy (forced here on any CPU);
    the GEMM in place for more keys, for double and on other vendors; TORCHMHA_TRANSPOSED_KEYS
    forces either way (float32 only)."""
    env = {"TORCHMHA_CPU_CAPABILITY": "avx2", "TORCHMHA_CPU_VENDOR": vendor, "TORCHMHA_BLAS_GEMM": "0"}
    if forced is not None:
        env["TORCHMHA_TRANSPOSED_KEYS"] = forced
    run_python_with("import torchmha\n" + TRANSPOSED_KEYS_RULE.replace("CASES", cases), set_env=env,
                    unset=("TORCHMHA_TRANSPOSED_KEYS",))
