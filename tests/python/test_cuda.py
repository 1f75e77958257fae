"""CUDA tensors: torchmha has no CUDA kernel of its own, so every op takes ATen's device-generic
path there. Parity with torch on the same device (float32, bfloat16, float16), the cached step and
CachedDecoder on CUDA, and a step's host syncs. Marked `cuda`: skipped, with the reason, where no
GPU is at hand."""

import warnings

import pytest
import torch
from torch import nn

import torchmha
from helpers import mha_pair
from test_cached_decoder_int8 import dequantized

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

# Against torch on the same device: float32 to 1e-5 of the values' magnitude; the low precisions to
# a few times torch's own error against a float64 reference (as flash-attn's tests do).
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_matches_torch(ours, theirs, reference, dtype):
    """ours and theirs at `dtype`, reference the same computation in float64."""
    if dtype == torch.float32:
        scale = max(1.0, reference.abs().max().item())
        torch.testing.assert_close(ours.double(), theirs.double(), atol=1e-5 * scale, rtol=0)
        return
    torch_error = (theirs.double() - reference).abs().max().item()
    our_error = (ours.double() - reference).abs().max().item()
    assert our_error <= 3 * torch_error + 1e-3, (our_error, torch_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_matches_torch_on_cuda(dtype, need_weights):
    ref, ours = mha_pair(64, 4, dtype=torch.float64, batch_first=True)
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)
    expected, _ = ref(x, x, x, attn_mask=mask)
    ref, ours = ref.to("cuda", dtype), ours.to("cuda", dtype)
    x, mask = x.to("cuda", dtype), mask.cuda()
    theirs, _ = ref(x, x, x, attn_mask=mask, need_weights=need_weights)
    got, _ = ours(x, x, x, attn_mask=mask, need_weights=need_weights)
    assert got.device.type == "cuda" and got.dtype == dtype
    assert_matches_torch(got, theirs, expected.cuda(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_torch_on_cuda(dtype):
    ref, ours = mha_pair(32, 4, dtype=dtype, batch_first=True)
    ref, ours = ref.cuda(), ours.cuda()
    x = torch.randn(2, 6, 32, device="cuda", dtype=dtype)
    ref(x, x, x)[0].sum().backward()
    ours(x, x, x)[0].sum().backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        scale = max(1.0, b.grad.abs().max().item())
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(a.grad, b.grad, atol=tol * scale, rtol=0, msg=name)


def _decoder(dtype):
    torch.manual_seed(0)
    model = nn.Transformer(d_model=64, nhead=4, num_encoder_layers=1, num_decoder_layers=2,
                           dim_feedforward=128, batch_first=True, dropout=0.0).eval()
    return model.to("cuda", dtype)


@pytest.mark.parametrize("weight_dtype", [None, torch.int8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_decoder_equals_the_full_forward_on_cuda(dtype, weight_dtype):
    """With int8 weights (dequantized per layer off the CPU), against the model whose linear weights
    are those int8 weights dequantized."""
    model = _decoder(dtype)
    dec = torchmha.CachedDecoder(model, weight_dtype=weight_dtype)
    if weight_dtype is torch.int8:
        model = dequantized(model)
    src = torch.randn(2, 7, 64, device="cuda", dtype=dtype)
    tgt = torch.randn(2, 6, 64, device="cuda", dtype=dtype)
    with torch.inference_mode():
        memory = model.encoder(src)
        state = dec.new_state(batch_size=2, max_length=64, memory=memory)
        dec(tgt[:, :3], state)
        steps = [dec(tgt[:, t : t + 1], state) for t in range(3, 6)]
        causal = nn.Transformer.generate_square_subsequent_mask(6, device="cuda", dtype=dtype)
        full = model.decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
    assert state.lengths.device.type == "cuda"
    scale = max(1.0, full.abs().max().item())
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 3:], atol=tol * scale, rtol=0)


def test_cached_step_syncs_with_the_host_at_most_once_per_layer():
    """Eager, a step reads max(lengths) to attend over the filled prefix only (its cost follows the
    filled length, not the capacity): one sync per attention layer that reads the cache, counted by
    torch's sync debug mode. (Once per step would need the length passed down: not yet.)"""
    model = _decoder(torch.float32)
    dec = torchmha.CachedDecoder(model)
    with torch.inference_mode():
        memory = model.encoder(torch.randn(1, 5, 64, device="cuda"))
        state = dec.new_state(batch_size=1, max_length=4096, memory=memory)
        dec(torch.randn(1, 2, 64, device="cuda"), state)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dec(torch.randn(1, 1, 64, device="cuda"), state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= len(model.decoder.layers), syncs
