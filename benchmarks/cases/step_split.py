"""step_split: where a generation step's time goes (issue 34 item 2: "where a step's own
overhead stops it, show the split"). For the generation model (cases/generation.py) in float32,
bfloat16 and with int8 weights, at batch 1 and 8, in one process: a step of torchmha.CachedDecoder,
its 36 matrix products alone (the same weights and kernel, a row of x a sequence), its 12
attention kernels alone, the Python shell's work, the same step of a model of the same depth
with d_model 64 (the step's fixed cost: the op's boundary, each layer's calls, views and checks,
its products' and attention kernels' calls too, with next to no bytes or FLOPs), and the read of
the same weight bytes by torch's sum, over the 36 tensors and over one buffer of their size.
Informational: the targets are generation's and generation_int8's rows; this one says which part
stops them."""

from __future__ import annotations

import torch
from torch import Tensor

import torchmha

from cases.generation import GENERATION_MODEL, generation_inputs, generation_model
from cases.weight_reads import products_call, read_call
from harness import Row, Settings, case, median_ms

# (dtype of the model, weight_dtype of CachedDecoder); prompt 16, then G new tokens (--quick: G / 4)
SPLIT_SETTINGS = ((torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.int8))
BATCHES = (1, 8)
PROMPT, NEW_TOKENS = 16, 64
FIXED_COST_E, FIXED_COST_H = 64, 4  # the fixed-cost model: heads of 16 (one AVX-512 vector), 1 MB of float32 weights


def step_products(params: list, scales: list) -> list:
    """The step's 36 (weight, scale) pairs, in the op's parameter order: the parameters that are
    matrices, six a layer (self in- and out-projection, cross in- and out-projection, linear1,
    linear2), of which the cross in-projection's query rows only (the memory's key and value rows
    are projected once, by new_state)."""
    E = GENERATION_MODEL["E"]
    pairs = [(w, s) for w, s in zip(params, scales or [None] * len(params)) if w is not None and w.dim() == 2]
    return [(w[:E], None if s is None else s[:E]) if i % 6 == 2 else (w, s) for i, (w, s) in enumerate(pairs)]


def attention_call(dtype: torch.dtype, N: int, length: int):
    """The step's attention kernels alone: per layer the cached self-attention over `length`
    positions (its lengths put back each call, one small op more) and the cross-attention over the
    memory; warm, where in a step the keys and values arrive after the weights have passed through
    the caches."""
    ops, g = torch.ops.torchmha, GENERATION_MODEL
    H, D, S = g["H"], g["E"] // g["H"], g["S"]
    like = dict(dtype=dtype)
    q = torch.randn(N, H, 1, D, **like)
    caches = [(torch.randn(N, H, length + 1, D, **like), torch.randn(N, H, length + 1, D, **like))
              for _ in range(g["layers"])]
    memory = [(torch.randn(N, H, S, D, **like), torch.randn(N, H, S, D, **like)) for _ in range(g["layers"])]
    lengths = torch.full((N,), length, dtype=torch.long)

    def run() -> None:
        for (k, v), (mk, mv) in zip(caches, memory):
            ops.decode_attention(q, q, q, k, v, lengths, None, None, 0.0)
            lengths.fill_(length)
            ops.static_attention(q, mk, mv, None)
    return run


def step_ms(decoder: torchmha.CachedDecoder, memory: Tensor, prompt: Tensor, new: Tensor,
            settings: Settings) -> float:
    """ms a new token: a whole generation less its new_state and prefill, over the new tokens."""
    G, N = new.shape[0], new.shape[1]

    def start() -> torchmha.cached_decoder.DecoderState:
        state = decoder.new_state(N, PROMPT + G, memory=memory)
        decoder(prompt, state)
        return state

    def generate() -> None:
        state = start()
        for i in range(G):
            decoder(new[i : i + 1], state)
    return (median_ms(generate, settings.min_run_time) - median_ms(start, settings.min_run_time)) / G


def fixed_cost_ms(dtype: torch.dtype, weight_dtype, N: int, settings: Settings) -> float:
    """A step of a model of the generation model's depth and kinds of layer with d_model
    FIXED_COST_E: what a step costs beside its bytes and FLOPs (warm: its few bytes stay in cache)."""
    g = GENERATION_MODEL
    with torch.inference_mode(False):  # (parameters made outside inference mode, as the generation model's are)
        model = generation_model(dtype, settings.device, E=FIXED_COST_E, H=FIXED_COST_H, ff=2 * FIXED_COST_E)
        decoder = torchmha.CachedDecoder(model, weight_dtype=weight_dtype)
    like = dict(device=settings.device, dtype=dtype)
    state = decoder.new_state(N, PROMPT + 1, memory=torch.randn(g["S"], N, FIXED_COST_E, **like))
    decoder(torch.randn(PROMPT, N, FIXED_COST_E, **like), state)
    x = torch.randn(1, N, FIXED_COST_E, **like)

    def step() -> None:  # one token after the prompt, again and again (the lengths put back)
        state.lengths.fill_(PROMPT)
        decoder(x, state)
    return median_ms(step, settings.min_run_time)


def split_row(dtype: torch.dtype, weight_dtype, N: int, settings: Settings) -> Row:
    G = NEW_TOKENS // 4 if settings.quick else NEW_TOKENS
    model = generation_model(dtype, settings.device)
    memory, prompt, new = generation_inputs(N, PROMPT, G, dtype, settings.device)
    decoder = torchmha.CachedDecoder(model, weight_dtype=weight_dtype)
    with torch.inference_mode():
        params, scales = decoder._step_params()
        pairs = step_products(params, scales)
        weights = [w for w, _ in pairs]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        one_buffer = torch.ones(nbytes // 4)
        times = {
            "ours": step_ms(decoder, memory, prompt, new, settings),
            "products": median_ms(products_call(pairs, N, dtype), settings.min_run_time),
            "attention": median_ms(attention_call(dtype, N, PROMPT + G // 2), settings.min_run_time),
            "fixed": fixed_cost_ms(dtype, weight_dtype, N, settings),
            "sum36": median_ms(read_call(weights), settings.min_run_time),
            "sum1": median_ms(lambda: one_buffer.sum(), settings.min_run_time),
        }
        shell_ms = median_ms(decoder._step_params, settings.min_run_time)
    rest = times["ours"] - times["products"] - times["attention"]
    name = "int8 weights" if weight_dtype == torch.int8 else str(dtype).removeprefix("torch.")
    setting = (f"{name}, N={N}, prompt {PROMPT}, {G} new tokens (attention at {PROMPT + G // 2} positions); "
               f"nn.Transformer decoder E={GENERATION_MODEL['E']}, {GENERATION_MODEL['layers']} layers")
    rate = {peer: nbytes / times[peer] / 1e6 for peer in ("products", "sum36", "sum1")}
    notes = (f"ms a step: {times['ours']:.3f} = products {times['products']:.3f} ({rate['products']:.1f} GB/s; "
             f"sum over the 36 {rate['sum36']:.1f}, over one buffer {rate['sum1']:.1f}) + attention kernels "
             f"{times['attention']:.3f} (warm) + the rest {rest:.3f} (the attention's cold reads, norms, activation, "
             f"views, dispatch, the op's boundary); the step's fixed cost (the same step of a d_model {FIXED_COST_E} "
             f"model: every call of the step, its 48 kernels' too, with next to no bytes) {times['fixed']:.3f}; "
             f"the Python shell's parameter read, warm, {1e3 * shell_ms:.1f} us")
    data = {"ms": times, "rest_ms": rest, "shell_ms": shell_ms, "GBps": rate, "weight_bytes": nbytes}
    return Row("step_split", setting, times, None, None, None, notes, data)


@case
def step_split(settings: Settings) -> list[Row]:
    """A step's time (batch 1 and 8) split into its products, attention kernels and the rest, against
    the read of its weights (informational; no target). The CPU's step only: its products are the
    CPU's small-batch kernels."""
    if settings.device != "cpu":
        return [Row("step_split", f"{settings.device}: not measured (the split of the CPU kernels' step)")]
    return [split_row(dtype, weight_dtype, N, settings) for N in BATCHES for dtype, weight_dtype in SPLIT_SETTINGS]
