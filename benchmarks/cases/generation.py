"""generation: whole cached generations through nn.Transformer's decoder, torchmha.CachedDecoder
against a cache written in plain PyTorch (HandCache) and against recomputing the prefix, with a
floor from what each step must read and compute (generation, generation_floor, generation_recompute)."""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import torchmha

from harness import Peers, Row, Settings, Target, case, max_abs_diff, mm_gflops, streaming_rate, timed_rounds

# nn.Transformer's decoder as issue 25 item 9 sets it; S = the memory's positions.
GENERATION_MODEL = {"E": 512, "H": 8, "layers": 6, "ff": 2048, "S": 64}
# (dtype, batch, prompt, new tokens); --quick generates a quarter of the new tokens.
GENERATION_SETTINGS = (
    (torch.float32, 1, 16, 256), (torch.float32, 8, 16, 128),
    (torch.float32, 1, 1024, 64), (torch.bfloat16, 1, 16, 64),
)
# floor/ours >= by batch (issue 34 item 2: batch 1 in float32 and bfloat16, batch 8; issue 25 had set
# 0.6, bfloat16 0.5)
GENERATION_FLOOR_TARGET = {1: 0.8, 8: 0.7}


def generation_model(dtype: torch.dtype, device: str, **sizes: int) -> nn.Transformer:
    """nn.Transformer (post-norm, relu, dropout 0) in eval; one encoder layer, as only the decoder runs.
    `sizes` replace GENERATION_MODEL's (E, H, layers, ff) for a model of another size."""
    m = {**GENERATION_MODEL, **sizes}
    torch.manual_seed(0)
    with warnings.catch_warnings():  # the unused encoder's note that it will not use nested tensors
        warnings.filterwarnings("ignore", message="enable_nested_tensor")
        model = nn.Transformer(m["E"], m["H"], num_encoder_layers=1, num_decoder_layers=m["layers"],
                               dim_feedforward=m["ff"], dropout=0.0, device=device, dtype=dtype).eval()
    with torch.no_grad():  # torch's zero biases and unit norms would hide a bug in either cache
        for p in model.decoder.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p), alpha=0.1)
    return model


def generation_inputs(N: int, P: int, G: int, dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor, Tensor]:
    """memory (S, N, E), prompt (P, N, E) and the new positions' inputs (G, N, E), in the model's
    layout: teacher forcing, so every peer does the same work."""
    E, S = GENERATION_MODEL["E"], GENERATION_MODEL["S"]
    like = dict(device=device, dtype=dtype)
    return torch.randn(S, N, E, **like), torch.randn(P, N, E, **like), torch.randn(G, N, E, **like)


def recompute_generation(model: nn.Transformer, memory: Tensor, prompt: Tensor, new: Tensor) -> Tensor:
    """No cache: the decoder's causal forward over the whole prefix for each new position, keeping
    the last; the prompt's outputs from the first forward over it."""
    tokens = torch.cat([prompt, new])
    mask = nn.Transformer.generate_square_subsequent_mask(len(tokens), device=tokens.device, dtype=tokens.dtype)

    def upto(end: int) -> Tensor:
        return model.decoder(tokens[:end], memory, tgt_mask=mask[:end, :end], tgt_is_causal=True)

    P = prompt.shape[0]
    return torch.cat([upto(P)] + [upto(end)[-1:] for end in range(P + 1, len(tokens) + 1)])


def split_heads(x: Tensor, parts: int, H: int) -> tuple[Tensor, ...]:
    """(N, L, parts*E) -> `parts` tensors of (N, H, L, E/H)."""
    N, L, width = x.shape
    return x.view(N, L, parts, H, width // (parts * H)).permute(2, 0, 3, 1, 4).unbind(0)


def merge_heads(x: Tensor) -> Tensor:
    """(N, H, L, D) -> (N, L, H*D)."""
    N, H, L, D = x.shape
    return x.transpose(1, 2).reshape(N, L, H * D)


class HandCache:
    """The key/value cache a skilled PyTorch user writes for nn.Transformer's decoder (post-norm,
    relu, as generation_model builds it): per-layer K/V preallocated, the memory's keys and values
    projected once, then per step and layer plain F.linear / SDPA / F.layer_norm. It holds the
    model's parameter tensors themselves (no copies), gathered once so a step pays no module
    attribute lookups."""

    def __init__(self, model: nn.Transformer, batch: int, max_length: int, memory: Tensor,
                 weights: list[dict] | None = None):
        self.H, self.length = model.nhead, 0
        self.weights = weights if weights is not None else [self._layer_weights(layer) for layer in model.decoder.layers]
        self.final_norm = (model.decoder.norm.weight, model.decoder.norm.bias, model.decoder.norm.eps)
        shape = (batch, self.H, max_length, model.d_model // self.H)
        self.keys = [torch.zeros(shape, device=memory.device, dtype=memory.dtype) for _ in self.weights]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.memory_kv = [self._project_memory(w, memory) for w in self.weights]

    @staticmethod
    def _layer_weights(layer: nn.TransformerDecoderLayer) -> dict:
        sa, ca, E = layer.self_attn, layer.multihead_attn, layer.self_attn.embed_dim
        pair = lambda m: (m.weight, m.bias)  # noqa: E731
        return dict(
            qkv=(sa.in_proj_weight, sa.in_proj_bias), self_out=pair(sa.out_proj),
            q=(ca.in_proj_weight[:E], ca.in_proj_bias[:E]), kv=(ca.in_proj_weight[E:], ca.in_proj_bias[E:]),
            cross_out=pair(ca.out_proj), linear1=pair(layer.linear1), linear2=pair(layer.linear2),
            **{f"norm{i}": (*pair(n), n.eps) for i, n in enumerate((layer.norm1, layer.norm2, layer.norm3), 1)},
        )

    def _project_memory(self, w: dict, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = split_heads(F.linear(memory.transpose(0, 1), *w["kv"]), 2, self.H)
        return k.contiguous(), v.contiguous()

    @staticmethod
    def _norm(h: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        return F.layer_norm(h, weight.shape, weight, bias, eps)

    def _self_attention(self, w: dict, h: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        start, end = self.length, self.length + h.shape[1]
        assert start == 0 or end == start + 1, "a prompt at position 0, then one position a step"
        q, k, v = split_heads(F.linear(h, *w["qkv"]), 3, self.H)
        keys[:, :, start:end], values[:, :, start:end] = k, v
        # SDPA's is_causal aligns the mask top-left: right for the prompt at position 0, and one
        # new position sees the whole prefix.
        heads = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], is_causal=end - start > 1)
        return F.linear(merge_heads(heads), *w["self_out"])

    def _cross_attention(self, w: dict, h: Tensor, memory_kv: tuple[Tensor, Tensor]) -> Tensor:
        (q,) = split_heads(F.linear(h, *w["q"]), 1, self.H)
        return F.linear(merge_heads(F.scaled_dot_product_attention(q, *memory_kv)), *w["cross_out"])

    def _after_self_attention(self, w: dict, h: Tensor, attended: Tensor, memory_kv: tuple[Tensor, Tensor]) -> Tensor:
        """The rest of a post-norm layer: norm1, cross-attention, norm2, feed-forward, norm3."""
        h = self._norm(h + attended, *w["norm1"])
        h = self._norm(h + self._cross_attention(w, h, memory_kv), *w["norm2"])
        return self._norm(h + F.linear(F.relu(F.linear(h, *w["linear1"])), *w["linear2"]), *w["norm3"])

    def step(self, x: Tensor) -> Tensor:
        """Appends x (T, N, E) and returns the decoder's output there."""
        h = x.transpose(0, 1)  # (N, T, E), the layout the heads split from
        for w, keys, values, memory_kv in zip(self.weights, self.keys, self.values, self.memory_kv):
            h = self._after_self_attention(w, h, self._self_attention(w, h, keys, values), memory_kv)
        self.length += x.shape[0]
        return self._norm(h, *self.final_norm).transpose(0, 1)


def teacher_forced(step: Callable[[Tensor], Tensor], prompt: Tensor, new: Tensor) -> Tensor:
    """A cached generation's outputs: the prompt in one step (prefill), then one new input a step."""
    return torch.cat([step(prompt)] + [step(new[i : i + 1]) for i in range(new.shape[0])])


def generation_peers(model: nn.Transformer, memory: Tensor, prompt: Tensor, new: Tensor) -> Peers:
    """One whole generation (new state, prefill, every new token) per call, under inference_mode."""
    N, max_length = prompt.shape[1], prompt.shape[0] + new.shape[0]
    decoder = torchmha.CachedDecoder(model)

    def ours() -> Tensor:
        state = decoder.new_state(N, max_length, memory=memory)
        return teacher_forced(lambda x: decoder(x, state), prompt, new)

    peers: Peers = {
        "ours": ours,
        "hand": lambda: teacher_forced(HandCache(model, N, max_length, memory).step, prompt, new),
        "recompute": lambda: recompute_generation(model, memory, prompt, new),
    }
    return {name: torch.inference_mode()(fn) for name, fn in peers.items()}


def step_weight_elements(decoder: nn.TransformerDecoder) -> tuple[int, int]:
    """(all, in matrices) of the parameter elements every step reads: the decoder's, less each
    cross-attention's key/value rows (the memory is projected once, at the start)."""
    E = decoder.layers[0].self_attn.embed_dim
    params = list(decoder.parameters())
    once = len(decoder.layers) * 2 * E * E
    return (sum(p.numel() for p in params) - once - len(decoder.layers) * 2 * E,
            sum(p.numel() for p in params if p.dim() == 2) - once)


def generation_steps(P: int, G: int) -> list[tuple[int, int]]:
    """(position, new positions) of each step: the prefill, then one token a step."""
    return [(0, P)] + [(P + i, 1) for i in range(G)]


def step_work(model: nn.Transformer, N: int, position: int, T: int) -> tuple[int, int]:
    """(bytes read, GEMM FLOPs) a step must at least move and compute: the live weights, every
    cached key/value (its own included) and the memory's; the projections and the attention's
    products (causal: only the query-key pairs the mask keeps)."""
    decoder, E, S = model.decoder, model.d_model, GENERATION_MODEL["S"]
    layers, size = len(decoder.layers), decoder.layers[0].linear1.weight.element_size()
    elements, matrix = step_weight_elements(decoder)
    read = size * (elements + 2 * layers * N * E * (position + T + S))
    pairs = T * position + T * (T + 1) // 2 + T * S  # per sequence and layer: self then cross
    return read, 2 * N * T * matrix + 4 * N * E * layers * pairs


def memory_work(model: nn.Transformer, N: int, weight_size: int | None = None) -> tuple[int, int]:
    """(bytes, GEMM FLOPs) of projecting the memory once, at the start (new_state): every layer's
    cross-attention key/value weights (of weight_size bytes an element; the model's if None) and the
    memory read, its keys and values written; an (N S, E) x (E, 2 E) product a layer."""
    decoder, E, S = model.decoder, model.d_model, GENERATION_MODEL["S"]
    layers, size = len(decoder.layers), decoder.layers[0].linear1.weight.element_size()
    read = layers * 2 * E * E * (weight_size or size) + size * N * S * E * (1 + 2 * layers)
    return read, 2 * N * S * layers * 2 * E * E


def generation_floor_ms(model: nn.Transformer, N: int, P: int, G: int, read_bytes_s: float,
                        mm_gflop_s: float) -> float:
    """The sum over the memory's projection and every step of the longer of reading its bytes and
    running its GEMM FLOPs."""
    work = [memory_work(model, N)] + [step_work(model, N, position, T) for position, T in generation_steps(P, G)]
    return 1e3 * sum(max(read / read_bytes_s, flops / (mm_gflop_s * 1e9)) for read, flops in work)


def largest_step_bytes(model: nn.Transformer, N: int, P: int, G: int) -> int:
    return max(step_work(model, N, position, T)[0] for position, T in generation_steps(P, G))


class GenerationMeasured(NamedTuple):
    times_ms: dict[str, float]  # one whole generation, per peer
    diffs: dict[str, float]  # max |peer - recompute|, ours and hand
    round_ratios: list[float]  # ours/hand within each round
    floor_ms: float
    read_gb_s: float  # a sum over as many bytes as the largest step reads
    mm_gflop_s: float


def measure_generation(settings: Settings, dtype: torch.dtype, N: int, P: int, G: int,
                       mm_gflop_s: float) -> GenerationMeasured:
    """The three peers checked against recompute, timed in alternating rounds (recompute, seconds a
    generation, in the first one or two only), then the read rate for the floor."""
    model = generation_model(dtype, settings.device)
    peers = generation_peers(model, *generation_inputs(N, P, G, dtype, settings.device))
    outputs = {name: fn() for name, fn in peers.items()}  # the warm-up, and the correctness check
    diffs = {name: max_abs_diff(outputs[name], outputs["recompute"]) for name in ("ours", "hand")}
    del outputs
    times, ratios = timed_rounds(peers, settings, reference="hand",
                                 rounds_of={"recompute": 1 if settings.quick else 2})
    buffer = torch.ones(largest_step_bytes(model, N, P, G) // 4, device=settings.device)
    read = streaming_rate(buffer, settings.min_run_time)
    floor_ms = generation_floor_ms(model, N, P, G, read, mm_gflop_s)
    return GenerationMeasured(times, diffs, ratios, floor_ms, read / 1e9, mm_gflop_s)


def generation_rows(dtype: torch.dtype, N: int, P: int, G: int, m: GenerationMeasured) -> list[Row]:
    """ours/hand (its floor column: floor/hand, the lowest ours/hand reachable), floor/ours, and at
    256 new tokens recompute/ours, each a row with its target."""
    t, name = m.times_ms, str(dtype).removeprefix("torch.")
    g = GENERATION_MODEL
    setting = (f"{name}, N={N}, prompt {P}, {G} new tokens; nn.Transformer decoder E={g['E']} H={g['H']} "
               f"{g['layers']} layers ff {g['ff']}, memory {g['S']}")
    per_token = {peer: ms / G for peer, ms in t.items()}
    floor_of_ours, recompute_of_ours = m.floor_ms / t["ours"], t["recompute"] / t["ours"]
    hand_ok = dtype != torch.float32 or m.diffs["hand"] < 1e-4
    notes = (f"ms/token: {', '.join(f'{p} {v:.3f}' for p, v in per_token.items())}; "
             f"recompute/ours {recompute_of_ours:.1f}; floor/ours {floor_of_ours:.2f}; "
             f"hand vs recompute {m.diffs['hand']:.1e}{'' if hand_ok else ' (hand is WRONG)'}; "
             f"rounds {min(m.round_ratios):.2f}-{max(m.round_ratios):.2f}")
    data = {"ms_per_token": per_token, "max_abs_diff_vs_recompute": m.diffs, "round_ratios": m.round_ratios,
            "floor_ms": m.floor_ms, "read_GBps": m.read_gb_s, "mm_gflops": m.mm_gflop_s,
            "floor/ours": floor_of_ours, "recompute/ours": recompute_of_ours}
    rows = [Row("generation", setting, t, m.diffs["ours"], Target("ours/hand", "<=", 0.7), t["ours"] / t["hand"],
                notes, data, limit=m.floor_ms / t["hand"])]
    gemm_of = "" if dtype == torch.float32 else f", the faster of {name}'s and float32's"
    floor_notes = (f"floor {m.floor_ms:.0f} ms: per step max(bytes / {m.read_gb_s:.1f} GB/s read, "
                   f"GEMM FLOPs / {m.mm_gflop_s:.0f} GFLOP/s torch.mm{gemm_of}), summed over the prefill and {G} "
                   f"tokens, and the memory's projection")
    rows.append(Row("generation_floor", setting, {"ours": t["ours"], "floor": m.floor_ms}, m.diffs["ours"],
                    Target("floor/ours", ">=", GENERATION_FLOOR_TARGET[N]), floor_of_ours, floor_notes, data))
    if N == 1 and G == 256:  # issue 25: the cache must pay off 10x on a long batch-1 generation
        rows.append(Row("generation_recompute", setting, {"ours": t["ours"], "recompute": t["recompute"]},
                        m.diffs["ours"], Target("recompute/ours", ">=", 10), recompute_of_ours, data=data))
    return rows


def best_gemm_gflops(dtype: torch.dtype, rates: dict[torch.dtype, float], settings: Settings) -> float:
    """The best GEMM rate a step in `dtype` can use: torch.mm's in that dtype, or float32's where that
    is faster, as a reduced-precision product can always run in float32 (torchmha's do, where a rule
    measured it faster: on CPUs without bfloat16 hardware, whose bfloat16 torch.mm runs at 1-3
    GFLOP/s, that floor was meaningless). `rates` keeps each dtype's torch.mm rate, measured once."""
    for each in {dtype, torch.float32}:
        if each not in rates:
            rates[each] = mm_gflops(each, settings)
    return max(rates[dtype], rates[torch.float32])


@case
def generation(settings: Settings) -> list[Row]:
    """Whole generations (prefill + every new token) through nn.Transformer's decoder, issue 25
    item 9: torchmha.CachedDecoder against the cache a user writes by hand and against
    recomputing the prefix, and against a floor from what each step must read and compute."""
    mm_rates: dict[torch.dtype, float] = {}
    rows = []
    for dtype, N, P, G in tqdm(GENERATION_SETTINGS, desc="generation settings", leave=False):
        G = G // 4 if settings.quick else G
        best_rate = best_gemm_gflops(dtype, mm_rates, settings)
        rows += generation_rows(dtype, N, P, G, measure_generation(settings, dtype, N, P, G, best_rate))
    return rows


# ------------------------------------------------------------------ int8 weights (issue 34 item 3)
# (batch, prompt, new tokens) of the float32 model; --quick generates a quarter of the new tokens.
INT8_SETTINGS = ((1, 16, 128), (8, 16, 64))


def int8_step_work(model: nn.Transformer, N: int, position: int, T: int) -> tuple[int, int]:
    """step_work with the matrices read as int8 (one byte an element; vectors, scales and caches in
    the model's dtype)."""
    read, flops = step_work(model, N, position, T)
    _, matrix = step_weight_elements(model.decoder)
    size = model.decoder.layers[0].linear1.weight.element_size()
    return read - matrix * (size - 1), flops


def torchao_int8_weights(model: nn.Transformer) -> list[dict]:
    """HandCache's weights with every projection an nn.Linear quantized by torchao's
    Int8WeightOnlyConfig (its weight-only int8 tensor in F.linear): what a user reaches for to read
    int8 weights today. Made once, as CachedDecoder quantizes once."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_  # (benchmarks only: not a dependency)

    layers = [HandCache._layer_weights(layer) for layer in model.decoder.layers]
    for weights in layers:
        for name, value in weights.items():
            if not name.startswith("norm"):
                weight, bias = value
                linear = nn.Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
                with torch.no_grad():
                    linear.weight.copy_(weight)
                    linear.bias.copy_(bias)
                quantize_(linear, Int8WeightOnlyConfig())
                weights[name] = (linear.weight, linear.bias)
    return layers


class StaticHandCache(HandCache):
    """HandCache as torch.compile wants it (gpt-fast's static cache): each new token writes its row
    with index_copy_ at a position tensor and attends over the whole capacity under a mask of the
    filled positions, so every token runs one compiled graph (`decode`, compiled once by the
    caller); the prompt runs eager, as HandCache's."""

    def __init__(self, model: nn.Transformer, batch: int, max_length: int, memory: Tensor, weights: list[dict],
                 decode: Callable):
        super().__init__(model, batch, max_length, memory, weights)
        self.positions = torch.arange(max_length, device=memory.device)
        self.decode = decode

    def token(self, x: Tensor, position: Tensor) -> Tensor:
        """One new position (1, N, E) at `position` (a (1,) int64 tensor)."""
        h = x.transpose(0, 1)
        visible = (self.positions <= position).view(1, 1, 1, -1)  # (1, 1, 1, max_length)
        for w, keys, values, memory_kv in zip(self.weights, self.keys, self.values, self.memory_kv):
            q, k, v = split_heads(F.linear(h, *w["qkv"]), 3, self.H)
            keys.index_copy_(2, position, k)
            values.index_copy_(2, position, v)
            heads = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
            h = self._after_self_attention(w, h, F.linear(merge_heads(heads), *w["self_out"]), memory_kv)
        return self._norm(h, *self.final_norm).transpose(0, 1)

    def step(self, x: Tensor) -> Tensor:
        if self.length == 0 or x.shape[0] != 1:
            return super().step(x)
        position = torch.tensor([self.length], device=x.device)
        self.length += 1
        return self.decode(self, x, position)


TORCHAO_MISSING = (f"not measured: torchao does not import beside torch {torch.__version__} "
                   "(pip install -r benchmarks/requirements.txt; make bench does)")


def torchao_available() -> bool:
    try:
        import torchao.quantization  # noqa: F401  (whether it imports)
    except Exception:  # (not installed, or built for another torch)
        return False
    return True


@case
def generation_int8(settings: Settings) -> list[Row]:
    """CachedDecoder(model, weight_dtype=torch.int8) on the float32 generation model: tokens per
    second against the float32 and bfloat16 CachedDecoder and torchao's int8 weight-only hand cache,
    eager and (as a static cache) under torch.compile (batch 1), and against the int8 floor (batch
    8); the deviation from the unquantized model."""
    rows = []
    read = mm = None
    for N, P, G in INT8_SETTINGS:
        G = G // 4 if settings.quick else G
        model = generation_model(torch.float32, settings.device)
        memory, prompt, new = generation_inputs(N, P, G, torch.float32, settings.device)
        bf16 = generation_model(torch.bfloat16, settings.device)
        decoders = {"ours": torchmha.CachedDecoder(model, weight_dtype=torch.int8),
                    "float32": torchmha.CachedDecoder(model), "bfloat16": torchmha.CachedDecoder(bf16)}

        def run(name: str) -> Tensor:
            decoder = decoders[name]
            cast = (lambda t: t.bfloat16()) if name == "bfloat16" else (lambda t: t)
            state = decoder.new_state(N, P + G, memory=cast(memory))
            return teacher_forced(lambda x: decoder(x, state), cast(prompt), cast(new))

        peers: Peers = {name: (lambda name=name: run(name)) for name in decoders}
        if N == 1 and torchao_available():
            int8 = torchao_int8_weights(model)
            decode = torch.compile(StaticHandCache.token)  # one graph for every token, compiled in the first call
            peers["torchao"] = lambda: teacher_forced(HandCache(model, N, P + G, memory, int8).step, prompt, new)
            peers["torchao_compiled"] = lambda: teacher_forced(
                StaticHandCache(model, N, P + G, memory, int8, decode).step, prompt, new)
        peers = {name: torch.inference_mode()(fn) for name, fn in peers.items()}
        outputs = {name: fn().float() for name, fn in peers.items()}
        deviation = max_abs_diff(outputs["ours"], outputs["float32"])
        times, _ = timed_rounds(peers, settings, reference="float32")
        work = [memory_work(model, N, weight_size=1)] + [int8_step_work(model, N, position, T)
                                                         for position, T in generation_steps(P, G)]
        if read is None:  # a sum over as many bytes as an int8 step reads
            buffer = torch.ones(max(r for r, _ in work) // 4, device=settings.device)
            read, mm = streaming_rate(buffer, settings.min_run_time), mm_gflops(torch.float32, settings)
        floor_ms = 1e3 * sum(max(r / read, f / (mm * 1e9)) for r, f in work)
        setting = f"float32 model, int8 weights, N={N}, prompt {P}, {G} new tokens"
        tokens_s = {name: N * G / (ms / 1e3) for name, ms in times.items()}
        notes = (f"tokens/s (ours = int8): {', '.join(f'{k} {v:.0f}' for k, v in tokens_s.items())}; max |int8 - float32| "
                 f"{deviation:.1e} (of max |y| {outputs['float32'].abs().max():.1f}); int8 floor {floor_ms:.0f} ms "
                 f"(read {read / 1e9:.1f} GB/s over an int8 step's bytes, {mm:.0f} GFLOP/s)")
        data = {"ms": times, "tokens_per_s": tokens_s, "deviation": deviation, "floor_ms": floor_ms}
        if N == 1:
            rows.append(Row("generation_int8", setting, times, deviation, Target("float32/ours", ">=", 3.0),
                            times["float32"] / times["ours"], notes, data))
            rows.append(Row("generation_int8_vs_bf16", setting, times, deviation, Target("bfloat16/ours", ">=", 1.8),
                            times["bfloat16"] / times["ours"], notes, data))
            for peer in ("torchao", "torchao_compiled"):
                value = times[peer] / times["ours"] if peer in times else None  # (None: SKIP, the note says why)
                rows.append(Row(f"generation_int8_vs_{peer}", setting, times, deviation, Target(f"{peer}/ours", ">=", 1.0),
                                value, notes if peer in times else TORCHAO_MISSING, data))
        rows.append(Row("generation_int8_floor", setting, {"ours": times["ours"], "floor": floor_ms}, deviation,
                        Target("floor/ours", ">=", 0.8 if N == 1 else 0.7), floor_ms / times["ours"], notes, data))
    return rows
