"""efficiency: the module's achieved GFLOP/s against the machine's torch.mm rate."""

from __future__ import annotations

import torch

from harness import Row, Settings, Target, case, inference_peers, measure, mm_gflops, softmax_ns_per_score


def attention_gflop(N: int, L: int, E: int) -> float:
    """Forward FLOPs of self-attention: QK^T and PV (4 N L^2 E) plus four E x E projections (8 N L E^2)."""
    return (4 * N * L**2 * E + 8 * N * L * E**2) / 1e9


@case
def efficiency(settings: Settings) -> list[Row]:
    """Achieved GFLOP/s of ours against a plain torch.mm on the same device, same run, in float32
    and bfloat16. The limit (floor column) is the share of the GEMM rate left once every score has
    been through a softmax at the measured cost: (flops / mm rate) / (that + scores x softmax cost)."""
    N, L, E, H = 1, 4096, 512, 8
    softmax_ns = softmax_ns_per_score(settings)
    rows = []
    for dtype, threshold in ((torch.float32, 0.8), (torch.bfloat16, 0.45)):
        times, diff, _ = measure(inference_peers(N, L, E, H, device=settings.device, dtype=dtype), settings)
        rate = mm_gflops(dtype, settings)
        gemm_s = attention_gflop(N, L, E) / rate
        cap = gemm_s / (gemm_s + N * H * L * L * softmax_ns * 1e-9)
        gflops = {peer: attention_gflop(N, L, E) / (ms / 1e3) for peer, ms in times.items()}
        name = str(dtype).removeprefix("torch.")
        notes = (", ".join(f"{peer} {g:.0f}" for peer, g in gflops.items())
                 + f", torch.mm {rate:.0f} GFLOP/s; softmax {softmax_ns:.2f} ns/score")
        setting = f"{name} eval no_grad, N={N} L={L} E={E} H={H}, need_weights=False"
        target = Target("ours GFLOP/s / mm GFLOP/s", ">=", threshold)
        rows.append(Row("efficiency", setting, times, diff, target, gflops["ours"] / rate, notes, limit=cap,
                        data={"gflops": gflops, "mm_gflops": rate, "softmax_ns_per_score": softmax_ns, "cap": cap}))
    return rows
