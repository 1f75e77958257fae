"""Incremental decoding: KeyValueCache and StaticKeyValue with MultiheadAttention.forward_with_cache
and project_key_value: equal to one causal (or cross-attention) forward of torch's, the cache's life
cycle, what a decoding step rejects, and compiled decoding."""

from pathlib import Path

import pytest
import torch

import torchmha
from helpers import run_python_with, assert_close, causal_mask, decode, mha_pair, padding_mask

E, H, N, L = 16, 4, 3, 11


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 3, 4, L])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_decoding_equals_full_causal_forward(dtype, chunk, batch_first, padded):
    ref, ours = mha_pair(E, H, batch_first=batch_first, dtype=dtype)
    ref.eval(), ours.eval()
    x = torch.randn((N, L, E) if batch_first else (L, N, E), dtype=dtype)
    kpm = padding_mask(N, L) if padded else None
    expected = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(L), need_weights=False)[0]
    cache = torchmha.KeyValueCache.for_module(ours, batch_size=N, max_length=L + 5)
    with torch.no_grad():
        actual = decode(ours, x, cache, chunk, batch_first, kpm)
    assert cache.length == L
    assert_close(actual, expected, dtype, f"chunk={chunk}")


class Sequences:
    """Each sequence's tokens so far, and torch's causal forward over one sequence alone: what
    every output row of a batched, mixed-length decoding step must equal."""

    def __init__(self, ref, batch):
        self.ref, self.tokens = ref, [[] for _ in range(batch)]

    def append(self, i, rows):
        self.tokens[i].extend(rows)

    def expected_last(self, i, count):
        x = torch.stack(self.tokens[i]).unsqueeze(1)  # (L, 1, E)
        out = self.ref(x, x, x, attn_mask=causal_mask(len(x)), need_weights=False)[0][:, 0]
        return out[len(x) - count:]


LOW_PRECISION = {torch.bfloat16: 5e-2}  # bfloat16 runs the ATen fallback of the decode kernel; its own rounding


def step(ours, seqs, x, new_lengths, dtype):
    """One batched step of x (T, N, E); checks every sequence's rows against torch alone."""
    with torch.no_grad():
        out = ours.forward_with_cache(x, seqs.cache, new_lengths=torch.tensor(new_lengths))
    for i, count in enumerate(new_lengths):
        seqs.append(i, list(x[:count, i]))
        if count and dtype in LOW_PRECISION:
            torch.testing.assert_close(out[:count, i], seqs.expected_last(i, count), atol=LOW_PRECISION[dtype], rtol=0)
        elif count:
            assert_close(out[:count, i], seqs.expected_last(i, count), dtype, f"sequence {i}")
        assert not out[count:, i].any(), "rows past new_lengths must be zeros"
    assert seqs.cache.lengths.tolist() == [len(t) for t in seqs.tokens]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sequences_at_different_positions_equal_torch_alone(dtype):
    """Prefill of prompts of mixed lengths, single steps, beam-search reorder and a slot reset:
    each sequence's outputs equal torch's causal forward over that sequence alone."""
    ref, ours = mha_pair(E, H, dtype=dtype)
    ref.eval(), ours.eval()
    seqs = Sequences(ref, N)
    seqs.cache = torchmha.KeyValueCache.for_module(ours, N, 16)
    step(ours, seqs, torch.randn(5, N, E, dtype=dtype), [2, 5, 3], dtype)   # prefill, mixed
    for _ in range(3):                                                            # one token each
        step(ours, seqs, torch.randn(1, N, E, dtype=dtype), [1, 1, 1], dtype)
    with pytest.raises(RuntimeError, match="different lengths"):
        seqs.cache.length
    seqs.cache.reorder(torch.tensor([2, 0, 0]))                                   # beam search
    seqs.tokens = [list(seqs.tokens[j]) for j in (2, 0, 0)]
    step(ours, seqs, torch.randn(1, N, E, dtype=dtype), [1, 1, 1], dtype)
    seqs.cache.reset(torch.tensor([1]))                                           # a new request in slot 1
    seqs.tokens[1] = []
    step(ours, seqs, torch.randn(2, N, E, dtype=dtype), [1, 2, 0], dtype)
    seqs.cache.reset(torch.tensor([True, False, True]))
    assert seqs.cache.lengths.tolist() == [0, 2, 0]
    seqs.cache.reset()
    assert seqs.cache.length == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_long_sequences_at_different_lengths_split_over_threads(dtype):
    """Enough keys for the CPU kernel to split the (sequence, head) pairs over threads by work:
    prompts of very different lengths, then steps; every sequence equals torch alone."""
    ref, ours = mha_pair(64, 4, dtype=dtype)
    ref.eval(), ours.eval()
    lengths = [40, 700, 3, 400, 0, 260]
    seqs = Sequences(ref, len(lengths))
    seqs.cache = torchmha.KeyValueCache.for_module(ours, len(lengths), 720)
    step(ours, seqs, torch.randn(700, len(lengths), 64, dtype=dtype), lengths, dtype)
    for _ in range(2):
        step(ours, seqs, torch.randn(1, len(lengths), 64, dtype=dtype), [1] * len(lengths), dtype)


# A step into caches already holding rows (the decode kernel), and a prefill of 70 rows into empty
# caches (the blocked kernel in float32/bfloat16/float16, decode_attention_kernel.cpp): (T, M, before, added).
# "uniform", "uniform block": every sequence at one length, one and three new rows each (the
# composition's slice write, no mask at one row).
STEPS = {"step": (2, 9, [3, 0, 6], [2, 0, 1]), "prefill": (70, 80, [0, 0, 0], [70, 0, 33]),
         "uniform": (1, 9, [4, 4, 4], [1, 1, 1]), "uniform block": (3, 12, [4, 4, 4], [3, 3, 3])}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("kind", STEPS)
def test_decode_op_writes_attends_and_advances_each_sequence(dtype, given, kind):
    """The op alone (the CPU kernels; bfloat16 and float16 computed in float): each sequence's new rows go to
    its own position, each new row attends to its own prefix, rows past new_lengths are zeros and
    lengths advance by new_lengths (by T when it is None)."""
    Nb, Hb, D = 3, 2, 8
    T, M, before, added = STEPS[kind]
    before, added = torch.tensor(before), torch.tensor(added) if given else torch.full((3,), T)
    q, k_new, v_new = (torch.randn(Nb, Hb, T, D, dtype=dtype) for _ in range(3))
    k_cache, v_cache = torch.randn(Nb, Hb, M, D, dtype=dtype), torch.randn(Nb, Hb, M, D, dtype=dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    lengths = before.clone()
    torch.full((Nb, Hb, T, D), float("nan"), dtype=dtype)  # freed at once: garbage for the output's allocation
    out = torch.ops.torchmha.decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, added if given else None,
                                              None, 0.0)
    assert lengths.tolist() == (before + added).tolist()
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    tolerance = dict(atol=tolerance, rtol=0)
    for n in range(Nb):
        b, a = int(before[n]), int(added[n])
        expected_k[n, :, b:b + a], expected_v[n, :, b:b + a] = k_new[n, :, :a], v_new[n, :, :a]
        for t in range(T):
            if t >= a:
                assert not out[n, :, t].any(), f"sequence {n} row {t} is past new_lengths: zeros"
                continue
            keys = slice(0, b + t + 1)
            expected = torch.softmax(q[n, :, t:t + 1].double() @ expected_k[n, :, keys].double().transpose(1, 2)
                                     / D**0.5, -1) @ expected_v[n, :, keys].double()
            torch.testing.assert_close(out[n, :, t:t + 1].double(), expected, **tolerance)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


def test_the_composition_writes_attends_and_advances_each_sequence():
    """The same through the ATen composition (TORCHMHA_DECODE_KERNEL_MAX_ROWS=0, as on a device without
    the kernel): ragged lengths, new_lengths, and sequences at one length (its slice write)."""
    code = ("import sys, itertools, torch; sys.path.insert(0, %r); import test_kv_cache as t; "
            "[t.test_decode_op_writes_attends_and_advances_each_sequence(d, g, k) for d, g, k in itertools.product("
            "[torch.float64, torch.float32, torch.bfloat16], [True, False], t.STEPS)]")
    run_python_with(code % str(Path(__file__).parent), set_env={"TORCHMHA_DECODE_KERNEL_MAX_ROWS": "0"})


def composition_step_calls(before):
    """The ATen calls of one one-row step through the composition, from `before` cached rows."""
    q = torch.randn(len(before), 2, 1, 16)
    cache = torch.zeros(len(before), 2, 64, 16)
    with torch.profiler.profile() as prof:
        torch.ops.torchmha.decode_attention(q, q, q, cache, cache.clone(), torch.tensor(before), None, None, 0.0)
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


def test_a_step_at_one_length_is_a_slice_write_and_one_attention():
    """Sequences at one length (a batch decoded together): the composition writes the rows as a slice
    and attends without a mask, in a few kernels, as a hand-written cache does (on an accelerator
    its step is bound by launches); ragged lengths take a scatter write and a mask. One host read."""
    code = ("import sys; sys.path.insert(0, %r); import test_kv_cache as t; "
            "same, ragged = t.composition_step_calls([5, 5]), t.composition_step_calls([5, 2]); "
            "assert 'aten::scatter_' not in same and 'aten::where' not in same, same; "
            "assert 'aten::scatter_' in ragged and 'aten::gather' not in ragged, ragged; "
            "assert same.count('aten::_local_scalar_dense') <= 2 and len(same) < len(ragged), (len(same), len(ragged))")
    run_python_with(code % str(Path(__file__).parent), set_env={"TORCHMHA_DECODE_KERNEL_MAX_ROWS": "0"})


def decode_runs_sdpa(T, dtype=torch.bfloat16):
    """Whether a decode step of T new rows runs the ATen composition (SDPA) rather than the kernel."""
    q = torch.randn(2, 2, T, 16, dtype=dtype)
    cache = torch.zeros(2, 2, 64, 16, dtype=dtype)
    with torch.profiler.profile() as prof:
        torch.ops.torchmha.decode_attention(q, q, q, cache, cache.clone(), torch.tensor([3, 0]), None, None, 0.0)
    return any("scaled_dot_product" in e.name for e in prof.events())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_kernel_rule_takes_every_step_and_prefill(dtype):
    """The kernel runs in every floating dtype, for a step and for a long prefill alike (it beat
    the composition at every size measured: decode_attention_kernel.cpp)."""
    assert not decode_runs_sdpa(1, dtype) and not decode_runs_sdpa(40, dtype)


def test_decode_kernel_setting_limits_its_rows():
    code = ("import sys; sys.path.insert(0, %r); import torchmha, test_kv_cache as t; "
            "assert not t.decode_runs_sdpa(4) and t.decode_runs_sdpa(5)")
    run_python_with(code % str(Path(__file__).parent), set_env={"TORCHMHA_DECODE_KERNEL_MAX_ROWS": "4"})


def prefill_runs_blocked(T, before=(0, 0), padded=False):
    """Whether a step of T new rows after `before` cached rows runs the blocked kernel."""
    q = torch.randn(2, 2, T, 16)
    cache = torch.zeros(2, 2, 128, 16)
    padding = torch.zeros(2, 128) if padded else None
    with torch.profiler.profile() as prof:
        torch.ops.torchmha.decode_attention(q, q, q, cache, cache.clone(), torch.tensor(before), None, padding, 0.0)
    return any(e.name == "torchmha::blocked_attention" for e in prof.events())


def test_prefill_rule_takes_the_blocked_kernel_into_empty_caches():
    """From 64 rows into empty caches without padding (decode_attention_kernel.cpp: prefill_takes_blocked_kernel)."""
    assert prefill_runs_blocked(64) and prefill_runs_blocked(100)
    assert not prefill_runs_blocked(63) and not prefill_runs_blocked(64, before=(0, 1))
    assert not prefill_runs_blocked(64, padded=True)


def test_prefill_setting_forces_each_kernel():
    code = ("import sys; sys.path.insert(0, %r); import torchmha, test_kv_cache as t; "
            "assert t.prefill_runs_blocked(1) and not t.prefill_runs_blocked(1, before=(0, 1))")
    run_python_with(code % str(Path(__file__).parent), set_env={"TORCHMHA_PREFILL_BLOCKED": "1"})
    code = "import sys; sys.path.insert(0, %r); import torchmha, test_kv_cache as t; assert not t.prefill_runs_blocked(100)"
    run_python_with(code % str(Path(__file__).parent), set_env={"TORCHMHA_PREFILL_BLOCKED": "0"})


def test_decode_kernel_setting_forces_the_composition():
    code = "import sys; sys.path.insert(0, %r); import torchmha, test_kv_cache as t; assert t.decode_runs_sdpa(1)"
    run_python_with(code % str(Path(__file__).parent), set_env={"TORCHMHA_DECODE_KERNEL_MAX_ROWS": "0"})


def composition_over_nan_capacity(device="cpu"):
    """A step of 40 rows through the ATen composition (dropout takes it; p = 1e-12 drops nothing in
    practice) into caches of capacity 128 that hold NaN: whether NaN reached the result (over the
    whole capacity with a mask, 0 * NaN does), and the result against SDPA's."""
    q = torch.randn(2, 2, 40, 8, device=device)
    k_cache, v_cache = (torch.full((2, 2, 128, 8), float("nan"), device=device) for _ in range(2))
    lengths = torch.tensor([0, 0], device=device)
    out = torch.ops.torchmha.decode_attention(q, q, q, k_cache, v_cache, lengths, None, None, 1e-12)
    return out.isnan().any().item(), out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_composition_reads_only_the_filled_prefix(device):
    """Eager, on every device, the ATen path attends over the filled positions only, so its cost
    follows what is filled, not the capacity: NaN in the unfilled positions cannot reach the result."""
    reached, out, expected = composition_over_nan_capacity(device)
    assert not reached
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_static_shapes_setting_attends_over_the_capacity():
    """TORCHMHA_DECODE_STATIC_SHAPES=1 (for CUDA graphs captured by hand) keeps the whole capacity,
    masked: the NaN there reaches the result."""
    code = ("import sys; sys.path.insert(0, %r); import torchmha, test_kv_cache as t; "
            "assert t.composition_over_nan_capacity()[0]")
    run_python_with(code % str(Path(__file__).parent), set_env={"TORCHMHA_DECODE_STATIC_SHAPES": "1"})


def test_reorder_moves_only_the_filled_prefix():
    """Beam search copies the filled positions only (its cost follows what is filled, not the
    capacity); the rest holds nothing a sequence reads and stays as it was."""
    cache = torchmha.KeyValueCache(3, 2, 8, 4)
    cache.lengths.copy_(torch.tensor([3, 1, 2]))
    cache.keys.copy_(torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 8, 4))
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.keys[:, :, :3, 0].tolist() == [[[2.0] * 3] * 2, [[2.0] * 3] * 2, [[0.0] * 3] * 2]
    assert (cache.keys[:, :, 3:] == torch.arange(3.0).view(3, 1, 1, 1)).all()
    assert cache.lengths.tolist() == [2, 2, 3]


def test_new_lengths_and_lengths_are_checked():
    _, ours = mha_pair(E, H)
    cache = torchmha.KeyValueCache.for_module(ours, N, 4)
    x = torch.randn(2, N, E, dtype=torch.float64)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"new_lengths\[1\] must be in \[0, 2\]"):
            ours.forward_with_cache(x, cache, new_lengths=torch.tensor([1, 3, 0]))
        with pytest.raises(RuntimeError, match=r"new_lengths must be a \(3,\) int64 tensor"):
            ours.forward_with_cache(x, cache, new_lengths=torch.tensor([1, 1]))
        ours.forward_with_cache(x, cache, new_lengths=torch.tensor([2, 0, 1]))
        with pytest.raises(RuntimeError, match="cache is full: sequence 0 holds 2 of its 4 positions and cannot take 3"):
            ours.forward_with_cache(torch.randn(3, N, E, dtype=torch.float64), cache, new_lengths=torch.tensor([3, 0, 0]))
        assert cache.lengths.tolist() == [2, 0, 1]
        with pytest.raises(RuntimeError, match=r"reorder: expected indices of shape \(3,\)"):
            cache.reorder(torch.tensor([0, 1]))


def test_compiled_mixed_length_decoding_compiles_once():
    """torch.compile(dynamic=True) of a batched step with per-sequence lengths: one graph for
    every step (the lengths are data, not shapes), with torch's numbers."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ref, ours = mha_pair(E, H)
    ref.eval(), ours.eval()
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def decode_step(query, cache, new_lengths):
        return ours.forward_with_cache(query, cache, new_lengths=new_lengths)

    seqs = Sequences(ref, N)
    seqs.cache = torchmha.KeyValueCache.for_module(ours, N, 12)
    frames = []
    with torch.no_grad():
        for t in range(8):
            new = [1, int(t % 2 == 0), 1]
            x = torch.randn(1, N, E, dtype=torch.float64)
            out = decode_step(x, seqs.cache, torch.tensor(new))
            frames.append(counter.frame_count)
            for i, count in enumerate(new):
                seqs.append(i, list(x[:count, i]))
                if count:
                    assert_close(out[:count, i], seqs.expected_last(i, count), torch.float64)
    assert seqs.cache.lengths.tolist() == [8, 4, 8]
    assert frames == [frames[0]] * 8, f"recompiled as the lengths changed: frames after each step {frames}"


def test_chunk_mask_is_bottom_right_aligned():
    """A chunk after a prefix must see the whole prefix (SDPA's top-left is_causal would not)."""
    ref, ours = mha_pair(E, H, seed=3)
    x = torch.randn(8, 2, E, dtype=torch.float64)
    expected = ref(x, x, x, attn_mask=causal_mask(8), need_weights=False)[0]
    cache = torchmha.KeyValueCache.for_module(ours, 2, 8)
    with torch.no_grad():
        ours.forward_with_cache(x[:5], cache)
        tail = ours.forward_with_cache(x[5:], cache)
    assert_close(tail, expected[5:])


def test_forward_is_unchanged_and_cache_holds_projected_keys():
    ref, ours = mha_pair(E, H)
    x = torch.randn(5, N, E, dtype=torch.float64)
    assert_close(ours(x, x, x)[0], ref(x, x, x)[0])
    cache = torchmha.KeyValueCache.for_module(ours, N, 8)
    with torch.no_grad():
        ours.forward_with_cache(x, cache)
    w_k, b_k = ours.in_proj_weight[E : 2 * E], ours.in_proj_bias[E : 2 * E]
    keys = (x @ w_k.T + b_k).view(5, N, H, E // H).permute(1, 2, 0, 3)
    assert_close(cache.keys[:, :, :5], keys)
    assert cache.keys[:, :, 5:].abs().sum() == 0  # untouched beyond length


# ---------------------------------------------------------------------- cache life cycle
def test_reset_and_reuse_for_a_new_batch():
    ref, ours = mha_pair(E, H, batch_first=True)
    cache = torchmha.KeyValueCache.for_module(ours, 2, L)
    storage = cache.keys.data_ptr()
    with torch.no_grad():
        for batch in (2, 2, 4):
            cache.reset(batch_size=batch)
            x = torch.randn(batch, L, E, dtype=torch.float64)
            expected = ref(x, x, x, attn_mask=causal_mask(L), need_weights=False)[0]
            assert_close(decode(ours, x, cache, 1, True), expected)
            if batch == 2:
                assert cache.keys.data_ptr() == storage  # same batch size: storage reused
    assert cache.batch_size == 4


def test_full_cache_and_wrong_batch_raise_clearly_and_leave_cache_unchanged():
    _, ours = mha_pair(E, H)
    cache = torchmha.KeyValueCache.for_module(ours, N, 4)
    with torch.no_grad():
        ours.forward_with_cache(torch.randn(3, N, E, dtype=torch.float64), cache)
        with pytest.raises(RuntimeError, match="cache is full: sequence 0 holds 3 of its 4 positions and cannot take 2 more"):
            ours.forward_with_cache(torch.randn(2, N, E, dtype=torch.float64), cache)
        assert cache.length == 3
        with pytest.raises(AssertionError, match=r"hold batches of 3, but query of shape \[1, 5, 16\] has batch size 5; reset the cache"):
            ours.forward_with_cache(torch.randn(1, 5, E, dtype=torch.float64), cache)
        assert cache.length == 3
        with pytest.raises(RuntimeError, match=r"key_padding_mask covers 1 cache positions, but sequence 0 fills 4"):
            ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache, torch.zeros(N, 1, dtype=torch.bool))
        with pytest.raises(AssertionError, match=r"key_padding_mask of shape \(3, S\) with S <= 4 .* but got \[3, 5\]"):
            ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache, torch.zeros(N, 5, dtype=torch.bool))
        with pytest.raises(RuntimeError, match=r"float masks must have the dtype of query \(Double\), but the masks given combine to Float"):
            ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache, torch.zeros(N, 4))
        assert cache.length == 3
        assert not cache.keys[:, :, 3:].any(), "a rejected step must not write into the cache"
    with pytest.raises(ValueError, match="greater than 0"):
        torchmha.KeyValueCache(0, H, 4, E // H)


def test_unsupported_options_are_rejected():
    mha = torchmha.MultiheadAttention(E, H, add_bias_kv=True)
    with pytest.raises(RuntimeError, match="add_bias_kv"):
        mha.forward_with_cache(torch.randn(1, 1, E), torchmha.KeyValueCache.for_module(mha, 1, 2))
    with pytest.raises(RuntimeError, match=r"needs kdim == vdim == embed_dim \(16\), but kdim is 5 and vdim 5"):
        cross = torchmha.MultiheadAttention(E, H, kdim=5, vdim=5)
        cross.forward_with_cache(torch.randn(1, 1, E), torchmha.KeyValueCache.for_module(cross, 1, 2))


def test_keys_split_into_other_heads_are_rejected():
    """H heads of E/H and 2H heads of E/(2H) hold the same features: the ops alone cannot tell
    them apart, so the module checks its own split instead of attending with the wrong heads."""
    mha = torchmha.MultiheadAttention(E, H)
    x = torch.randn(1, 1, E)
    message = rf"has keys of shape \[1, {2 * H}, 3, {E // H // 2}\] .* the module has {H} heads of size {E // H}"
    cache = torchmha.KeyValueCache(1, 2 * H, 3, E // H // 2)
    with torch.no_grad(), pytest.raises(AssertionError, match=message):
        mha.forward_with_cache(x, cache)
    assert cache.length == 0
    memory = torchmha.StaticKeyValue(torch.randn(1, 2 * H, 3, E // H // 2), torch.randn(1, 2 * H, 3, E // H // 2))
    with torch.no_grad(), pytest.raises(AssertionError, match="the projected memory"):
        mha.forward_with_cache(x, memory)


def test_cache_of_another_dtype_is_rejected_before_it_is_written():
    _, ours = mha_pair(E, H)  # float64
    cache = torchmha.KeyValueCache(N, H, 4, E // H, dtype=torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"cache must have query's dtype and device \(Double"):
        ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache)
    assert cache.length == 0 and not cache.keys.any()


def test_a_cache_of_the_cpp_classes_is_named_as_such():
    mha = torchmha.MultiheadAttention(E, H)
    cpp_cache = torchmha.cpp.KeyValueCache(1, H, 2, E // H)
    with pytest.raises(TypeError, match=r"not torchmha\._C\.cpp\.KeyValueCache \(the torchmha\.cpp classes"):
        mha.forward_with_cache(torch.randn(1, 1, E), cpp_cache)


def test_cached_op_rejects_projections_that_do_not_fit_the_cache():
    w = torch.randn(E, E)
    cache = dict(k_cache=torch.zeros(1, H, 4, E // H), v_cache=torch.zeros(1, H, 4, E // H), lengths=torch.zeros(1, dtype=torch.long), num_heads=H)
    step = dict(query=torch.randn(1, 1, E), out_proj_weight=w, out_proj_bias=None, in_proj_bias=None)
    with pytest.raises(AssertionError, match=r"expecting key weights shape of \(16, 16\), but got torch.Size\(\[8, 16\]\)"):
        torch.ops.torchmha.attention_with_cache(
            **cache, **step, in_proj_weight=None, q_proj_weight=w, k_proj_weight=w[:8], v_proj_weight=w)
    with pytest.raises(RuntimeError, match=r"in_proj_weight must have shape \(3 \* embed_dim, embed_dim\), but got \[32, 16\]"):
        torch.ops.torchmha.attention_with_cache(**cache, **step, in_proj_weight=torch.randn(2 * E, E))


# ------------------------------------------------------------------ cross-attention cache
@pytest.mark.parametrize("kdim", [None, 7])
def test_memory_projected_once_equals_cross_attention(kdim):
    ref, ours = mha_pair(E, H, kdim=kdim, vdim=kdim, batch_first=True)
    memory = torch.randn(N, 9, kdim or E, dtype=torch.float64)
    kpm = padding_mask(N, 9)
    memory_kv = ours.project_key_value(memory)
    assert memory_kv.keys.shape == (N, H, 9, E // H)
    x = torch.randn(N, L, E, dtype=torch.float64)
    expected = ref(x, memory, memory, key_padding_mask=kpm, need_weights=False)[0]
    steps = [ours.forward_with_cache(x[:, t : t + 1], memory_kv, kpm) for t in range(L)]
    assert_close(torch.cat(steps, 1), expected)


def attention_over_memory(q, keys, values, padding):
    """softmax(q k^T / sqrt(D) + padding) v in float64, zeros where every key is masked."""
    scores = q.double() @ keys.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    if padding is not None:
        scores = scores + padding.double()[:, None, None, :]
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ values.double()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,S", [(1, 1), (1, 64), (3, 17), (5, 64)])
def test_static_attention_op_equals_attention_over_the_memory(dtype, T, S):
    """The op over a fixed memory (the decode kernel's pass, nothing written): each row over every
    key, a padded sequence's masked keys left out, a wholly masked sequence zeros (as SDPA's CPU
    kernel gives); q read through its strides, as the projection leaves it."""
    q = torch.randn(N, T, H, 8, dtype=dtype).transpose(1, 2)  # (N, H, T, D), not contiguous
    keys, values = (torch.randn(N, H, S, 8, dtype=dtype) for _ in range(2))
    padding = torch.zeros(N, S, dtype=dtype)
    padding[0, : S // 2] = float("-inf")
    padding[1] = float("-inf")
    for mask in (padding, None):
        got = torch.ops.torchmha.static_attention(q, keys, values, mask)
        expected = attention_over_memory(q, keys, values, mask)
        if dtype in (torch.float64, torch.float32):
            assert_close(got.double(), expected, dtype)
        else:  # within twice torch's own error at this dtype (SDPA), and one rounding of the output
            sdpa = torch.nn.functional.scaled_dot_product_attention(q, keys, values, None if mask is None else mask[:, None, None])
            allowed = 2 * (sdpa.double() - expected).abs().max() + torch.finfo(dtype).eps * expected.abs().max()
            assert (got.double() - expected).abs().max() <= allowed
    assert not got.isnan().any() and (torch.ops.torchmha.static_attention(q, keys, values, padding)[1] == 0).all()


def test_a_step_whose_visible_keys_are_all_padded_gives_zeros_as_sdpa():
    """The cached step's kernel shares that rule: a sequence whose every visible cache position is
    padded gets zeros (it gave NaN), as SDPA's CPU kernel gives with the same mask; the other
    sequence is untouched."""
    q = torch.randn(2, H, 1, 8)
    cache = torch.randn(2, H, 6, 8)
    padding = torch.zeros(2, 6)
    padding[1] = float("-inf")
    lengths = torch.tensor([3, 3])
    got = torch.ops.torchmha.decode_attention(q, q, q, cache, cache.clone(), lengths, None, padding, 0.0)
    keys = cache.clone()
    keys[:, :, 3] = q[:, :, 0]
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys[:, :, :4], keys[:, :, :4], padding[:, None, None, :4])
    assert (got[1] == 0).all() and (expected[1] == 0).all()
    assert_close(got, expected, torch.float32)


def test_static_attention_has_no_derivative():
    """Like decode_attention: a backward through the op is torch's not-implemented error (the core
    takes SDPA where a gradient is recorded)."""
    q = torch.randn(1, H, 1, 8, requires_grad=True)
    out = torch.ops.torchmha.static_attention(q, torch.randn(1, H, 5, 8), torch.randn(1, H, 5, 8), None)
    with pytest.raises(RuntimeError, match="derivative for torchmha::static_attention is not implemented"):
        out.sum().backward()


def memory_runs_kernel(T, S, grad=False):
    """Whether a step of T rows over a memory of S positions runs torchmha::static_attention."""
    mha = torchmha.MultiheadAttention(E, H)
    with torch.no_grad():
        memory = mha.project_key_value(torch.randn(S, N, E))
    with torch.set_grad_enabled(grad), torch.profiler.profile() as prof:
        mha.forward_with_cache(torch.randn(T, N, E), memory)
    return any(e.name == "torchmha::static_attention" for e in prof.events())


def test_memory_rule_takes_the_kernel_for_few_rows_or_a_short_memory():
    """decode_attention_kernel.cpp: static_kernel_pays_off (up to 4 rows, or a memory of up to 64)."""
    assert memory_runs_kernel(1, 1024) and memory_runs_kernel(4, 200) and memory_runs_kernel(300, 64)
    assert not memory_runs_kernel(5, 65) and not memory_runs_kernel(1, 8, grad=True)


def test_memory_setting_forces_each_way():
    code = "import sys; sys.path.insert(0, %r); import torchmha, test_kv_cache as t; assert {}"
    run_python_with((code % str(Path(__file__).parent)).format("t.memory_runs_kernel(100, 100)"),
                    set_env={"TORCHMHA_STATIC_KERNEL": "1"})
    run_python_with((code % str(Path(__file__).parent)).format("not t.memory_runs_kernel(1, 8)"),
                    set_env={"TORCHMHA_STATIC_KERNEL": "0"})


def test_gradients_through_the_memory_step_equal_torch():
    """With gradients recorded the step takes SDPA (the kernel has no backward): torch's gradients."""
    ref, ours = mha_pair(E, H)
    memory, x = torch.randn(5, N, E, dtype=torch.float64), torch.randn(1, N, E, dtype=torch.float64)
    grads = []
    for module, out in ((ref, lambda: ref(x, memory, memory, need_weights=False)[0]),
                        (ours, lambda: ours.forward_with_cache(x, ours.project_key_value(memory)))):
        grads.append(torch.autograd.grad(out().pow(2).sum(), module.in_proj_weight)[0])
    assert grads[1].abs().sum() > 0
    assert_close(grads[1], grads[0], torch.float64)


# ------------------------------------------------------------------------------- compiled
def test_compiled_decoding_step_compiles_once_for_every_cache_length():
    """torch.compile(dynamic=True) of a cached step: the lengths are a tensor and no shape depends
    on them, and a padding mask that grows with the sequence stays symbolic, so after the first
    sizes (0 and 1 are specialised, as dynamo always does) every further step reuses one graph; the
    outputs still equal one causal forward of torch's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ref, ours = mha_pair(E, H)
    ours.eval()
    ref.eval()
    x = torch.randn(L, N, E, dtype=torch.float64)
    kpm = padding_mask(N, L)
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def step(query, cache, key_padding_mask):
        return ours.forward_with_cache(query, cache, key_padding_mask)

    # Room to spare: the step that fills a cache to the last position compiles once more (a
    # narrow over the whole length is specialised).
    cache = torchmha.KeyValueCache.for_module(ours, N, L + 4)
    frames = []
    with torch.no_grad():
        # A 3-token prefill (the causal mask is built), then one token at a time. The masks are
        # fresh contiguous tensors, as a decoding loop makes them.
        outputs = [step(x[:3], cache, kpm[:, :3].clone())]
        for t in range(3, L):
            outputs.append(step(x[t : t + 1], cache, kpm[:, : t + 1].clone()))
            frames.append(counter.frame_count)
        expected = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(L), need_weights=False)[0]
    assert_close(torch.cat(outputs), expected, torch.float64)
    assert cache.length == L
    assert frames[-1] == frames[2], f"recompiled as the cache grew: frames after each step {frames}"
    assert frames[-1] <= 3, frames


def test_cache_step_checks_both_caches_and_the_mask_kind_before_writing():
    _, ours = mha_pair(E, H)
    cache = torchmha.KeyValueCache.for_module(ours, N, 4)
    with torch.no_grad():
        cache.values = cache.values.float()  # keys float64, values float32
        with pytest.raises(RuntimeError, match=r"cache must have query's dtype and device \(Double, cpu\), but got Float"):
            ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache)
        assert cache.length == 0 and not cache.keys.any(), "a rejected step must not write into the cache"
        cache.values = cache.values.double()
        with pytest.raises(AssertionError, match="only bool and floating types of key_padding_mask are supported"):
            ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache, torch.zeros(N, 1, dtype=torch.int64))
        assert cache.length == 0 and not cache.keys.any()
