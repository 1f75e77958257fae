"""blocked_kernel: torchmha's blocked (flash-style) kernel against SDPA on the same heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchmha

from harness import Peers, Row, Settings, case, measure, mm_gflops, ratio_row, softmax_ns_per_score

# The blocked kernel's settings: (dtype, N, H, L, causal, with the backward), head size 64; some
# where the core takes it, some where it keeps SDPA (the rule, blocked_attention.cpp).
BLOCKED_KERNEL_SETTINGS = (
    (torch.float32, 8, 8, 128, False, False), (torch.float32, 2, 8, 512, True, False),
    (torch.float32, 8, 8, 256, False, True), (torch.float32, 1, 8, 2048, False, True),
    (torch.float32, 1, 8, 1024, False, False), (torch.float32, 1, 8, 4096, False, False),
    (torch.float32, 1, 8, 4096, True, False), (torch.float32, 1, 8, 2048, True, True),
    (torch.bfloat16, 8, 8, 16, False, False), (torch.bfloat16, 1, 8, 1024, False, False),
    (torch.bfloat16, 2, 8, 512, True, True), (torch.float16, 2, 8, 512, False, False),
    (torch.float16, 8, 8, 128, False, True),
)


def takes_blocked_kernel(dtype: torch.dtype, N: int, H: int, L: int, causal: bool, train: bool, device: str) -> bool:
    """Whether torchmha's module runs the blocked kernel for this call (the profiler's word, so the
    rule stays in one place, the core)."""
    module = torchmha.MultiheadAttention(H * 64, H, batch_first=True, device=device, dtype=dtype).train(train)
    x = torch.randn(N, L, H * 64, device=device, dtype=dtype, requires_grad=train)
    mask = nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=dtype) if causal else None
    with torch.profiler.profile() as prof, torch.set_grad_enabled(train):
        module(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)
    return any(e.name == "torchmha::blocked_attention" for e in prof.events())


def blocked_kernel_peers(dtype: torch.dtype, N: int, H: int, L: int, causal: bool, train: bool, device: str) -> Peers:
    """The attention alone on (N, H, L, 64) heads: torchmha's ops (forward, and its backward op) as
    "ours", F.scaled_dot_product_attention (and autograd) as "torch"."""
    q, k, v, grad = (torch.randn(N, H, L, 64, device=device, dtype=dtype) for _ in range(4))
    ops = torch.ops.torchmha

    def ours() -> object:
        with torch.no_grad():
            heads, lse = ops.blocked_attention(q, k, v, None, causal)
            return ops.blocked_attention_backward(grad, q, k, v, None, causal, heads, lse) if train else heads

    leaves = [t.detach().requires_grad_(train) for t in (q, k, v)]

    def sdpa() -> object:
        with torch.set_grad_enabled(train):
            heads = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            return torch.autograd.grad(heads, leaves, grad) if train else heads

    return {"ours": ours, "torch": sdpa}


def blocked_rate_note(ms: float, N: int, H: int, L: int, causal: bool, train: bool, mm_rate: float,
                      softmax_ns: float) -> str:
    """Ours against the machine (float32 from L = 1024, issue 26 item 2): GFLOP/s of the attention's
    products (2 a forward, 7 with the backward, at 2 L^2 D each; half of that causal), their share
    of torch.mm's rate, and for a forward the softmax's cap: the share of that rate left once every
    score has been through a softmax at the measured cost (ours applies it once a score)."""
    pairs = N * H * L * L / (2 if causal else 1)
    flops = 2 * 64 * pairs * (7 if train else 2)
    gflops = flops / 1e9 / (ms / 1e3)
    note = f"{gflops:.0f} GFLOP/s = {gflops / mm_rate:.2f} of torch.mm's {mm_rate:.0f}"
    if not train:
        gemm_s = flops / 1e9 / mm_rate
        note += f", softmax cap {gemm_s / (gemm_s + pairs * softmax_ns * 1e-9):.2f}"
    return note


@case
def blocked_kernel(settings: Settings) -> list[Row]:
    """torchmha's blocked kernel (attention without weights, issue 14 item 2) against SDPA on the
    same heads: where the core takes it, it must be no slower; elsewhere the row shows why SDPA stays
    (the rule keys on the CPU's vendor for float32: docs/kernel_rules.md). float32 rows from
    L = 1024 also give the rate against torch.mm's and the softmax's cap (issue 26 item 2)."""
    mm_rate, softmax_ns = mm_gflops(torch.float32, settings), softmax_ns_per_score(settings)
    rows = []
    for dtype, N, H, L, causal, train in BLOCKED_KERNEL_SETTINGS:
        taken = takes_blocked_kernel(dtype, N, H, L, causal, train, settings.device)
        measured = measure(blocked_kernel_peers(dtype, N, H, L, causal, train, settings.device), settings)
        name = str(dtype).removeprefix("torch.")
        setting = (f"{name} {'forward+backward' if train else 'forward'}{', causal' if causal else ''}, "
                   f"(N, H, L, D)=({N}, {H}, {L}, 64); torch = SDPA")
        notes = "the core takes it" if taken else "the core keeps SDPA"
        if dtype == torch.float32 and L >= 1024:
            notes += "; " + blocked_rate_note(measured.times_ms["ours"], N, H, L, causal, train, mm_rate, softmax_ns)
        row = ratio_row("blocked_kernel", setting, measured, 1.0, notes=notes)
        if not taken:
            row.target, row.value = None, None
        rows.append(row)
    return rows
