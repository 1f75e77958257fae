"""weight_reads: a decoding step's linear layers against the machine's read rate (issue 34 item 1).
The 36 weight matrices of the generation model's decoder step (E=512, ff 2048, 6 layers), each read
once by torchmha's small-batch kernel for 1 and 8 rows of x, against a torch sum over the same
tensors; int8 weights (quantized_linear) against a sum over their bytes."""

from __future__ import annotations

import torch

from harness import Row, Settings, Target, case, median_ms

E, FF, LAYERS = 512, 2048, 6
SHAPES = ((3 * E, E), (E, E), (E, E), (E, E), (FF, E), (E, FF))  # per layer: self in/out, cross q/out, ff
TARGET = {1: 0.9, 8: 0.8}


def step_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape).to(dtype) for _ in range(LAYERS) for shape in SHAPES]


def products_call(pairs: list, rows: int, x_dtype: torch.dtype):
    """One call of torchmha's kernel on each (weight, scale) pair (scale None: small_linear, else
    quantized_linear) for `rows` rows of x."""
    ops = torch.ops.torchmha
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=x_dtype) for w, _ in pairs}
    return lambda: [ops.small_linear(xs[w.shape[1]], w, None) if s is None else
                    ops.quantized_linear(xs[w.shape[1]], w, s, None) for w, s in pairs]


def read_call(weights: list):
    """A torch sum over each tensor's bytes (an int8 sum accumulates in int64, slower than reading:
    int8 bytes are summed as float32)."""
    same_bytes = [w.contiguous().view(torch.float32) if w.dtype == torch.int8 else w for w in weights]
    return lambda: [w.sum() for w in same_bytes]


@case
def weight_reads(settings: Settings) -> list[Row]:
    if settings.device != "cpu":  # the small-batch kernels are CPU kernels; elsewhere ATen's linear runs
        return [Row("weight_reads", f"{settings.device}: not measured (torchmha's small-batch kernels are CPU kernels)",
                    target=Target("read rate fraction", ">=", TARGET[1]))]
    ops = torch.ops.torchmha
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        if dtype == torch.int8:
            pairs = [ops.quantize_weight(w) for w in step_weights(torch.float32)]
        else:
            pairs = [(w, None) for w in step_weights(dtype)]
        weights = [w for w, _ in pairs]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        read_ms = median_ms(read_call(weights), settings.min_run_time)
        for M in (1, 8):
            x_dtype = torch.float32 if dtype == torch.int8 else dtype
            ms = median_ms(products_call(pairs, M, x_dtype), settings.min_run_time)
            name = str(dtype).removeprefix("torch.")
            rate, peak = nbytes / ms / 1e6, nbytes / read_ms / 1e6
            flop_ms = 2 * M * sum(w.numel() for w in weights) / 1e9 / 150 * 1e3  # at 150 GFLOP/s
            notes = (f"{rate:.1f} GB/s against sum's {peak:.1f} over {nbytes / 1e6:.0f} MB; "
                     f"the FLOPs alone take {flop_ms:.2f} ms at 150 GFLOP/s")
            rows.append(Row("weight_reads", f"{name} weights, {M} row(s) of x, 36 matrices",
                            {"ours": ms, "sum": read_ms}, None, Target("read rate fraction", ">=", TARGET[M]),
                            read_ms / ms, notes, {"GBps": rate, "sum_GBps": peak}))
    return rows
