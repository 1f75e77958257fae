"""torchmha.CrossAttention (the article's cross-attention): a plain-torch reference, the default
context, the projected context reused, gradients, dropout and the mask's type."""

import pytest
import torch

import torchmha
from helpers import assert_close


def cross_attention_reference(m, x, context, keep):
    """The intended computation, in plain torch."""
    heads, d = m.heads, m.dim_head
    q, k, v = x @ m.to_q.weight.T, context @ m.to_k.weight.T, context @ m.to_v.weight.T
    q, k, v = (t.unflatten(-1, (heads, d)).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) * d**-0.5
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
    return out @ m.to_out.weight.T + m.to_out.bias


def test_cross_attention_own_inner_width_matches_reference():
    m = torchmha.CrossAttention(12, context_dim=6, heads=3, dim_head=5, dtype=torch.float64)
    assert m.to_q.weight.shape == (15, 12) and m.to_out.weight.shape == (12, 15) and m.to_k.bias is None
    x, context = torch.randn(2, 7, 12, dtype=torch.float64), torch.randn(2, 9, 6, dtype=torch.float64)
    keep = torch.rand(2, 9) > 0.3
    keep[:, 0] = True
    assert_close(m(x, context, keep), cross_attention_reference(m, x, context, keep))
    assert_close(m(x, context), cross_attention_reference(m, x, context, None))
    # mask True = keep: the opposite convention gives another result.
    assert not torch.allclose(m(x, context, keep), m(x, context, ~keep | ~keep.any(1, keepdim=True)))


def test_cross_attention_context_defaults_to_input_and_cache_reuses_it():
    m = torchmha.CrossAttention(10, heads=2, dim_head=8, dtype=torch.float64)
    x = torch.randn(3, 5, 10, dtype=torch.float64)
    assert_close(m(x), cross_attention_reference(m, x, x, None))
    context = torch.randn(3, 4, 10, dtype=torch.float64)
    cached = m.project_context(context)
    for t in range(5):
        assert_close(m.forward_with_cache(x[:, t : t + 1], cached), m(x[:, t : t + 1], context))


def test_cross_attention_gradients_and_dropout():
    m = torchmha.CrossAttention(4, context_dim=3, heads=2, dim_head=3, dtype=torch.float64)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    context = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: m(a, c), (x, context))
    with_dropout = torchmha.CrossAttention(8, heads=2, dim_head=4, dropout=0.5)
    y = torch.randn(2, 6, 8)
    assert not torch.equal(with_dropout(y), with_dropout(y))
    with_dropout.eval()
    assert torch.equal(with_dropout(y), with_dropout(y))


def test_cross_attention_rejects_non_bool_mask():
    m = torchmha.CrossAttention(8, heads=2, dim_head=4)
    with pytest.raises(AssertionError, match="bool"):
        m(torch.randn(1, 2, 8), mask=torch.ones(1, 2))


def test_cross_attention_cache_step_needs_the_projected_context():
    attn = torchmha.CrossAttention(8, heads=2, dim_head=4)
    with pytest.raises(TypeError, match=r"project_context\(context\), not Tensor"):
        attn.forward_with_cache(torch.randn(1, 2, 8), torch.randn(1, 3, 8))
