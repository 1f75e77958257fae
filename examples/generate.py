"""Generation with an nn.Transformer: recomputing the whole prefix every token vs torchmha.CachedDecoder.

    python examples/generate.py [--d-model 256] [--layers 4] [--new-tokens 64] [--beam 4] [--plot generation.png]

A token embedding, sinusoidal positions and a vocabulary head around torch's own nn.Transformer
(batch_first). The weights are random: the model is untrained and its tokens mean nothing; the
point is that both ways give the same tokens, and how long a token takes. The source sequence is
encoded once (model.encoder); then greedy decoding and beam search run twice each:

- recompute: model.decoder over the whole prefix every token, with the causal tgt_mask, as
  nn.Transformer is used without a cache (each token costs more than the one before);
- cached: torchmha.CachedDecoder(model) feeds only the newest token; its key/value cache holds the
  prefix and the memory's keys and values are projected once (each token costs about the same).

It asserts that both ways produce the same tokens, prints the milliseconds per token of each and
writes a plot of milliseconds per token against position (needs matplotlib). A step's time runs from
the tokens so far to the next token chosen; the cache's one-time memory projection (new_state) is
not in it.
"""

import argparse
import math
import time
from typing import Callable, List, Tuple

import torch
from torch import Tensor, nn

import torchmha

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional: no progress bar without it

    def tqdm(iterable, **_):
        return iterable


BOS = 0  # the token every target sequence starts with


class Seq2Seq(nn.Module):
    """nn.Transformer with a token embedding, sinusoidal positional encoding and a vocabulary head."""

    def __init__(self, vocab: int, d_model: int, nhead: int, layers: int, max_positions: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model, nhead, num_encoder_layers=layers, num_decoder_layers=layers,
                                          dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, vocab)
        position = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_positions, d_model)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)
        self.register_buffer("positional", table)

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions (N, T) -> (N, T, E)."""
        return self.embedding(tokens) * math.sqrt(self.d_model) + self.positional[positions]

    def encode(self, source: Tensor) -> Tensor:
        positions = torch.arange(source.shape[1], device=source.device).expand_as(source)
        return self.transformer.encoder(self.embed(source, positions))


# A decoding way: given the tokens so far (N, L), return the logits of the next token (N, V).
# reorder(origin) is told which old sequence each sequence continues (beam search).
class Recompute:
    """model.decoder over the whole prefix, causally, every token: what nn.Transformer does uncached."""

    name = "recompute"

    def __init__(self, model: Seq2Seq, memory: Tensor) -> None:
        self.model, self.memory = model, memory

    def next_logits(self, tokens: Tensor) -> Tensor:
        N, L = tokens.shape
        positions = torch.arange(L, device=tokens.device).expand(N, L)
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=tokens.device)
        y = self.model.transformer.decoder(self.model.embed(tokens, positions), self.memory,
                                           tgt_mask=causal, tgt_is_causal=True)
        return self.model.head(y[:, -1])

    def reorder(self, origin: Tensor) -> None:
        pass  # the prefix is recomputed from the tokens, which the search reorders itself


class Cached:
    """torchmha.CachedDecoder: feeds only the newest token at position state.lengths."""

    name = "cached"

    def __init__(self, model: Seq2Seq, memory: Tensor, max_length: int) -> None:
        self.model = model
        self.decoder = torchmha.CachedDecoder(model.transformer)
        self.state = self.decoder.new_state(memory.shape[0], max_length, memory=memory)

    def next_logits(self, tokens: Tensor) -> Tensor:
        newest = tokens[:, -1:]
        positions = self.state.lengths.unsqueeze(1)  # each sequence's own next position
        y = self.decoder(self.model.embed(newest, positions), self.state)
        return self.model.head(y[:, -1])

    def reorder(self, origin: Tensor) -> None:
        self.state.reorder(origin)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy(way, new_tokens: int, device: torch.device, progress: bool = False) -> Tuple[Tensor, List[float]]:
    """Greedy decoding of one sequence: (its new_tokens tokens, milliseconds of each step)."""
    tokens = torch.full((1, 1), BOS, device=device)
    times = []
    for _ in tqdm(range(new_tokens), desc=f"greedy {way.name}", disable=not progress, leave=False):
        start = time.perf_counter()
        next_token = way.next_logits(tokens).argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return tokens[0, 1:], times


def beam_search(way, beam: int, new_tokens: int, device: torch.device,
                progress: bool = False) -> Tuple[Tensor, List[float]]:
    """Beam search of width `beam` (fixed length, no end token: the model is untrained): (the best
    beam's tokens, milliseconds of each step)."""
    tokens = torch.full((beam, 1), BOS, device=device)
    scores = torch.full((beam,), -math.inf, device=device)
    scores[0] = 0.0  # the beams start identical: only the first one may be extended at first
    times = []
    for _ in tqdm(range(new_tokens), desc=f"beam {way.name}", disable=not progress, leave=False):
        start = time.perf_counter()
        log_probs = torch.log_softmax(way.next_logits(tokens).float(), dim=-1)
        vocab = log_probs.shape[-1]
        scores, flat = (scores.unsqueeze(1) + log_probs).flatten().topk(beam)
        origin, token = flat // vocab, flat % vocab  # beam i continues old beam origin[i] with token[i]
        way.reorder(origin)
        tokens = torch.cat([tokens[origin], token.unsqueeze(1)], dim=1)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return tokens[scores.argmax(), 1:], times


def run(label: str, search: Callable, make_way: Callable, new_tokens: int, **kwargs) -> Tuple[Tensor, List[float]]:
    """Times `search` with a fresh way (after a short warm-up run) and prints its ms per token."""
    search(make_way(), new_tokens=min(4, new_tokens), **kwargs)
    tokens, times = search(make_way(), new_tokens=new_tokens, progress=True, **kwargs)
    print(f"{label:<22}{sum(times) / len(times):>10.2f} ms/token   (first {times[0]:.2f}, last {times[-1]:.2f})")
    return tokens, times


def plot(path: str, curves: dict, title: str) -> None:
    try:
        import matplotlib
    except ImportError as missing:  # matplotlib is optional
        print(f"skipped the plot: {missing} (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, (times, style) in curves.items():
        axes.plot(range(1, len(times) + 1), times, style, label=label)
    axes.set_xlabel("position of the generated token")
    axes.set_ylabel("milliseconds per token")
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="encoder layers and decoder layers")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--source-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--plot", default="generation.png", help="where to write the plot")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = Seq2Seq(args.vocab, args.d_model, args.heads, args.layers,
                    max_positions=max(args.source_length, args.new_tokens)).to(device).eval()
    print(f"torchmha {torchmha.__version__} on torch {torch.__version__}, {device}: nn.Transformer d_model "
          f"{args.d_model}, {args.heads} heads, {args.layers}+{args.layers} layers, vocabulary {args.vocab} "
          f"(random weights, untrained), source {args.source_length} tokens, {args.new_tokens} new tokens\n")

    with torch.inference_mode():
        source = torch.randint(1, args.vocab, (1, args.source_length), device=device)
        memory = model.encode(source)  # once, for both ways
        beam_memory = memory.expand(args.beam, -1, -1)  # the beams share the source
        n = args.new_tokens

        greedy_recompute, greedy_recompute_ms = run(
            "greedy, recompute", greedy, lambda: Recompute(model, memory), new_tokens=n, device=device)
        greedy_cached, greedy_cached_ms = run(
            "greedy, cached", greedy, lambda: Cached(model, memory, n), new_tokens=n, device=device)
        assert torch.equal(greedy_recompute, greedy_cached), (
            f"greedy tokens differ:\n{greedy_recompute.tolist()}\n{greedy_cached.tolist()}")

        beam_recompute, beam_recompute_ms = run(
            f"beam {args.beam}, recompute", beam_search, lambda: Recompute(model, beam_memory),
            beam=args.beam, new_tokens=n, device=device)
        beam_cached, beam_cached_ms = run(
            f"beam {args.beam}, cached", beam_search, lambda: Cached(model, beam_memory, n),
            beam=args.beam, new_tokens=n, device=device)
        assert torch.equal(beam_recompute, beam_cached), (
            f"beam search tokens differ:\n{beam_recompute.tolist()}\n{beam_cached.tolist()}")

    print(f"\nsame tokens both ways (greedy and beam search); greedy: {greedy_cached[:12].tolist()}"
          f"{' ...' if n > 12 else ''}")
    for label, slow, fast in [("greedy", greedy_recompute_ms, greedy_cached_ms),
                              (f"beam {args.beam}", beam_recompute_ms, beam_cached_ms)]:
        print(f"{label}: the cache takes {sum(fast) / sum(slow):.2f} of recompute's time "
              f"({sum(slow) / sum(fast):.1f}x faster)")
    plot(args.plot, {
        "greedy, recompute": (greedy_recompute_ms, "C0-"),
        "greedy, CachedDecoder": (greedy_cached_ms, "C1-"),
        f"beam {args.beam}, recompute": (beam_recompute_ms, "C0--"),
        f"beam {args.beam}, CachedDecoder": (beam_cached_ms, "C1--"),
    }, f"nn.Transformer, d_model {args.d_model}, {args.layers} decoder layers, {device}")


if __name__ == "__main__":
    main()
