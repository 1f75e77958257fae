"""Reliability: a catalogue of malformed calls, a fuzz test mixing valid and invalid calls, numerics
at the edges, determinism and concurrent use. The rule everywhere: behave exactly like torch (same
result, or an exception of torch's type), never crash, never return a silently different number."""

import copy
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import torchmha
from conftest import TOLERANCE, mha_pair


def outcome(fn):
    """('ok', result) or ('error', exception type, message)."""
    try:
        return ("ok", fn())
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return ("error", type(error), str(error))


def flatten(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in flatten(r)]
    return [result]


def torch_fails_on_empty_reshape(expected):
    """torch cannot reshape an empty (0-element) padding mask ("-1 ... is ambiguous") and raises
    where the mask changes nothing; torchmha gives torch's answer without that empty mask
    (README, reliability)."""
    return expected[0] == "error" and "0 elements" in expected[2] and "ambiguous" in expected[2]


def assert_same_behaviour(ref_fn, our_fn, context="", ref_without_empty_masks=None):
    expected, got = outcome(ref_fn), outcome(our_fn)
    if ref_without_empty_masks is not None and torch_fails_on_empty_reshape(expected):
        expected = outcome(ref_without_empty_masks)
    if expected[0] == "error":
        assert got[0] == "error", f"torch raised {expected[1].__name__}: {expected[2]!r} but torchmha returned ({context})"
        assert issubclass(got[1], expected[1]), f"torch raised {expected[1].__name__}, torchmha {got[1].__name__}: {got[2]} ({context})"
        assert len(got[2]) > 15, f"unhelpful message {got[2]!r} ({context})"
        return got
    assert got[0] == "ok", f"torch succeeded but torchmha raised {got[1].__name__}: {got[2]} ({context})"
    for a, b in zip(flatten(got[1]), flatten(expected[1])):
        if isinstance(b, torch.Tensor):
            assert a is not None and a.shape == b.shape, context
            if b.is_meta or b.numel() == 0:
                continue
            tol = TOLERANCE.get(b.dtype, 1e-2)
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, equal_nan=True, msg=context)
        else:
            assert a == b, context
    return got


# ------------------------------------------------------------------------------- catalogue
E, H = 8, 2


def x3(L=4, N=2, e=E, **kw):
    return torch.randn(L, N, e, **kw)


def mha_calls():
    """name -> (constructor kwargs, args, kwargs) for MultiheadAttention.forward."""
    x, kv = x3(), x3(5)
    bool_ = torch.bool
    return {
        "query 4-D": ({}, (x[None],) * 3, {}),
        "query 1-D": ({}, (x[0, 0],) * 3, {}),
        "query 0-D": ({}, (torch.tensor(1.0),) * 3, {}),
        "key 2-D for 3-D query": ({}, (x, kv[:, 0], kv), {}),
        "value 4-D": ({}, (x, kv, kv[None]), {}),
        "query embedding 6 for embed_dim 8": ({}, (x3(e=6), kv, kv), {}),
        "key embedding 6 without kdim": ({}, (x, x3(5, e=6), x3(5, e=6)), {}),
        "key/value lengths differ": ({}, (x, kv, x3(6)), {}),
        "key batch differs from query": ({}, (x, x3(5, 3), x3(5, 3)), {}),
        "kdim mismatch": ({"kdim": 3, "vdim": 3}, (x, x3(5, e=4), x3(5, e=3)), {}),
        "vdim mismatch": ({"kdim": 3, "vdim": 5}, (x, x3(5, e=3), x3(5, e=4)), {}),
        "key/value batch differ (kdim)": ({"kdim": 3, "vdim": 5}, (x, x3(5, e=3), x3(5, 3, e=5)), {}),
        "attn_mask (L, L) for S != L": ({}, (x, kv, kv), {"attn_mask": torch.zeros(4, 4, dtype=bool_)}),
        "attn_mask 3-D wrong heads": ({}, (x, kv, kv), {"attn_mask": torch.zeros(2, 4, 5, dtype=bool_)}),
        "attn_mask 4-D": ({}, (x, kv, kv), {"attn_mask": torch.zeros(2, 2, 4, 5, dtype=bool_)}),
        "attn_mask 1-D": ({}, (x, kv, kv), {"attn_mask": torch.zeros(5, dtype=bool_)}),
        "attn_mask int32": ({}, (x, kv, kv), {"attn_mask": torch.zeros(4, 5, dtype=torch.int32)}),
        "attn_mask uint8": ({}, (x, kv, kv), {"attn_mask": torch.zeros(4, 5, dtype=torch.uint8)}),
        "key_padding_mask int64": ({}, (x, kv, kv), {"key_padding_mask": torch.zeros(2, 5, dtype=torch.int64)}),
        "key_padding_mask uint8": ({}, (x, kv, kv), {"key_padding_mask": torch.zeros(2, 5, dtype=torch.uint8)}),
        "key_padding_mask (N, L) for S != L": ({}, (x, kv, kv), {"key_padding_mask": torch.zeros(2, 4, dtype=bool_)}),
        "key_padding_mask batch 3": ({}, (x, kv, kv), {"key_padding_mask": torch.zeros(3, 5, dtype=bool_)}),
        "key_padding_mask 1-D for batched": ({}, (x, kv, kv), {"key_padding_mask": torch.zeros(5, dtype=bool_)}),
        "unbatched key_padding_mask 2-D": ({}, (x[:, 0], kv[:, 0], kv[:, 0]), {"key_padding_mask": torch.zeros(1, 5, dtype=bool_)}),
        "unbatched attn_mask 3-D wrong": ({}, (x[:, 0], kv[:, 0], kv[:, 0]), {"attn_mask": torch.zeros(1, 4, 5, dtype=bool_)}),
        "is_causal without attn_mask": ({}, (x, x, x), {"is_causal": True, "need_weights": False}),
        "float64 input, float32 parameters": ({}, (x.double(), kv.double(), kv.double()), {}),
        "float16 mask with float32 input": ({}, (x, kv, kv), {"attn_mask": torch.zeros(4, 5, dtype=torch.float16)}),
        "meta input, cpu parameters": ({}, (x.to("meta"),) * 3, {}),
        "NaN in query": ({}, (x.clone().index_fill_(0, torch.tensor([1]), float("nan")), kv, kv), {}),
        "Inf in key": ({}, (x, kv.clone().index_fill_(0, torch.tensor([2]), float("inf")), kv), {}),
        "empty batch N=0": ({}, (x3(4, 0), x3(5, 0), x3(5, 0)), {}),
        "empty target L=0": ({}, (x3(0), kv, kv), {"need_weights": False}),
        "empty source S=0": ({}, (x, x3(0), x3(0)), {"need_weights": False}),
        "non-contiguous query": ({}, (x3(2, 4).transpose(0, 1), kv, kv), {}),
        "expanded (stride 0) key": ({}, (x, torch.randn(1, 2, E).expand(5, 2, E), kv), {}),
        "batch_first with 2-D masks": ({"batch_first": True}, (x3(2, 4), x3(2, 5), x3(2, 5)),
                                       {"attn_mask": torch.zeros(4, 5, dtype=bool_)}),
        "add_bias_kv kpm wrong length": ({"add_bias_kv": True}, (x, kv, kv), {"key_padding_mask": torch.zeros(2, 6, dtype=bool_)}),
    }


@pytest.mark.parametrize("name", list(mha_calls()))
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_catalogue_multihead_attention(name, mode):
    config, args, kwargs = mha_calls()[name]
    ref, ours = mha_pair(E, H, dtype=torch.float32, **config)
    ref.train(mode == "train"), ours.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        assert_same_behaviour(lambda: ref(*args, **kwargs), lambda: ours(*args, **kwargs), name)


def construction_calls():
    return {
        "num_heads 0": dict(embed_dim=8, num_heads=0),
        "num_heads negative": dict(embed_dim=8, num_heads=-1),
        "embed_dim 0": dict(embed_dim=0, num_heads=1),
        "num_heads not dividing": dict(embed_dim=10, num_heads=4),
    }


@pytest.mark.parametrize("name", list(construction_calls()))
def test_catalogue_construction(name):
    kwargs = construction_calls()[name]
    assert_same_behaviour(lambda: torch.nn.MultiheadAttention(**kwargs), lambda: torchmha.MultiheadAttention(**kwargs), name)
    # The article's versions and the C++ classes raise the same type.
    expected = outcome(lambda: torch.nn.MultiheadAttention(**kwargs))[1]
    for make in (lambda: torchmha.MultiheadAttentionV2(**kwargs), lambda: torchmha.MultiheadAttentionV4(**kwargs),
                 lambda: torchmha.cpp.MultiheadAttention(**kwargs), lambda: torchmha.cpp.MultiheadAttentionV4(**kwargs)):
        with pytest.raises(expected):
            make()


def version_calls():
    """Bad calls of v1-v4 and the projections, with torch's equivalent call."""
    x, kv = x3(), x3(5)
    return {
        "v1 4-D input": (lambda m: m(x[None]), 1, {}),
        "v1 wrong embedding": (lambda m: m(x3(e=6)), 1, {}),
        "v2 mask wrong shape": (lambda m: m(x, torch.zeros(3, 3, dtype=torch.bool)), H, {}),
        "v2 mask int": (lambda m: m(x, torch.zeros(4, 4, dtype=torch.int64)), H, {}),
        "v3 key wrong kdim": (lambda m: m(x, x3(5, e=4), x3(5, e=5)), H, {"kdim": 3, "vdim": 5}),
        "v3 key/value lengths differ": (lambda m: m(x, x3(5, e=3), x3(6, e=5)), H, {"kdim": 3, "vdim": 5}),
        "v4 key/value lengths differ": (lambda m: m(x, kv, x3(6)), H, None),
        "v4 unbatched mixed with batched": (lambda m: m(x[:, 0], kv, kv), H, None),
    }


@pytest.mark.parametrize("name", list(version_calls()))
def test_catalogue_versions(name):
    call, heads, dims = version_calls()[name]
    ref = torch.nn.MultiheadAttention(E, heads, **(dims or {}))
    if dims is None:  # v4: packed
        ours = torchmha.MultiheadAttentionV4(E, heads)
        ref_call = lambda: call(lambda q, k, v, mask=None: ref(q, k, v, attn_mask=mask)[0])  # noqa: E731
    elif heads == 1:
        ours = torchmha.MultiheadAttentionV1(E)
        ref_call = lambda: call(lambda q: ref(q, q, q)[0])  # noqa: E731
    elif "v2" in name:
        ours = torchmha.MultiheadAttentionV2(E, heads)
        ref_call = lambda: call(lambda q, mask=None: ref(q, q, q, attn_mask=mask)[0])  # noqa: E731
    else:
        ours = torchmha.MultiheadAttentionV3(E, heads, **dims)
        ref_call = lambda: call(lambda q, k, v, mask=None: ref(q, k, v, attn_mask=mask)[0])  # noqa: E731
    got = outcome(lambda: call(ours))
    expected = outcome(ref_call)
    assert expected[0] == "error" and got[0] == "error", (expected, got)
    assert issubclass(got[1], expected[1]), (got, expected)


def projection_calls():
    q, kv = x3(), x3(5)
    w, b = torch.randn(3 * E, E), torch.randn(3 * E)
    return {
        "packed: weight (3E, E+1)": ((q, kv, kv, torch.randn(3 * E, E + 1), b), "packed"),
        "packed: bias too short": ((q, kv, kv, w, torch.randn(E)), "packed"),
        "packed: key embedding differs": ((q, x3(5, e=6), x3(5, e=6), w, b), "packed"),
        "separate: w_q wrong": ((q, kv, kv, torch.randn(E, E + 1), torch.randn(E, E), torch.randn(E, E)), "separate"),
        "separate: w_v wrong": ((q, kv, kv, torch.randn(E, E), torch.randn(E, E), torch.randn(E, 3)), "separate"),
        "separate: b_k wrong": ((q, kv, kv, torch.randn(E, E), torch.randn(E, E), torch.randn(E, E), None, torch.randn(3)), "separate"),
    }


@pytest.mark.parametrize("name", list(projection_calls()))
def test_catalogue_projections(name):
    args, kind = projection_calls()[name]
    ours = torchmha.in_projection_packed if kind == "packed" else torchmha.in_projection
    ref = F._in_projection_packed if kind == "packed" else F._in_projection
    got = outcome(lambda: ours(*args))
    expected = outcome(lambda: ref(*args))
    assert got[0] == "error", f"{name}: torchmha accepted it"
    if expected[0] == "error":
        assert issubclass(got[1], expected[1]), (got, expected)
    assert len(got[2]) > 15


def test_catalogue_has_at_least_forty_calls():
    total = len(mha_calls()) + len(construction_calls()) + len(version_calls()) + len(projection_calls())
    assert total >= 40, total


# ------------------------------------------------------------------------------------ fuzz
@st.composite
def fuzz_calls(draw):
    heads = draw(st.integers(1, 4))
    embed = heads * draw(st.integers(1, 4)) + draw(st.sampled_from([0, 0, 0, 1]))  # sometimes not divisible
    config = dict(batch_first=draw(st.booleans()), add_bias_kv=draw(st.booleans()), add_zero_attn=draw(st.booleans()))
    rank = draw(st.sampled_from([2, 3, 3, 3, 4]))
    N, L, S = draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(0, 4))
    e_q = embed + draw(st.sampled_from([0, 0, 0, 0, 1]))
    s_v = S + draw(st.sampled_from([0, 0, 0, 0, 1]))

    def shape(length, features, r=rank):
        base = {2: (length, features), 3: (N, length, features) if config["batch_first"] else (length, N, features),
                4: (1, length, N, features)}
        return base[r]

    kpm_kind = draw(st.sampled_from([None, "bool", "float", "int", "wrong"]))
    mask_kind = draw(st.sampled_from([None, "bool", "float", "int", "wrong", "3d"]))
    call = dict(need_weights=draw(st.booleans()), average_attn_weights=draw(st.booleans()),
                is_causal=draw(st.booleans()), mode=draw(st.sampled_from(["train", "inference"])))
    return heads, embed, config, dict(q=shape(L, e_q), k=shape(S, embed), v=shape(s_v, embed), N=N, L=L, S=S,
                                      rank=rank, kpm=kpm_kind, mask=mask_kind), call


def build_fuzz_mask(kind, shape):
    if kind is None:
        return None
    if kind == "bool":
        return torch.rand(shape) > 0.5
    if kind == "int":
        return torch.zeros(shape, dtype=torch.int64)
    if kind == "wrong":
        return torch.zeros(tuple(s + 1 for s in shape), dtype=torch.bool)
    return torch.randn(shape)


# Thousands of calls within CI's budget (a few ms each); TORCHMHA_HYPOTHESIS=long runs 20x more.
FUZZ_EXAMPLES = 20000 if os.environ.get("TORCHMHA_HYPOTHESIS") == "long" else 1000


@settings(max_examples=FUZZ_EXAMPLES)
@given(fuzz_calls())
def test_fuzz_valid_and_invalid_calls_behave_like_torch(case):
    heads, embed, config, shapes, call = case
    ref_ctor = outcome(lambda: torch.nn.MultiheadAttention(embed, heads, **config))
    if ref_ctor[0] == "error":
        with pytest.raises(ref_ctor[1]):
            torchmha.MultiheadAttention(embed, heads, **config)
        return
    ref, ours = mha_pair(embed, heads, dtype=torch.float32, **config)
    q, k, v = (torch.randn(shapes[n]) for n in ("q", "k", "v"))
    batched = shapes["rank"] == 3
    kpm = build_fuzz_mask(shapes["kpm"], (shapes["N"], shapes["S"]) if batched else (shapes["S"],))
    mask_shape = (max(shapes["N"], 1) * heads, shapes["L"], shapes["S"]) if shapes["mask"] == "3d" else (shapes["L"], shapes["S"])
    attn_mask = build_fuzz_mask("bool" if shapes["mask"] == "3d" else shapes["mask"], mask_shape)
    if kpm is not None and attn_mask is not None:
        kpm = kpm.float().masked_fill(kpm, float("-inf")) if kpm.dtype == torch.bool else kpm
        attn_mask = attn_mask.float().masked_fill(attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else attn_mask
    kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask, need_weights=call["need_weights"],
                  average_attn_weights=call["average_attn_weights"], is_causal=call["is_causal"])
    ref.train(call["mode"] == "train"), ours.train(call["mode"] == "train")
    unmasked = dict(kwargs, key_padding_mask=None, attn_mask=None, is_causal=False)
    with torch.set_grad_enabled(call["mode"] == "train"):
        assert_same_behaviour(lambda: ref(q, k, v, **kwargs), lambda: ours(q, k, v, **kwargs), f"{case}",
                              ref_without_empty_masks=lambda: ref(q, k, v, **unmasked))


# ------------------------------------------------------------------------- numerics at edges
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 3, 1), (5, 2, 1), (1, 2, 7)])
def test_single_query_or_key(need_weights, shape):
    L, N, S = shape
    ref, ours = mha_pair(8, 2)
    q, kv = torch.randn(L, N, 8, dtype=torch.float64), torch.randn(S, N, 8, dtype=torch.float64)
    assert_same_behaviour(lambda: ref(q, kv, kv, need_weights=need_weights),
                          lambda: ours(q, kv, kv, need_weights=need_weights))


@pytest.mark.parametrize("embed_dim,num_heads", [(4, 4), (1024, 1)])
def test_tiny_and_huge_head_dim(embed_dim, num_heads):
    ref, ours = mha_pair(embed_dim, num_heads)
    x = torch.randn(3, 2, embed_dim, dtype=torch.float64)
    for need_weights in (True, False):
        assert_same_behaviour(lambda: ref(x, x, x, need_weights=need_weights), lambda: ours(x, x, x, need_weights=need_weights))


@pytest.mark.parametrize("need_weights", [True, False])
def test_large_logits_stay_finite(need_weights):
    ref, ours = mha_pair(8, 2)
    x = 1e4 * torch.randn(6, 2, 8, dtype=torch.float64)
    got = assert_same_behaviour(lambda: ref(x, x, x, need_weights=need_weights), lambda: ours(x, x, x, need_weights=need_weights))
    assert torch.isfinite(got[1][0]).all()


def test_fully_masked_gradients_like_torch():
    """NaN in gradients exactly where torch has NaN (the NaN rows of the output), none elsewhere."""
    ref, ours = mha_pair(8, 2)
    x = torch.randn(4, 2, 8, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    kpm[1] = True
    grads = []
    for module in (ref, ours):
        for need_weights in (False, True):
            out = module(x, x, x, key_padding_mask=kpm, need_weights=need_weights)[0]
            (g,) = torch.autograd.grad(out.nan_to_num().sum(), [x])
            grads.append(g)
    assert torch.equal(grads[0].isnan(), grads[2].isnan()) and torch.equal(grads[1].isnan(), grads[3].isnan())
    torch.testing.assert_close(grads[2], grads[0], equal_nan=True)
    torch.testing.assert_close(grads[3], grads[1], equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16])
@pytest.mark.parametrize("need_weights", [True, False])
def test_low_precision_softmax_is_stable(dtype, need_weights):
    """Large scores in half precision: no overflow to inf/NaN, error within torch's own. (Not
    bfloat16: its float32 exponent range cannot overflow here, and at these scores its error bound
    is too wide to catch a bug; test_bfloat16_error_within_torchs_own covers it.)"""
    ref64, _ = mha_pair(32, 4)
    ref_low = copy.deepcopy(ref64).to(dtype)
    ours_low = torchmha.MultiheadAttention(32, 4, dtype=dtype)
    ours_low.load_state_dict(ref_low.state_dict())
    x = 30 * torch.randn(16, 2, 32, dtype=torch.float64)
    expected = ref64(x, x, x, need_weights=need_weights)[0]
    xl = x.to(dtype)
    ours_out = ours_low(xl, xl, xl, need_weights=need_weights)[0]
    assert torch.isfinite(ours_out).all()
    torch_error = (ref_low(xl, xl, xl, need_weights=need_weights)[0].double() - expected).abs().max().item()
    our_error = (ours_out.double() - expected).abs().max().item()
    assert our_error <= 2 * torch_error + 1e-2, (our_error, torch_error)


# ------------------------------------------------------------------------------ determinism
def test_repeated_calls_are_bitwise_identical():
    _, ours = mha_pair(16, 4, dtype=torch.float32)
    x = torch.randn(8, 3, 16)
    first = ours(x, x, x)
    for _ in range(3):
        again = ours(x, x, x)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


# ------------------------------------------------------------------------------ concurrency
def test_concurrent_forward_from_python_threads():
    _, ours = mha_pair(16, 4, dtype=torch.float32)
    inputs = [torch.randn(6, 2, 16) for _ in range(8)]
    serial = [ours(x, x, x)[0] for x in inputs]
    results = [None] * 8

    def work(i):
        for _ in range(5):
            results[i] = ours(inputs[i], inputs[i], inputs[i])[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(results, serial):
        assert torch.equal(a, b)


def test_concurrent_forward_backward_on_copies():
    _, base = mha_pair(16, 4, dtype=torch.float32)
    copies = [copy.deepcopy(base) for _ in range(8)]
    x = torch.randn(6, 2, 16)

    def grads_of(module):
        module.zero_grad()
        module(x, x, x)[0].square().sum().backward()
        return [p.grad.clone() for p in module.parameters()]

    expected = grads_of(copy.deepcopy(base))
    results = [None] * 8
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, grads_of(copies[i]))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for grads in results:
        for a, b in zip(grads, expected):
            assert torch.equal(a, b)
