"""Peers shared by the attention cases: torch's module and ours with the same weights
(build_pair), the plain-torch SDPA implementation of the same math (sdpa_attention), and the
peers of one self-attention forward (self_attention_peers, inference_peers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchmha

from .core import Peers
from .floors import gemm_floor


def build_pair(E: int, H: int, *, batch_first: bool, device: str, dtype: torch.dtype = torch.float32,
               training: bool = False) -> tuple[nn.MultiheadAttention, torchmha.MultiheadAttention]:
    """torch's module and ours with identical weights, dropout 0, in train or eval mode."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, device=device, dtype=dtype).train(training)
    with torch.no_grad():  # torch initialises the biases to zero, which would hide bias bugs
        ref.in_proj_bias.normal_(std=0.1)
        ref.out_proj.bias.normal_(std=0.1)
    ours = torchmha.MultiheadAttention(E, H, batch_first=batch_first, device=device, dtype=dtype).train(training)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def sdpa_attention(module: nn.MultiheadAttention, x: Tensor) -> Tensor:
    """module(x, x, x, need_weights=False)[0] written in plain torch: packed in-projection,
    heads to (N, H, L, hd), F.scaled_dot_product_attention, heads merged, out-projection."""
    x_nle = x if module.batch_first else x.transpose(0, 1)
    N, L, E = x_nle.shape
    H = module.num_heads
    q, k, v = (
        F.linear(x_nle, module.in_proj_weight, module.in_proj_bias)
        .view(N, L, 3, H, E // H)
        .permute(2, 0, 3, 1, 4)  # (3, N, H, L, hd)
    )
    dropout_p = module.dropout if module.training else 0.0
    heads = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    out = F.linear(heads.transpose(1, 2).reshape(N, L, E), module.out_proj.weight, module.out_proj.bias)
    return out if module.batch_first else out.transpose(0, 1)


def self_attention_peers(ref: nn.MultiheadAttention, ours: nn.MultiheadAttention, x: Tensor, *,
                         need_weights: bool, no_grad: bool, with_floor: bool = False,
                         floor_bmm: bool = True) -> Peers:
    """One forward of self-attention on x for each peer (sdpa only when weights are not needed;
    the GEMM floor on request, with the two per-head bmm of the weights unless floor_bmm=False)."""
    peers: Peers = {
        "ours": lambda: ours(x, x, x, need_weights=need_weights),
        "torch": lambda: ref(x, x, x, need_weights=need_weights),
    }
    if not need_weights:
        peers["sdpa"] = lambda: sdpa_attention(ref, x)
    if with_floor:
        peers["floor"] = gemm_floor(ref, x, need_weights and floor_bmm)
    if no_grad:
        peers = {name: torch.no_grad()(fn) for name, fn in peers.items()}
    return peers


def inference_peers(N: int, L: int, E: int, H: int, *, device: str, dtype: torch.dtype = torch.float32,
                    batch_first: bool = True, need_weights: bool = False, with_floor: bool = False,
                    floor_bmm: bool = True) -> Peers:
    """Eval mode, torch.no_grad, self-attention on a fresh random (N, L, E) input."""
    ref, ours = build_pair(E, H, batch_first=batch_first, device=device, dtype=dtype)
    shape = (N, L, E) if batch_first else (L, N, E)
    x = torch.randn(shape, device=device, dtype=dtype)
    return self_attention_peers(ref, ours, x, need_weights=need_weights, no_grad=True, with_floor=with_floor,
                                floor_bmm=floor_bmm)
