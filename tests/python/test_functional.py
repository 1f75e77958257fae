"""torchmha's functional API (in_projection_packed, in_projection, multi_head_attention_forward)
against torch.nn.functional's. Their malformed calls are in test_bad_input.py."""

import pytest
import torch
import torch.nn.functional as F

import torchmha
from helpers import assert_close, mha_pair


# ------------------------------------------------------------------------------ in-projections
@pytest.mark.parametrize("case", ["self", "encoder_decoder", "general"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_in_projection_packed_matches_torch(case, with_bias):
    E = 6
    w = torch.randn(3 * E, E, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3 * E, dtype=torch.float64, requires_grad=True) if with_bias else None
    q = torch.randn(4, 2, E, dtype=torch.float64)
    if case == "self":
        k = v = q
    elif case == "encoder_decoder":
        k = v = torch.randn(5, 2, E, dtype=torch.float64)
    else:
        k, v = torch.randn(5, 2, E, dtype=torch.float64), torch.randn(5, 2, E, dtype=torch.float64)
    ours = torchmha.in_projection_packed(q, k, v, w, b)
    ref = F._in_projection_packed(q, k, v, w, b)
    assert isinstance(ours, tuple) and len(ours) == 3
    for a, r in zip(ours, ref):
        assert_close(a, r)
    grads = torch.autograd.grad(sum((t * (i + 1)).sum() for i, t in enumerate(ours)), [w])
    ref_grads = torch.autograd.grad(sum((t * (i + 1)).sum() for i, t in enumerate(ref)), [w])
    assert_close(grads[0], ref_grads[0])


def test_in_projection_packed_decides_by_identity_not_value():
    """Equal values in different tensors take the general path; results are the same."""
    E = 4
    w, b = torch.randn(3 * E, E), torch.randn(3 * E)
    q = torch.randn(3, 1, E)
    same_values = q.clone()
    for a, r in zip(torchmha.in_projection_packed(q, same_values, q, w, b), F._in_projection_packed(q, same_values, q, w, b)):
        assert_close(a, r)


def test_in_projection_matches_torch_and_checks_shapes():
    q, k, v = torch.randn(3, 8), torch.randn(5, 3), torch.randn(5, 7)
    w_q, w_k, w_v = torch.randn(8, 8), torch.randn(8, 3), torch.randn(8, 7)
    b = [torch.randn(8) for _ in range(3)]
    for a, r in zip(torchmha.in_projection(q, k, v, w_q, w_k, w_v, *b), F._in_projection(q, k, v, w_q, w_k, w_v, *b)):
        assert_close(a, r)
    with pytest.raises(AssertionError, match=r"key weight.*\(8, 3\).*\[8, 4\]"):
        torchmha.in_projection(q, k, v, w_q, torch.randn(8, 4), w_v)
    with pytest.raises(AssertionError, match=r"value bias"):
        torchmha.in_projection(q, k, v, w_q, w_k, w_v, b[0], b[1], torch.randn(3))


# ------------------------------------------------------------------ multi_head_attention_forward
def test_functional_api_matches_torch():
    ref, ours = mha_pair(8, 2, kdim=3, vdim=5)
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    k = torch.randn(6, 2, 3, dtype=torch.float64)
    v = torch.randn(6, 2, 5, dtype=torch.float64)
    args = (q, k, v, 8, 2, None, ref.in_proj_bias, None, None, False, 0.0, ref.out_proj.weight, ref.out_proj.bias)
    kwargs = dict(training=False, use_separate_proj_weight=True, q_proj_weight=ref.q_proj_weight,
                  k_proj_weight=ref.k_proj_weight, v_proj_weight=ref.v_proj_weight)
    expected = torch.nn.functional.multi_head_attention_forward(*args, **kwargs)
    got = torchmha.multi_head_attention_forward(*args, **kwargs)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])


@pytest.mark.parametrize("statics", ["static_k", "static_v", "both"])
@pytest.mark.parametrize("extras", ["none", "add_zero_attn", "key_padding_mask", "attn_mask"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_static_keys_and_values_as_torch(statics, extras, need_weights):
    N, H, D, L, S, S_static = 2, 2, 4, 3, 5, 5
    E = H * D
    ref, _ = mha_pair(E, H)
    f64 = dict(dtype=torch.float64)
    q, kv = torch.randn(L, N, E, **f64), torch.randn(S, N, E, **f64)
    static = {"static_k": torch.randn(N * H, S_static, D, **f64), "static_v": torch.randn(N * H, S_static, D, **f64)}
    if statics != "both":
        static = {statics: static[statics]}
    kwargs = dict(training=False, need_weights=need_weights, **static)
    add_zero_attn = extras == "add_zero_attn"
    if extras == "key_padding_mask":
        kwargs["key_padding_mask"] = torch.rand(N, S_static) > 0.7
    if extras == "attn_mask":
        kwargs["attn_mask"] = torch.rand(L, S) > 0.7
    args = (q, kv, kv, E, H, ref.in_proj_weight, ref.in_proj_bias, None, None, add_zero_attn, 0.0,
            ref.out_proj.weight, ref.out_proj.bias)
    expected = torch.nn.functional.multi_head_attention_forward(*args, **kwargs)
    got = torchmha.multi_head_attention_forward(*args, **kwargs)
    assert_close(got[0], expected[0])
    if need_weights:
        assert_close(got[1], expected[1])


@pytest.mark.parametrize("fault", ["static_k batch", "static_k head_dim", "static_v batch", "static_v head_dim",
                                   "static_k with bias_k", "static_v with bias_v"])
def test_static_keys_and_values_bad_input_as_torch(fault):
    N, H, D, L, S = 2, 2, 4, 3, 5
    E = H * D
    ref, _ = mha_pair(E, H, add_bias_kv=fault.endswith("bias_k") or fault.endswith("bias_v"))
    q = torch.randn(L, N, E, dtype=torch.float64)
    name = fault.split()[0]
    shape = {"batch": (N * H + 1, S, D), "head_dim": (N * H, S, D + 1)}.get(fault.split()[1], (N * H, S, D))
    kwargs = {name: torch.randn(shape, dtype=torch.float64), "training": False}
    args = (q, q, q, E, H, ref.in_proj_weight, ref.in_proj_bias, ref.bias_k, ref.bias_v, False, 0.0,
            ref.out_proj.weight, ref.out_proj.bias)
    with pytest.raises(AssertionError) as expected:
        torch.nn.functional.multi_head_attention_forward(*args, **kwargs)
    with pytest.raises(AssertionError) as got:
        torchmha.multi_head_attention_forward(*args, **kwargs)
    assert str(got.value) == str(expected.value)


def test_static_keys_of_an_empty_batch_as_torch():
    H, D, E = 2, 4, 8
    ref, _ = mha_pair(E, H)
    q, kv = torch.randn(3, 0, E, dtype=torch.float64), torch.randn(5, 0, E, dtype=torch.float64)
    static = torch.randn(0, 5, D, dtype=torch.float64)
    args = (q, kv, kv, E, H, ref.in_proj_weight, ref.in_proj_bias, None, None, False, 0.0,
            ref.out_proj.weight, ref.out_proj.bias)
    kwargs = dict(training=False, need_weights=False, static_k=static, static_v=static)
    expected = torch.nn.functional.multi_head_attention_forward(*args, **kwargs)[0]
    got = torchmha.multi_head_attention_forward(*args, **kwargs)[0]
    assert got.shape == expected.shape == (3, 0, E)
