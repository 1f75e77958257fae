"""Incremental decoding with a key/value cache vs torch recomputing causal attention.

Decodes a sequence token by token through self-attention (N=1, E=512, H=8, float32, eval, no
grad), two ways, side by side:
  - torch:    torch.nn.MultiheadAttention over the whole prefix at every step, causal mask, keeping
              the last position (what a model without a cache does): O(t) projections and O(t^2)
              attention at step t;
  - torchmha: torchmha.MultiheadAttention.forward_with_cache with a preallocated KeyValueCache:
              one position projected and one query attending at each step.
It also times one cached step at a short and a long prefix: without O(L^2) work per step the
per-step time stays flat as the prefix grows.

    python benchmarks/bench_decoding.py            # 1024 tokens (the torch side takes a while)
    python benchmarks/bench_decoding.py --quick    # 256 tokens
"""

import argparse

import torch
from torch.utils import benchmark

import torchmha

EMBED_DIM, NUM_HEADS, BATCH = 512, 8, 1


def decode_with_torch(mha: torch.nn.MultiheadAttention, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    steps = []
    for t in range(1, x.shape[1] + 1):
        prefix = x[:, :t]
        out = mha(prefix, prefix, prefix, attn_mask=causal[:t, :t], is_causal=True, need_weights=False)[0]
        steps.append(out[:, -1:])
    return torch.cat(steps, 1)


def decode_with_cache(mha: torchmha.MultiheadAttention, x: torch.Tensor, cache: torchmha.KeyValueCache) -> torch.Tensor:
    cache.reset()
    return torch.cat([mha.forward_with_cache(x[:, t : t + 1], cache) for t in range(x.shape[1])], 1)


def one_cached_step(mha, token, cache, prefix: int) -> torch.Tensor:
    cache.length = prefix  # positions 0..prefix-1 already hold keys and values
    return mha.forward_with_cache(token, cache)


def one_recomputed_step(mha, x, causal, prefix: int) -> torch.Tensor:
    seen = x[:, : prefix + 1]
    return mha(seen, seen, seen, attn_mask=causal[: prefix + 1, : prefix + 1], is_causal=True, need_weights=False)[0]


def measure(stmt: str, min_run_time: float, **env) -> benchmark.Measurement:
    return benchmark.Timer(stmt=stmt, globals=env, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 tokens instead of 1024, shorter timings")
    parser.add_argument("--tokens", type=int, default=None, help="sequence length to decode")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.tokens or (256 if args.quick else 1024)
    min_time = 0.5 if args.quick else 2.0

    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=True).eval()
    ours = torchmha.MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(BATCH, tokens, EMBED_DIM)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(tokens, dtype=torch.bool)
    cache = torchmha.KeyValueCache.for_module(ours, BATCH, tokens + 1)  # +1: a step after a full prefix

    with torch.inference_mode():
        difference = (decode_with_cache(ours, x, cache) - decode_with_torch(ref, x, causal)).abs().max().item()
        recompute = measure("decode(ref, x, causal)", min_time, decode=decode_with_torch, ref=ref, x=x, causal=causal)
        cached = measure("decode(ours, x, cache)", min_time, decode=decode_with_cache, ours=ours, x=x, cache=cache)
        token = x[:, :1]
        short, long = tokens // 8, tokens
        step, torch_step = {}, {}
        for prefix in (short, long):
            step[prefix] = measure("step(ours, token, cache, prefix)", min_time, step=one_cached_step, ours=ours,
                                   token=token, cache=cache, prefix=prefix)
            torch_step[prefix] = measure("step(ref, x, causal, prefix)", min_time, step=one_recomputed_step, ref=ref,
                                         x=torch.cat([x, token], 1), causal=torch.nn.Transformer.generate_square_subsequent_mask(tokens + 1, dtype=torch.bool), prefix=prefix)

    print(f"Decoding {tokens} tokens one at a time: N={BATCH}, E={EMBED_DIM}, H={NUM_HEADS}, float32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"max |cached - torch| over all outputs: {difference:.2e}\n")
    print("| case | median | runs |")
    print("| --- | ---: | ---: |")
    print(f"| torch.nn.MultiheadAttention, causal recompute over the prefix, {tokens} tokens | "
          f"{recompute.median * 1e3:.1f} ms | {len(recompute.times)} |")
    print(f"| torchmha forward_with_cache + KeyValueCache, {tokens} tokens | {cached.median * 1e3:.1f} ms | "
          f"{len(cached.times)} |")
    print(f"| **speed-up torch-recompute / torchmha-cached** | **{recompute.median / cached.median:.1f}x** | |")
    for name, steps in (("torchmha cached", step), ("torch recompute", torch_step)):
        for prefix, m in steps.items():
            print(f"| {name}: one step after a prefix of {prefix} | {m.median * 1e3:.3f} ms | {len(m.times)} |")
        print(f"| {name}: per-step time ratio prefix {long} / prefix {short} | "
              f"{steps[long].median / steps[short].median:.2f} | |")


if __name__ == "__main__":
    main()
