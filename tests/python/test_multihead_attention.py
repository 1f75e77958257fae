"""torchmha.MultiheadAttention and replace_multihead_attention as drop-ins for torch's: the class adds
only its methods, checkpoints and copies, randomized parity over every option (torch's fast path
included), masks, dropout, weights, is_causal, torch's own Transformer with the swap, numerics at
the edges, determinism and concurrent use. Malformed calls are in test_bad_input.py."""

import copy
import io
import pickle
import threading
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchmha
from helpers import assert_close, assert_same_behaviour, mha_pair

CONFIGS = [
    dict(embed_dim=8, num_heads=2),
    dict(embed_dim=12, num_heads=3, bias=False),
    dict(embed_dim=8, num_heads=4, add_bias_kv=True, add_zero_attn=True),
    dict(embed_dim=6, num_heads=2, kdim=5, vdim=3, batch_first=True),
    dict(embed_dim=16, num_heads=8, dropout=0.1, batch_first=True),
]


# ------------------------------------------------------------------------------- construction
def test_class_adds_only_its_three_methods_to_torchs():
    """Constructor, parameters, state_dict, pickling, repr and to() are torch's own code, inherited:
    comparing them with torch's would compare torch with itself. What makes them ours to test is
    that the class overrides none of them. Defining anything else in the class (an __init__ or
    __setstate__, a state_dict, a class attribute) fails here, and needs its own tests against torch."""
    assert torchmha.MultiheadAttention.__bases__ == (torch.nn.MultiheadAttention,)
    class_metadata = {"__module__", "__qualname__", "__doc__", "__firstlineno__", "__static_attributes__"}
    assert set(vars(torchmha.MultiheadAttention)) - class_metadata == {"forward", "forward_with_cache", "project_key_value"}


@pytest.mark.parametrize("config", CONFIGS)
def test_torch_checkpoint_loads_and_runs(config):
    """torch's checkpoint in a fresh torchmha module computes torch's result with our forward."""
    ref, _ = mha_pair(**config)
    fresh_ours = torchmha.MultiheadAttention(**config, dtype=torch.float64)
    fresh_ours.load_state_dict(ref.state_dict(), strict=True)
    ref.eval(), fresh_ours.eval()
    def seq(length, features):  # (L, N, E) or (N, L, E)
        shape = (2, length, features) if config.get("batch_first") else (length, 2, features)
        return torch.randn(shape, dtype=torch.float64)

    q = seq(5, config["embed_dim"])
    k = seq(4, config.get("kdim") or config["embed_dim"])
    v = seq(4, config.get("vdim") or config["embed_dim"])
    expected = ref(q, k, v)[0]
    assert_close(fresh_ours(q, k, v)[0], expected)


def test_copies_and_pickles_compute_the_same():
    _, ours = mha_pair(8, 2, add_bias_kv=True)
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    expected = ours(x, x, x)[0]
    assert_close(copy.deepcopy(ours)(x, x, x)[0], expected)
    assert_close(pickle.loads(pickle.dumps(ours))(x, x, x)[0], expected)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is torchmha.MultiheadAttention
    assert_close(loaded(x, x, x)[0], expected)
    # An old pickle without _qkv_same_embed_dim (torch's __setstate__ fills it in) runs our forward.
    state = ours.__getstate__()
    del state["_qkv_same_embed_dim"]
    old = torchmha.MultiheadAttention.__new__(torchmha.MultiheadAttention)
    old.__setstate__(state)
    assert_close(old(x, x, x)[0], expected)


# ----------------------------------------------------------------------- randomized parity
@st.composite
def mha_cases(draw):
    head_dim = draw(st.sampled_from([1, 2, 3, 5, 8]))
    num_heads = draw(st.sampled_from([1, 2, 3, 4]))
    embed_dim = head_dim * num_heads
    config = dict(
        embed_dim=embed_dim,
        num_heads=num_heads,
        bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        batch_first=draw(st.booleans()),
    )
    if draw(st.booleans()):
        config["kdim"] = draw(st.integers(1, 9))
        config["vdim"] = draw(st.integers(1, 9))
    same_dims = config.get("kdim", embed_dim) == embed_dim and config.get("vdim", embed_dim) == embed_dim
    attention = draw(st.sampled_from(["self", "encoder_decoder", "general"] if same_dims else ["general"]))
    call = dict(
        batched=draw(st.booleans()),
        N=draw(st.integers(1, 3)),
        L=draw(st.integers(1, 6)),
        S=draw(st.integers(1, 7)),
        attention=attention,
        kpm=draw(st.sampled_from([None, "bool", "float"])),
        attn_mask=draw(st.sampled_from([None, "bool", "float", "bool3d", "float3d"])),
        need_weights=draw(st.booleans()),
        average_attn_weights=draw(st.booleans()),
        is_causal=draw(st.booleans()),
        mode=draw(st.sampled_from(["train", "eval", "inference"])),
    )
    if attention == "self" or call["is_causal"]:
        call["S"] = call["L"]
    return config, call


def build_inputs(config, call, dtype):
    E = config["embed_dim"]
    N, L, S, batched = call["N"], call["L"], call["S"], call["batched"]

    def seq(length, features):
        if not batched:
            shape = (length, features)
        else:
            shape = (N, length, features) if config["batch_first"] else (length, N, features)
        return torch.randn(shape, dtype=dtype, requires_grad=call["mode"] != "inference")

    query = seq(L, E)
    if call["attention"] == "self":
        key = value = query
    elif call["attention"] == "encoder_decoder":
        key = value = seq(S, E)
    else:
        key, value = seq(S, config.get("kdim", E)), seq(S, config.get("vdim", E))

    def mask(kind, shape):
        if kind is None:
            return None
        if kind.startswith("bool"):
            m = torch.rand(shape) > 0.7
            m[..., 0] = False  # no query loses every key (fully masked rows have their own test)
            return m
        return torch.randn(shape, dtype=dtype)

    kpm = mask(call["kpm"], (N, S) if batched else (S,))
    heads = (N if batched else 1) * config["num_heads"]
    attn_mask = None
    if call["is_causal"]:
        attn_mask = torch.ones(L, S, dtype=torch.bool).triu(1)
    elif call["attn_mask"] is not None:
        kind = call["attn_mask"]
        attn_mask = mask(kind.replace("3d", ""), (heads, L, S) if kind.endswith("3d") else (L, S))
    if kpm is not None and attn_mask is not None and kpm.dtype != attn_mask.dtype:
        attn_mask = attn_mask.float().masked_fill(attn_mask, float("-inf")).to(dtype) if attn_mask.dtype == torch.bool else attn_mask
        kpm = kpm.to(dtype).masked_fill(kpm, float("-inf")) if kpm.dtype == torch.bool else kpm
    kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask, need_weights=call["need_weights"],
                  average_attn_weights=call["average_attn_weights"], is_causal=call["is_causal"])
    return (query, key, value), kwargs


def run(module, inputs, kwargs, mode):
    module.train(mode == "train")
    with torch.set_grad_enabled(mode != "inference"):
        return module(*inputs, **kwargs)


def check_case(config, call, dtype):
    ref, ours = mha_pair(**config, dtype=dtype)
    inputs, kwargs = build_inputs(config, call, dtype)
    ref_out, ref_w = run(ref, inputs, kwargs, call["mode"])
    out, w = run(ours, inputs, kwargs, call["mode"])
    context = f"config={config} call={call}"
    assert_close(out, ref_out, dtype, context)
    if ref_w is None:
        assert w is None, context
    else:
        assert_close(w, ref_w, dtype, context)
    if call["mode"] == "inference":
        return
    upstream = torch.randn_like(ref_out)
    leaves = list({id(t): t for t in inputs}.values())
    ref_grads = torch.autograd.grad((ref_out * upstream).sum(), leaves + list(ref.parameters()), allow_unused=True)
    grads = torch.autograd.grad((out * upstream).sum(), leaves + list(ours.parameters()), allow_unused=True)
    names = [f"input{i}" for i in range(len(leaves))] + [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, grads, ref_grads):
        if b is None:
            assert a is None or not a.any(), f"{name}: {context}"
        else:
            assert_close(a, b, dtype, f"gradient of {name}: {context}")


@given(mha_cases())
def test_randomized_parity_float64(case):
    check_case(*case, torch.float64)


@given(mha_cases())
def test_randomized_parity_float32(case):
    check_case(*case, torch.float32)


@st.composite
def fast_path_cases(draw):
    """Calls that meet torch's fused-path conditions (inference, batch_first, self-attention, even
    heads, biases, no bias_kv / zero_attn), with every mask and flag combination on top."""
    num_heads = draw(st.sampled_from([2, 4]))
    config = dict(embed_dim=num_heads * draw(st.sampled_from([1, 2, 3, 8])), num_heads=num_heads, bias=True,
                  add_bias_kv=False, add_zero_attn=False, batch_first=True)
    call = dict(batched=True, N=draw(st.integers(1, 3)), L=draw(st.integers(1, 6)), S=0, attention="self",
                kpm=draw(st.sampled_from([None, "bool"])), attn_mask=draw(st.sampled_from([None, "bool", "bool3d"])),
                need_weights=draw(st.booleans()), average_attn_weights=draw(st.booleans()),
                is_causal=draw(st.booleans()), mode="inference")
    call["S"] = call["L"]
    return config, call


@given(fast_path_cases())
def test_randomized_parity_on_torchs_fast_path(case):
    check_case(*case, torch.float32)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_bfloat16_error_within_torchs_own(batch_first, need_weights):
    """Against a float64 reference, our bfloat16 error is at most about torch's bfloat16 error."""
    ref64, _ = mha_pair(64, 4, batch_first=batch_first, dtype=torch.float64)
    ref16 = copy.deepcopy(ref64).to(torch.bfloat16)
    ours16 = torchmha.MultiheadAttention(64, 4, batch_first=batch_first, dtype=torch.bfloat16)
    ours16.load_state_dict(ref16.state_dict())
    x = torch.randn(4, 32, 64, dtype=torch.float64)
    expected = ref64(x, x, x, need_weights=need_weights)[0]
    x16 = x.to(torch.bfloat16)
    torch_error = (ref16(x16, x16, x16, need_weights=need_weights)[0].double() - expected).abs().max().item()
    our_error = (ours16(x16, x16, x16, need_weights=need_weights)[0].double() - expected).abs().max().item()
    assert our_error <= 2 * torch_error + 1e-3, (our_error, torch_error)


@pytest.mark.parametrize("mode", ["train", "eval", "inference"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_fully_masked_rows_as_torch(mode, need_weights, batch_first):
    ref, ours = mha_pair(8, 2, batch_first=batch_first)
    x = torch.randn((3, 5, 8) if batch_first else (5, 3, 8), dtype=torch.float64)  # N=3, L=5
    kpm = torch.zeros(3, 5, dtype=torch.bool)
    kpm[1] = True  # every key of sample 1 is padding
    attn_mask = torch.zeros(5, 5, dtype=torch.bool)
    attn_mask[2] = True  # query 2 may attend nothing
    kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)
    ref_out, ref_w = run(ref, (x, x, x), kwargs, mode)
    out, w = run(ours, (x, x, x), kwargs, mode)
    assert torch.equal(out.isnan(), ref_out.isnan())
    assert_close(out, ref_out)
    if need_weights:
        assert_close(w, ref_w)


def test_dropout_in_training_only():
    ref, ours = mha_pair(16, 4, dropout=0.5)
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    ours.eval()
    ref.eval()
    assert_close(ours(x, x, x)[0], ref(x, x, x)[0])
    ours.train()
    torch.manual_seed(3)
    a, wa = ours(x, x, x)
    torch.manual_seed(3)
    b, wb = ours(x, x, x)
    assert torch.equal(a, b) and torch.equal(wa, wb), "dropout reproducible under a seed"
    assert not torch.allclose(a, ours.eval()(x, x, x)[0])
    # Same random stream as torch's need_weights path: identical dropout masks.
    ours.train(), ref.train()
    torch.manual_seed(4)
    expected = ref(x, x, x, average_attn_weights=False)
    torch.manual_seed(4)
    got = ours(x, x, x, average_attn_weights=False)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])


def test_need_weights_false_uses_sdpa_and_builds_no_weights():
    ref, ours = mha_pair(8, 2)
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    out, weights = ours(x, x, x, need_weights=False, average_attn_weights=False)
    assert weights is None
    with torch.profiler.profile() as prof:
        ours(x, x, x, need_weights=False)
    names = {e.name for e in prof.events()}
    assert any("scaled_dot_product" in n for n in names), names
    assert "aten::softmax" not in names and "aten::_softmax" not in names


def test_weights_shapes():
    _, ours = mha_pair(8, 2)
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    assert ours(x, x, x)[1].shape == (3, 5, 5)
    assert ours(x, x, x, average_attn_weights=False)[1].shape == (3, 2, 5, 5)
    assert ours(x[:, 0], x[:, 0], x[:, 0])[1].shape == (5, 5)
    assert ours(x[:, 0], x[:, 0], x[:, 0], average_attn_weights=False)[1].shape == (2, 5, 5)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_output_layout_is_torchs_so_a_later_dropout_draws_the_same_mask(batch_first, masked, need_weights):
    # torch's slow path returns batch_first output as a transposed view, its fused path a
    # contiguous tensor; nn.Dropout draws in memory order, so a different layout would drop
    # different elements under the same seed.
    ref, ours = mha_pair(8, 2, batch_first=batch_first)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    kwargs = {"need_weights": need_weights}
    if masked:
        kwargs["key_padding_mask"] = torch.rand(3 if batch_first else 5, 5 if batch_first else 3) > 0.7
    for mode in ("train", "eval", "inference"):
        expected, got = run(ref, (x, x, x), kwargs, mode)[0], run(ours, (x, x, x), kwargs, mode)[0]
        assert got.stride() == expected.stride(), (mode, got.stride(), expected.stride())
        torch.manual_seed(3)
        dropped_ref = torch.nn.functional.dropout(expected, 0.5)
        torch.manual_seed(3)
        dropped = torch.nn.functional.dropout(got, 0.5)
        assert torch.equal(dropped == 0, dropped_ref == 0), mode


def test_mismatched_mask_dtypes_warn_like_torch():
    ref, ours = mha_pair(8, 2)
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    attn_mask = torch.zeros(4, 4, dtype=torch.float64)
    for module in (ref, ours):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask)
        assert any("key_padding_mask" in str(w.message) and "attn_mask" in str(w.message) for w in caught)
        # A filter written against torch's text catches ours too.
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="Support for mismatched key_padding_mask and attn_mask")
            with pytest.raises(UserWarning):
                module(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask)


def test_is_causal_without_mask_is_rejected_like_torch():
    ref, ours = mha_pair(8, 2)
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    for module in (ref, ours):
        with pytest.raises(RuntimeError, match="attn_mask"):
            module(x, x, x, is_causal=True, need_weights=False)


def test_is_causal_does_not_read_the_mask_when_it_may_skip_it():
    """Without weights or padding mask, is_causal=True means causal attention (the mask is a hint)."""
    ref, ours = mha_pair(8, 2)
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    bogus = torch.zeros(4, 4, dtype=torch.bool)
    expected = ref(x, x, x, attn_mask=causal, need_weights=False)[0]
    assert_close(ours(x, x, x, attn_mask=bogus, need_weights=False, is_causal=True)[0], expected)
    assert_close(ref(x, x, x, attn_mask=bogus, need_weights=False, is_causal=True)[0], expected)


@pytest.mark.parametrize("mode", ["train", "eval", "inference"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_is_causal_hint_in_every_mode(mode, batch_first):
    """is_causal with its mask, no padding mask and no weights: in inference with batch_first torch
    takes its fused path, which reads the mask; elsewhere SDPA applies causality. Same numbers."""
    ref, ours = mha_pair(8, 2, batch_first=batch_first)
    x = torch.randn(3, 5, 8, dtype=torch.float64)  # N=3, L=5 or L=3, N=5
    L = x.shape[1] if batch_first else x.shape[0]
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    kwargs = dict(attn_mask=causal, is_causal=True, need_weights=False)
    expected = run(ref, (x, x, x), kwargs, mode)[0]
    assert_close(run(ours, (x, x, x), kwargs, mode)[0], expected)
    noncausal = run(ref, (x, x, x), dict(need_weights=False), mode)[0]
    assert not torch.allclose(expected, noncausal), "the mask must matter in this test"


# ------------------------------------------------------------------ torch's own Transformer
def transformer_models():
    kw = dict(dropout=0.0, dim_feedforward=32)
    return {
        "encoder": (torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, **kw), 2, enable_nested_tensor=False), 1),
        "decoder": (torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(16, 4, batch_first=True, **kw), 2), 2),
        "transformer": (torch.nn.Transformer(16, 4, 1, 1, batch_first=True, **kw), 2),
    }


@pytest.mark.parametrize("name", list(transformer_models()))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torch_transformers_unchanged_by_swap(name, mode):
    torch.manual_seed(0)
    model, n_inputs = transformer_models()[name]
    model = model.double().train(mode == "train")
    swapped = copy.deepcopy(model)
    count = torchmha.replace_multihead_attention(swapped)
    assert count == sum(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    assert all(type(m) is not torch.nn.MultiheadAttention for m in swapped.modules())
    assert swapped.training == model.training
    batch_first = name != "encoder"
    src = torch.randn(3, 7, 16, dtype=torch.float64) if batch_first else torch.randn(7, 3, 16, dtype=torch.float64)
    tgt = torch.randn(3, 5, 16, dtype=torch.float64)
    inputs = (src,) if n_inputs == 1 else ((tgt, src) if name == "decoder" else (src, tgt))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(inputs[-1].shape[1] if name == "transformer" else 5, dtype=torch.float64)
    kwargs = {"tgt_mask": causal, "tgt_is_causal": True} if name != "encoder" else {}
    expected = model(*inputs, **kwargs)
    got = swapped(*inputs, **kwargs)
    assert_close(got, expected)
    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    for (pname, a), b in zip(model.named_parameters(), swapped.parameters()):
        assert_close(b.grad, a.grad, msg=pname)


def test_replace_keeps_parameters_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model.attn = torch.nn.MultiheadAttention(8, 2)
    params_before = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert torchmha.replace_multihead_attention(model) == 1
    assert isinstance(model.attn, torchmha.MultiheadAttention)
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    x = torch.randn(4, 2, 8)
    before = model.attn.in_proj_weight.detach().clone()
    model.attn(x, x, x)[0].sum().backward()
    optimizer.step()
    assert not torch.equal(before, model.attn.in_proj_weight)
    assert torchmha.replace_multihead_attention(model) == 0, "already swapped"


class _Scaled(torch.nn.Module):
    """A parametrization: the stored tensor times 1.5."""

    def forward(self, x):
        return 1.5 * x


@pytest.mark.parametrize("config", [dict(add_bias_kv=True), dict(kdim=5, vdim=3)])
def test_parametrized_weights_are_read_as_torch_reads_them(config):
    """forward reads registered parameters from the module's dicts (nn.Module.__getattr__ is slow);
    a parametrized weight is a property instead and must still be the one used."""
    import torch.nn.utils.parametrize as parametrize

    ref, ours = mha_pair(8, 2, **config)
    for module in (ref, ours):
        names = ["q_proj_weight", "v_proj_weight"] if "kdim" in config else ["in_proj_weight", "bias_k"]
        for name in names:
            parametrize.register_parametrization(module, name, _Scaled())
        parametrize.register_parametrization(module.out_proj, "weight", _Scaled())
    query = torch.randn(4, 2, 8, dtype=torch.float64)
    key, value = (torch.randn(5, 2, size, dtype=torch.float64) for size in (ref.kdim, ref.vdim))
    expected, got = ref(query, key, value), ours(query, key, value)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])
    expected[0].sum().backward()
    got[0].sum().backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert_close(b.grad, a.grad, msg=name)


def test_functional_call_and_func_grad_use_the_given_parameters():
    """torch.func.functional_call swaps tensors into the module's _parameters for the call."""
    from torch.func import functional_call, grad

    ref, ours = mha_pair(8, 2)
    params = {name: 1.3 * p.detach() for name, p in ref.named_parameters()}
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    for got, expected in zip(functional_call(ours, params, (x, x, x)), functional_call(ref, params, (x, x, x))):
        assert_close(got, expected)
    grads = [grad(lambda p, m=m: functional_call(m, p, (x, x, x))[0].sum())(params) for m in (ref, ours)]
    for name in params:
        assert_close(grads[1][name], grads[0][name], msg=name)


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


@pytest.mark.parametrize("masks", ["bool attn_mask", "float attn_mask", "3-D attn_mask", "bool key_padding_mask",
                                   "float key_padding_mask", "both"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_cpu_autocast_with_masks_gives_torchs_dtype_within_its_error(masks, need_weights, mode):
    # Under autocast the projections are bfloat16 while masks stay as given; torch's ops cast them.
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ours = torchmha.MultiheadAttention(16, 2, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 16)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, -2:] = True
    kwargs = {
        "bool attn_mask": {"attn_mask": causal},
        "float attn_mask": {"attn_mask": torch.zeros(5, 5).masked_fill(causal, float("-inf"))},
        "3-D attn_mask": {"attn_mask": causal.expand(6, 5, 5)},
        "bool key_padding_mask": {"key_padding_mask": padding},
        "float key_padding_mask": {"key_padding_mask": torch.zeros(3, 5).masked_fill(padding, float("-inf"))},
        "both": {"attn_mask": causal, "key_padding_mask": padding},
    }[masks]
    outputs = {}
    for name, module in (("torch", ref), ("ours", ours)):
        module.train(mode == "train")
        full = module(x, x, x, need_weights=need_weights, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = module(x, x, x, need_weights=need_weights, **kwargs)
        outputs[name] = (full, low)
    (full, expected), (_, got) = outputs["torch"], outputs["ours"]
    for index in range(2 if need_weights else 1):
        assert got[index].dtype == expected[index].dtype, (index, got[index].dtype, expected[index].dtype)
        torch_error = (expected[index].float() - full[index]).abs().max().item()
        our_error = (got[index].float() - full[index]).abs().max().item()
        assert our_error <= 2 * torch_error + 1e-3, (index, our_error, torch_error)
    if not need_weights:
        assert got[1] is None and expected[1] is None


TORCHSCRIPT_CONFIGS = [{}, {"kdim": 5, "vdim": 3}, {"bias": False}, {"add_bias_kv": True}, {"add_zero_attn": True},
                       {"batch_first": True}, {"dropout": 0.1}]


@pytest.mark.parametrize("config", TORCHSCRIPT_CONFIGS)
def test_torchscript_script_trace_save_load_like_torch(config, tmp_path):
    ref, ours = mha_pair(8, 2, **config)
    ref.eval(), ours.eval()

    def shape(length, features):
        return (2, length, features) if config.get("batch_first") else (length, 2, features)

    q = torch.randn(shape(3, 8), dtype=torch.float64)
    k = torch.randn(shape(4, config.get("kdim", 8)), dtype=torch.float64)
    v = torch.randn(shape(4, config.get("vdim", 8)), dtype=torch.float64)
    mask = torch.rand(3, 4) > 0.8
    expected = ref(q, k, v, attn_mask=mask)
    scripted = torch.jit.script(ours)
    assert "torchmha::multi_head_attention_forward" in str(scripted.graph)
    torch.jit.save(scripted, tmp_path / "mha.pt")
    for module in (scripted, torch.jit.load(tmp_path / "mha.pt")):
        got = module(q, k, v, None, True, mask)
        assert_close(got[0], expected[0])
        assert_close(got[1], expected[1])
    traced = torch.jit.trace(ours, (q, k, v))  # tracing takes tensors only: no mask
    for got, want in zip(traced(q, k, v), ref(q, k, v)):
        assert_close(got, want)


@pytest.mark.parametrize("kind", ["Transformer", "TransformerEncoder", "TransformerDecoder"])
def test_torchscript_of_torch_transformers_after_replace(kind):
    torch.manual_seed(0)
    d, heads = 16, 2
    layer_args = dict(d_model=d, nhead=heads, dim_feedforward=32, dropout=0.0, dtype=torch.float64)
    model = {
        "Transformer": lambda: torch.nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **layer_args),
        "TransformerEncoder": lambda: torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**layer_args), 2,
                                                                  enable_nested_tensor=False),
        "TransformerDecoder": lambda: torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(**layer_args), 2),
    }[kind]().eval()
    src, tgt = torch.randn(5, 2, d, dtype=torch.float64), torch.randn(4, 2, d, dtype=torch.float64)
    inputs = {"Transformer": (src, tgt), "TransformerEncoder": (src,), "TransformerDecoder": (tgt, src)}[kind]
    expected = model(*inputs)
    assert torchmha.replace_multihead_attention(model) > 0
    scripted = torch.jit.script(model)
    assert_close(scripted(*inputs), expected)
    attention = next(m for name, m in scripted.named_modules() if name.endswith("self_attn"))
    assert "torchmha::multi_head_attention_forward" in attention.code or "torchmha.multi_head_attention_forward" in attention.code


def test_dropout_probability_is_checked_in_training_only_as_torch():
    ref, ours = mha_pair(8, 2, dropout=1.5)
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    ref.eval(), ours.eval()
    assert_close(ours(x, x, x)[0], ref(x, x, x)[0])
    ref.train(), ours.train()
    for module in (ref, ours):
        with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1, but got 1.5"):
            module(x, x, x)


def nested_sequences(embed=8):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype-API warning
        return torch.nested.nested_tensor([torch.randn(3, embed), torch.randn(5, embed)])


@pytest.mark.parametrize("need_weights", [False, True])
def test_nested_tensor_on_torchs_fast_path_as_torch(need_weights):
    ref, ours = mha_pair(8, 2, dtype=torch.float32, batch_first=True)
    ref.eval(), ours.eval()
    x = nested_sequences()
    with torch.inference_mode():
        expected, got = ref(x, x, x, need_weights=need_weights)[0], ours(x, x, x, need_weights=need_weights)[0]
    assert got.is_nested
    for a, b in zip(got.unbind(), expected.unbind()):
        assert_close(a, b)


@pytest.mark.parametrize("off_the_fast_path", ["training", "batch_first=False", "odd num_heads", "switched off", "mask"])
def test_nested_tensor_outside_the_fast_path_raises_torchs_error(off_the_fast_path):
    heads = 1 if off_the_fast_path == "odd num_heads" else 2
    ref, ours = mha_pair(8, heads, dtype=torch.float32, batch_first=off_the_fast_path != "batch_first=False")
    for m in (ref, ours):
        m.train(off_the_fast_path == "training")
    x = nested_sequences()
    mask = torch.zeros(2, 5, dtype=torch.bool) if off_the_fast_path == "mask" else None
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(off_the_fast_path != "switched off")
    try:
        with torch.no_grad():
            errors = []
            for m in (ref, ours):
                with pytest.raises(AssertionError) as error:
                    m(x, x, x, key_padding_mask=mask)
                errors.append(str(error.value))
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    assert errors[0].startswith("MultiheadAttention does not support NestedTensor outside of its fast path.")
    assert errors[1] == errors[0]


@pytest.mark.parametrize("batch_first, transposed_input", [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("training", [False, True])
def test_in_proj_bias_of_another_dtype_as_torch(batch_first, transposed_input, training):
    """torch's slow path hands at::linear the (L, N, E) layout, which promotes a half bias on a
    strided input and rejects it on a contiguous one: the same calls work and fail here."""
    ref, ours = mha_pair(4, 4, dtype=torch.float64, batch_first=batch_first)
    for m in (ref, ours):
        m.in_proj_bias = torch.nn.Parameter(ref.in_proj_bias.detach().half().double().half())
        m.train(training)
    query = torch.randn(3, 5, 4, dtype=torch.float64)
    query = query.transpose(0, 1) if transposed_input else query
    with torch.no_grad():
        assert_same_behaviour(lambda: ref(query, query, query), lambda: ours(query, query, query))


FAST_PATH_CASES = {
    "eval, batch_first, self-attention": dict(),
    "with a bool padding mask": dict(mask=True),
    "training": dict(training=True),
    "batch_first=False": dict(batch_first=False),
    "query is not key": dict(cross=True),
    "odd num_heads": dict(heads=1),
    "grad enabled, parameters require grad": dict(grad=True),
    "switched off": dict(switch=False),
    "float mask": dict(float_mask=True),
}


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("case", list(FAST_PATH_CASES))
def test_fused_kernel_runs_exactly_where_torchs_does(case, need_weights):
    """torch's tests mock torch._native_multi_head_attention in Python, which a call from C++ does
    not pass through; the profiler sees both. Where torch runs its fused kernel, torchmha runs a
    fused kernel too: torch's, or where it is faster with the same numbers, its own: the
    explicit-weights kernel when the weights are returned (CPU), SDPA without weights or masks."""
    c = FAST_PATH_CASES[case]
    ref, ours = mha_pair(8, c.get("heads", 2), dtype=torch.float32, batch_first=c.get("batch_first", True))
    x = torch.randn(2, 5, 8)
    key = torch.randn(2, 5, 8) if c.get("cross") else x
    masked = c.get("mask") or c.get("float_mask")
    mask = torch.zeros(2, 5, dtype=torch.float32 if c.get("float_mask") else torch.bool) if masked else None
    ran = []
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(c.get("switch", True))
    try:
        for m in (ref, ours):
            m.train(c.get("training", False))
            with torch.set_grad_enabled(c.get("grad", False)), torch.profiler.profile() as prof:
                m(x, key, key, key_padding_mask=mask, need_weights=need_weights)
            ran.append({e.name for e in prof.events()})
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    torch_fused, ours_fused = ("aten::_native_multi_head_attention" in names for names in ran)
    assert torch_fused == (case in ("eval, batch_first, self-attention", "with a bool padding mask"))
    if need_weights:
        assert not ours_fused
        assert not torch_fused or "torchmha::attention_with_weights" in ran[1], sorted(ran[1])
    else:
        assert ours_fused == (torch_fused and bool(masked)), f"torch fused: {torch_fused}, torchmha fused: {ours_fused}"


@pytest.mark.parametrize("need_weights", [False, True])
def test_no_bias_stays_off_the_fused_path_as_torch(need_weights):
    """torch's fused path needs in_proj_bias (found by the fuzzer: without it the fused call read a
    missing bias)."""
    ref, ours = mha_pair(8, 2, dtype=torch.float32, batch_first=True, bias=False)
    ref.eval(), ours.eval()
    x = torch.randn(2, 5, 8)
    mask = torch.rand(2, 5) > 0.7
    mask[:, 0] = False
    with torch.no_grad():
        assert_same_behaviour(lambda: ref(x, x, x, key_padding_mask=mask, need_weights=need_weights),
                              lambda: ours(x, x, x, key_padding_mask=mask, need_weights=need_weights))
