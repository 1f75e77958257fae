"""The bad-input catalogue: malformed calls (and valid calls at the edges) of every public entry
point, and a fuzz test mixing valid and invalid calls. The rule everywhere: behave exactly like
torch (same result, or an exception of torch's type with a message that says what is wrong), never
crash, never return a silently different number. Decoding errors are in test_kv_cache.py; good
and bad calls of the C++ classes are compared with the Python classes' in test_cpp.py."""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import torchmha
from helpers import assert_same_behaviour, mha_pair, outcome


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
        # (from the former catalogue of test_multihead_attention.py)
        "attn_mask 3-D for 3 of 4 heads": ({}, (x, kv, kv), {"attn_mask": torch.zeros(3, 4, 5, dtype=bool_)}),
        "attn_mask 4-D (1, N*H, L, S)": ({}, (x, kv, kv), {"attn_mask": torch.zeros(1, 4, 4, 5, dtype=bool_)}),
        "attn_mask int64": ({}, (x, kv, kv), {"attn_mask": torch.zeros(4, 5, dtype=torch.int64)}),
        "key_padding_mask 3-D": ({}, (x, kv, kv), {"key_padding_mask": torch.zeros(2, 5, 1, dtype=bool_)}),
        "is_causal without attn_mask, need_weights": ({}, (x, x, x), {"is_causal": True}),
        "float64 self-attention, float32 parameters": ({}, (x.double(),) * 3, {}),
        "unbatched attn_mask 3-D for 3 heads": ({}, (x[:, 0],) * 3, {"attn_mask": torch.zeros(3, 4, 4, dtype=bool_)}),
    }


# The calls of mha_calls that torch accepts; torch rejects every other one.
VALID_EDGE_CALLS = {
    "NaN in query", "Inf in key", "empty batch N=0", "empty target L=0", "empty source S=0", "non-contiguous query",
    "expanded (stride 0) key", "batch_first with 2-D masks",
}


# Where torch's error comes from inside an ATen op (not from a check of its own), torchmha checks
# first and says what is wrong in its own words; everywhere else the first line is torch's.
TORCH_FAILS_INSIDE_AN_OP = {
    "key batch differs from query", "float64 input, float32 parameters", "float64 self-attention, float32 parameters",
    "float16 mask with float32 input", "meta input, cpu parameters",
}


def functional_call(fn, m, query, key, value, **kwargs):
    """The module's call written as a call of the functional forward `fn` (the layout (L, N, E))."""
    separate = not m._qkv_same_embed_dim
    return fn(query, key, value, m.embed_dim, m.num_heads, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v,
              m.add_zero_attn, m.dropout, m.out_proj.weight, m.out_proj.bias, training=m.training,
              use_separate_proj_weight=separate, q_proj_weight=m.q_proj_weight, k_proj_weight=m.k_proj_weight,
              v_proj_weight=m.v_proj_weight, **kwargs)


def first_line(message):
    return message.splitlines()[0] if message else ""


def in_layout(call, layout):
    """The call in another module mode: batch_first (3-D inputs transposed), or torch's fused
    path (batch_first, eval, query is key is value)."""
    config, args, kwargs = call
    if layout == "seq_first" or config.get("batch_first"):
        return config, args, kwargs
    args = tuple(a.transpose(0, 1) if a.dim() == 3 else a for a in args)
    if layout == "fused":
        args = (args[0],) * 3
    return dict(config, batch_first=True), args, kwargs


@pytest.mark.parametrize("name", list(mha_calls()))
@pytest.mark.parametrize("mode", ["train", "inference", "batch_first", "fused"])
def test_catalogue_multihead_attention(name, mode):
    config, args, kwargs = in_layout(mha_calls()[name], {"batch_first": "batch_first", "fused": "fused"}.get(mode, "seq_first"))
    ref, ours = mha_pair(E, H, dtype=torch.float32, **config)
    training = mode == "train"
    ref.train(training), ours.train(training)
    with torch.set_grad_enabled(training):
        got = assert_same_behaviour(lambda: ref(*args, **kwargs), lambda: ours(*args, **kwargs), name)
        expected = outcome(lambda: ref(*args, **kwargs))
    if mode == "inference" and not config.get("batch_first"):  # the same call, functional
        expected_f = outcome(lambda: functional_call(F.multi_head_attention_forward, ref, *args, **kwargs))
        got_f = outcome(lambda: functional_call(torchmha.functional.multi_head_attention_forward, ours, *args, **kwargs))
        assert got_f[0] == expected_f[0] and (got_f[0] == "ok" or issubclass(got_f[1], expected_f[1])), (got_f, expected_f)
        if got_f[0] == "error" and name not in TORCH_FAILS_INSIDE_AN_OP:
            assert first_line(got_f[2]) == first_line(expected_f[2]), f"{name}: torch says {expected_f[2]!r}, torchmha {got_f[2]!r}"
    # assert_same_behaviour: torchmha raised if and only if torch did, an exception of torch's type.
    if mode != "fused":  # (there query is key is value, which makes some of these calls valid)
        assert (got[0] == "ok") == (name in VALID_EDGE_CALLS), f"{name}: VALID_EDGE_CALLS is wrong about it"
    if got[0] == "error" and name not in TORCH_FAILS_INSIDE_AN_OP:
        assert first_line(got[2]) == first_line(expected[2]), f"{name}: torch says {expected[2]!r}, torchmha {got[2]!r}"


def test_messages_add_the_shapes_after_torchs_first_line():
    """Where torch's message leaves out the argument's shape, torchmha adds it on a second line."""
    ours = torchmha.MultiheadAttention(E, 2)
    x = torch.randn(4, 2, E)
    with pytest.raises(AssertionError, match=r"^Expected key_padded_mask.shape\[1\] to be 4, but got 3\n.*key_padding_mask of shape \[2, 3\]"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(AssertionError, match=r"^was expecting embedding dimension of 8, but got 6\n.*query of shape \[4, 2, 6\]"):
        ours(torch.randn(4, 2, 6), x, x)
    with pytest.raises(AssertionError, match=r"^only bool and floating types of attn_mask are supported\n.*dtype Int and shape \[4, 4\]"):
        ours(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int32))


def construction_calls():
    """Sizes torch.nn.MultiheadAttention rejects. torchmha.MultiheadAttention runs torch's own
    constructor (test_multihead_attention.py checks it adds none), so the article's versions and
    the C++ classes, which check the sizes in the C++ core, are the ones compared with torch."""
    return {
        "num_heads 0": dict(embed_dim=8, num_heads=0),
        "num_heads negative": dict(embed_dim=8, num_heads=-1),
        "num_heads -2": dict(embed_dim=8, num_heads=-2),
        "embed_dim 0": dict(embed_dim=0, num_heads=1),
        "num_heads not dividing": dict(embed_dim=10, num_heads=4),
        "num_heads 3 not dividing 10": dict(embed_dim=10, num_heads=3),
    }


@pytest.mark.parametrize("name", list(construction_calls()))
def test_catalogue_construction(name):
    kwargs = construction_calls()[name]
    expected = outcome(lambda: torch.nn.MultiheadAttention(**kwargs))
    assert expected[0] == "error", f"torch accepts {kwargs}"
    for make in (torchmha.MultiheadAttentionV2, torchmha.MultiheadAttentionV3, torchmha.MultiheadAttentionV4,
                 torchmha.cpp.MultiheadAttention, torchmha.cpp.MultiheadAttentionV2, torchmha.cpp.MultiheadAttentionV3,
                 torchmha.cpp.MultiheadAttentionV4):
        got = outcome(lambda: make(**kwargs))
        assert got[0] == "error", f"{make.__name__}({kwargs}) accepted"
        assert issubclass(got[1], expected[1]), f"{make.__name__}: {got[1].__name__}: {got[2]}, torch {expected[1].__name__}"
        assert first_line(got[2]) == first_line(expected[2]), f"{make.__name__}: {got[2]!r}, torch {expected[2]!r}"


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
    if expected[1] is AssertionError:  # torch's own check (its RuntimeErrors come from inside linear)
        assert first_line(got[2]) == first_line(expected[2]), (got, expected)
    assert len(got[2]) > 15


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


# Thousands of calls within CI's budget (a few ms each); TORCHMHA_HYPOTHESIS=long runs 20x more,
# TORCHMHA_HYPOTHESIS=dev (make check) 10x fewer.
FUZZ_EXAMPLES = {"long": 20000, "dev": 100}.get(os.environ.get("TORCHMHA_HYPOTHESIS", "ci"), 1000)


@settings(max_examples=FUZZ_EXAMPLES)
@given(fuzz_calls())
def test_fuzz_valid_and_invalid_calls_behave_like_torch(case):
    heads, embed, config, shapes, call = case
    ref_ctor = outcome(lambda: torch.nn.MultiheadAttention(embed, heads, **config))
    if ref_ctor[0] == "error":
        # torchmha.MultiheadAttention's constructor is torch's; the core's size check is v4's.
        with pytest.raises(ref_ctor[1]):
            torchmha.MultiheadAttentionV4(embed, heads)
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


# ------------------------------------------------------------------- every path to Python
def _raised(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return type(error)
    return None


@pytest.mark.parametrize("path", ["torch.ops", "C++ binding", "torch.compile"])
def test_an_argument_error_reaches_python_as_torchs_type_on_every_path(path):
    """A malformed call raises torch's exception type whichever way it reaches the core: through
    torch.ops (where torch 2.15 turns a plain c10::Error into RuntimeError), this extension's own
    bindings, and a compiled module (errors at trace time)."""
    ref, ours = mha_pair(E, H, dtype=torch.float32)
    x = x3()[None]  # 4-D query: AssertionError in torch
    if path == "C++ binding":
        ours = torchmha.cpp.MultiheadAttention(E, H).forward
    elif path == "torch.compile":
        torch._dynamo.reset()
        ref, ours = torch.compile(ref, backend="eager"), torch.compile(ours, backend="eager")
    expected = _raised(lambda: ref(x, x, x))  # compiled: the type dynamo wraps it in
    assert expected is not None and (path == "torch.compile" or issubclass(expected, AssertionError)), expected
    assert _raised(lambda: ours(x, x, x)) is expected
