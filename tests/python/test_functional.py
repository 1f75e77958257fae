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
    with pytest.raises(NotImplementedError):
        torchmha.multi_head_attention_forward(*args, **kwargs, static_k=k)
