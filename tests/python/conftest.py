"""Shared helpers: torch reference modules with copied weights, and dtype tolerances."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import torchmha

# Hypothesis budgets: "ci" keeps the whole suite within minutes on 2 cores; TORCHMHA_HYPOTHESIS=long
# runs many more examples.
settings.register_profile(
    "ci", max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("TORCHMHA_HYPOTHESIS", "ci"))

# Absolute tolerances against torch's own result at the same dtype (the standard of the project).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def assert_close(actual, expected, dtype=None, msg=""):
    """Same NaN pattern and max abs difference within the dtype's tolerance."""
    dtype = dtype or expected.dtype
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=0, equal_nan=True, msg=msg or None)


def torch_reference_for_separate(module: torch.nn.Module, num_heads: int, dropout: float = 0.0):
    """A torch.nn.MultiheadAttention with the weights of a v1-v3 module (q/k/v/out Linear layers)."""
    E, kdim, vdim = module.q_proj.in_features, module.k_proj.in_features, module.v_proj.in_features
    ref = torch.nn.MultiheadAttention(E, num_heads, dropout=dropout, kdim=kdim, vdim=vdim, dtype=module.q_proj.weight.dtype)
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            ref.in_proj_weight.copy_(torch.cat([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]))
        else:
            ref.q_proj_weight.copy_(module.q_proj.weight)
            ref.k_proj_weight.copy_(module.k_proj.weight)
            ref.v_proj_weight.copy_(module.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([module.q_proj.bias, module.k_proj.bias, module.v_proj.bias]))
        ref.out_proj.weight.copy_(module.out_proj.weight)
        ref.out_proj.bias.copy_(module.out_proj.bias)
    return ref


def mha_pair(*args, dtype=torch.float64, seed=0, **kwargs):
    """(torch's module, torchmha's module) with identical weights."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(*args, dtype=dtype, **kwargs)
    ours = torchmha.MultiheadAttention(*args, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    # Non-zero biases, so a dropped bias cannot go unnoticed.
    with torch.no_grad():
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            if "bias" in name:
                p.normal_()
                q.copy_(p)
    return ref, ours


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
