"""The article's v1-v4 (torchmha.MultiheadAttentionV1..V4), against torch.nn.MultiheadAttention."""

import pytest
import torch
import torch.nn.functional as F

import torchmha
from helpers import assert_close, torch_reference_for_separate

DTYPES = [torch.float64, torch.float32]


def separate_projection_grads(module):
    """A v1-v3 module's parameter gradients in torch.nn.MultiheadAttention's layout."""
    g = {n: p.grad for n, p in module.named_parameters()}
    out = {
        "in_proj_bias": torch.cat([g["q_proj.bias"], g["k_proj.bias"], g["v_proj.bias"]]),
        "out_proj.weight": g["out_proj.weight"],
        "out_proj.bias": g["out_proj.bias"],
    }
    if module.k_proj.in_features == module.embed_dim and module.v_proj.in_features == module.embed_dim:
        out["in_proj_weight"] = torch.cat([g["q_proj.weight"], g["k_proj.weight"], g["v_proj.weight"]])
    else:
        out.update(q_proj_weight=g["q_proj.weight"], k_proj_weight=g["k_proj.weight"], v_proj_weight=g["v_proj.weight"])
    return out


def check_forward_and_grads(ours_out, ref_out, inputs, ours_grads_fn, ref, dtype):
    """Outputs equal; gradients of inputs and parameters equal for a random upstream gradient."""
    assert_close(ours_out, ref_out, dtype, "output")
    upstream = torch.randn_like(ref_out)
    ours_in = torch.autograd.grad((ours_out * upstream).sum(), inputs, retain_graph=True)
    ref_in = torch.autograd.grad((ref_out * upstream).sum(), inputs, retain_graph=True)
    for a, b in zip(ours_in, ref_in):
        assert_close(a, b, dtype, "input gradient")
    (ours_out * upstream).sum().backward()
    (ref_out * upstream).sum().backward()
    ours_grads = ours_grads_fn()
    for name, p in ref.named_parameters():
        assert_close(ours_grads[name], p.grad, dtype, f"gradient of {name}")


def make_mask(kind, L, S, batch_heads=None):
    shape = (L, S) if batch_heads is None else (batch_heads, L, S)
    if kind == "bool":
        mask = torch.rand(shape) > 0.6
        mask[..., 0] = False  # every query keeps one key: no all-masked rows here
        return mask
    return torch.randn(shape, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_v1_equals_single_head_torch(dtype):
    v1 = torchmha.MultiheadAttentionV1(10, dtype=dtype)
    ref = torch_reference_for_separate(v1, num_heads=1)
    x = torch.randn(7, 3, 10, dtype=dtype, requires_grad=True)
    ref_out = ref(x, x, x, need_weights=False)[0]
    check_forward_and_grads(v1(x), ref_out, [x], lambda: separate_projection_grads(v1), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind,mask_rank", [(None, 0), ("bool", 2), ("float", 2), ("bool", 3), ("float", 3)])
def test_v2_masks_and_grads(dtype, mask_kind, mask_rank):
    E, H, L, N = 12, 3, 6, 2
    v2 = torchmha.MultiheadAttentionV2(E, H, dtype=dtype)
    ref = torch_reference_for_separate(v2, num_heads=H)
    x = torch.randn(L, N, E, dtype=dtype, requires_grad=True)
    mask = None if mask_kind is None else make_mask(mask_kind, L, L, None if mask_rank == 2 else N * H)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    ref_out = ref(x, x, x, attn_mask=mask, need_weights=False)[0]
    check_forward_and_grads(v2(x, mask), ref_out, [x], lambda: separate_projection_grads(v2), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kdim,vdim", [(5, 7), (12, 12), (12, 4)])
def test_v3_general_dims_and_lengths(dtype, kdim, vdim):
    E, H, L, S, N = 12, 4, 5, 9, 3
    v3 = torchmha.MultiheadAttentionV3(E, H, kdim=kdim, vdim=vdim, dtype=dtype)
    ref = torch_reference_for_separate(v3, num_heads=H)
    q = torch.randn(L, N, E, dtype=dtype, requires_grad=True)
    k = torch.randn(S, N, kdim, dtype=dtype, requires_grad=True)
    v = torch.randn(S, N, vdim, dtype=dtype, requires_grad=True)
    mask = make_mask("bool", L, S)
    ref_out = ref(q, k, v, attn_mask=mask, need_weights=False)[0]
    check_forward_and_grads(v3(q, k, v, mask), ref_out, [q, k, v], lambda: separate_projection_grads(v3), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["self", "encoder_decoder", "general"])
def test_v4_packed_projection_cases(dtype, case):
    E, H, L, S, N = 16, 4, 6, 8, 2
    v4 = torchmha.MultiheadAttentionV4(E, H, dtype=dtype)
    ref = torch.nn.MultiheadAttention(E, H, dtype=dtype)
    with torch.no_grad():
        ref.in_proj_weight.copy_(v4.in_proj.weight)
        ref.in_proj_bias.copy_(v4.in_proj.bias)
        ref.out_proj.weight.copy_(v4.out_proj.weight)
        ref.out_proj.bias.copy_(v4.out_proj.bias)
    q = torch.randn(L, N, E, dtype=dtype, requires_grad=True)
    if case == "self":
        k = v = q
    elif case == "encoder_decoder":
        k = v = torch.randn(S, N, E, dtype=dtype, requires_grad=True)
    else:
        k = torch.randn(S, N, E, dtype=dtype, requires_grad=True)
        v = torch.randn(S, N, E, dtype=dtype, requires_grad=True)
    inputs = list({id(t): t for t in (q, k, v)}.values())
    ref_out = ref(q, k, v, need_weights=False)[0]

    def ours_grads():
        return {
            "in_proj_weight": v4.in_proj.weight.grad,
            "in_proj_bias": v4.in_proj.bias.grad,
            "out_proj.weight": v4.out_proj.weight.grad,
            "out_proj.bias": v4.out_proj.bias.grad,
        }

    check_forward_and_grads(v4(q, k, v), ref_out, inputs, ours_grads, ref, dtype)


def test_v4_uses_key_and_value():
    """The article's v4 projected only the query; ours must depend on key and value."""
    v4 = torchmha.MultiheadAttentionV4(8, 2)
    q, k = torch.randn(3, 1, 8), torch.randn(5, 1, 8)
    assert not torch.allclose(v4(q, k, k), v4(q, k, torch.randn(5, 1, 8)))
    assert not torch.allclose(v4(q, k, k), v4(q, torch.randn(5, 1, 8), k))


def test_scale_is_per_head():
    """The article divided by sqrt(embed_dim); the right scale is sqrt(head_dim)."""
    v2 = torchmha.MultiheadAttentionV2(16, 4, dtype=torch.float64)
    x = torch.randn(5, 1, 16, dtype=torch.float64)
    with torch.no_grad():
        q = F.linear(x, v2.q_proj.weight, v2.q_proj.bias).view(5, 4, 4).transpose(0, 1)
        k = F.linear(x, v2.k_proj.weight, v2.k_proj.bias).view(5, 4, 4).transpose(0, 1)
        v = F.linear(x, v2.v_proj.weight, v2.v_proj.bias).view(5, 4, 4).transpose(0, 1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1) @ v  # sqrt(head_dim = 4) = 2
        expected = F.linear(attn.transpose(0, 1).reshape(5, 1, 16), v2.out_proj.weight, v2.out_proj.bias)
    assert_close(v2(x), expected)


@pytest.mark.parametrize("cls,args", [
    (torchmha.MultiheadAttentionV2, (8, 2)),
    (torchmha.MultiheadAttentionV3, (8, 2)),
    (torchmha.MultiheadAttentionV4, (8, 2)),
])
def test_dropout_only_in_training(cls, args):
    torch.manual_seed(0)
    with_dropout = cls(*args, dropout=0.5)
    without = cls(*args, dropout=0.0)
    without.load_state_dict(with_dropout.state_dict())
    x = torch.randn(12, 2, 8)
    inputs = (x,) if cls is torchmha.MultiheadAttentionV2 else (x, x, x)
    with_dropout.eval()
    assert torch.equal(with_dropout(*inputs), without(*inputs))
    with_dropout.train()
    torch.manual_seed(1)
    first = with_dropout(*inputs)
    assert not torch.allclose(first, without(*inputs))
    torch.manual_seed(1)
    assert torch.equal(first, with_dropout(*inputs)), "dropout must be reproducible under a seed"


def test_state_dict_keys():
    assert list(torchmha.MultiheadAttentionV1(4).state_dict()) == [
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
        "v_proj.weight", "v_proj.bias", "out_proj.weight", "out_proj.bias",
    ]
    v3 = torchmha.MultiheadAttentionV3(4, 2, kdim=3, vdim=5)
    assert v3.k_proj.weight.shape == (4, 3) and v3.v_proj.weight.shape == (4, 5)
    assert list(torchmha.MultiheadAttentionV4(4, 2).state_dict()) == [
        "in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias",
    ]


def test_modules_behave_as_torch_modules():
    import copy
    import io
    import pickle

    v4 = torchmha.MultiheadAttentionV4(8, 2)
    assert all(isinstance(p, torch.nn.Parameter) for p in v4.parameters())
    assert len(torch.optim.SGD(v4.parameters(), lr=0.1).param_groups[0]["params"]) == 4
    clone = copy.deepcopy(v4)
    x = torch.randn(3, 2, 8)
    assert torch.equal(clone(x, x, x), v4(x, x, x))
    restored = pickle.loads(pickle.dumps(v4))
    assert torch.equal(restored(x, x, x), v4(x, x, x))
    buffer = io.BytesIO()
    torch.save(v4.state_dict(), buffer)
    buffer.seek(0)
    fresh = torchmha.MultiheadAttentionV4(8, 2)
    fresh.load_state_dict(torch.load(buffer))
    assert torch.equal(fresh(x, x, x), v4(x, x, x))
    doubled = v4.double()
    assert doubled is v4 and v4.in_proj.weight.dtype == torch.float64
    assert v4(x.double(), x.double(), x.double()).dtype == torch.float64


# -------------------------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors():
    with pytest.raises(AssertionError, match="divisible"):
        torchmha.MultiheadAttentionV2(10, 3)
    with pytest.raises(ValueError, match="greater than 0"):
        torchmha.MultiheadAttentionV4(8, 0)
    v4 = torchmha.MultiheadAttentionV4(8, 2)
    x = torch.randn(4, 2, 8)
    with pytest.raises(AssertionError, match=r"received 4-D query tensor\n\(query of shape \[1, 4, 2, 8\]\)"):
        v4(x[None], x[None], x[None])
    with pytest.raises(AssertionError, match=r"embedding dimension of 8, but got 6\n\(query of shape \[4, 2, 6\]\)"):
        v4(torch.randn(4, 2, 6), x, x)
    with pytest.raises(AssertionError, match=r"key shape torch.Size\(\[5, 2, 8\]\) does not match value shape torch.Size\(\[6, 2, 8\]\)"):
        v4(x, torch.randn(5, 2, 8), torch.randn(6, 2, 8))
    with pytest.raises(RuntimeError, match=r"^The shape of the 2D attn_mask is torch.Size\(\[3, 4\]\), but should be \(4, 4\)."):
        v4(x, x, x, torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"^The shape of the 3D attn_mask is torch.Size\(\[2, 4, 4\]\), but should be \(4, 4, 4\)."):
        v4(x, x, x, torch.zeros(2, 4, 4, dtype=torch.bool))
    with pytest.raises(AssertionError, match=r"bool and floating types of attn_mask are supported\n.*Int"):
        v4(x, x, x, torch.zeros(4, 4, dtype=torch.int32))
    v3 = torchmha.MultiheadAttentionV3(8, 2, kdim=3)
    with pytest.raises(AssertionError, match=r"expecting key weights shape of \(8, 8\), but got torch.Size\(\[8, 3\]\)"):
        v3(x, torch.randn(5, 2, 8), torch.randn(5, 2, 8))  # key has 8 features, k_proj expects 3
