"""Floors shared by cases: what the machine does at its best, measured in the same run, so a row
can say how low its metric can go here. mm_gflops (a 2048^3 torch.mm), softmax_ns_per_score,
streaming_rate (bench_decoding.py's read rate: a sum over a buffer) and gemm_floor (only the
matrix products of an attention call, on prepared inputs)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench_decoding import streaming_rate  # the read rate bench_decoding.py's floor uses

from .core import Settings
from .timing import median_ms

__all__ = ["gemm_floor", "mm_gflops", "softmax_ns_per_score", "streaming_rate"]


def mm_gflops(dtype: torch.dtype, settings: Settings) -> float:
    """The machine's GEMM rate in this dtype: a 2048 x 2048 torch.mm."""
    size = 2048
    a, b = (torch.randn(size, size, device=settings.device, dtype=dtype) for _ in range(2))
    return 2 * size**3 / 1e9 / (median_ms(lambda: torch.mm(a, b), settings.min_run_time) / 1e3)


def softmax_ns_per_score(settings: Settings) -> float:
    """What the softmax costs per score, on all threads, on a block that stays in cache (max, exp,
    sum and scale in float32, as every kernel computes it, also for bfloat16)."""
    block = torch.randn(128, 4096, device=settings.device)
    return median_ms(lambda: torch.softmax(block, -1), settings.min_run_time) * 1e6 / block.numel()


def gemm_floor(module: nn.MultiheadAttention, x: Tensor, need_weights: bool) -> Callable[[], Tensor]:
    """The matrix products that any implementation of this call must run, and nothing else: the
    packed in-projection and the out-projection with the module's weights (autograd records them
    as it does inside the modules), plus, when the weights are returned, q k^T and P v over the N*H
    heads (without weights, SDPA's fused kernels beat two bmm calls, so they are no floor). Inputs
    are prepared beforehand: no copy, softmax, mask or dispatch of the real call is in it. Its time
    over torch's is a lower bound on ours/torch for any implementation on the same GEMMs."""
    x_nle = x if module.batch_first else x.transpose(0, 1)
    N, L, E = x_nle.shape
    H = module.num_heads
    tokens = x_nle.reshape(N * L, E).detach()
    like = dict(device=x.device, dtype=x.dtype)
    heads = torch.randn(N * L, E, **like)
    q, k_t = torch.randn(N * H, L, E // H, **like), torch.randn(N * H, E // H, L, **like)
    probs, v = torch.randn(N * H, L, L, **like), torch.randn(N * H, L, E // H, **like)

    def run() -> Tensor:
        F.linear(tokens, module.in_proj_weight, module.in_proj_bias)
        if need_weights:
            torch.bmm(q, k_t)
            torch.bmm(probs, v)
        return F.linear(heads, module.out_proj.weight, module.out_proj.bias)

    return run
