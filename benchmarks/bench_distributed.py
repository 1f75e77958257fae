"""torchmha.distributed on this machine (gloo, loopback, one thread per process).

Context parallel: causal self-attention forward at sequence length L across P processes, against
single-process SDPA (torch.nn.MultiheadAttention, need_weights=False) at the same L: median time
and per-rank peak memory (peak RSS in a fresh process minus its RSS before the inputs exist).
Head parallel: bytes all-reduced per forward against the ideal (the output, N*L*E elements).

    python benchmarks/bench_distributed.py [--lengths 8192 32768] [--procs 2 4] [--repeat 3]
"""

import argparse
import os
import resource
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

EMBED, HEADS, BATCH = 64, 4, 1


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(rank, world, port, length, repeat, results):
    import torchmha
    import torchmha.distributed  # noqa: F401 (loads on first access: its imports are not the run's memory)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(EMBED, HEADS, batch_first=True).eval()
    base = _rss_mib()
    times = []
    with torch.no_grad():
        if world == 1:
            x = torch.randn(BATCH, length, EMBED)
            run = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                *(t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in
                  torch.nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)), is_causal=True)
        else:
            attention = torchmha.distributed.ContextParallelAttention(mha)
            x = torch.randn(BATCH, length // world, EMBED)
            run = lambda: attention(x, is_causal=True)  # noqa: E731
        for i in range(repeat + 1):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            run()
            if i:
                times.append(time.perf_counter() - start)
    results.put((rank, statistics.median(times), _peak_mib() - base))
    if world > 1:
        dist.destroy_process_group()


def context_parallel(length, world, repeat):
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_context, args=(world, _port(), length, repeat, queue), nprocs=world, start_method="spawn")
    rows = [queue.get() for _ in range(world)]
    return max(r[1] for r in rows), max(r[2] for r in rows)


def head_parallel_volume(length, world):
    # Each rank all-reduces its partial output (N, L, E); ring all-reduce moves 2 (P-1)/P of it per rank.
    elements = BATCH * length * EMBED
    return elements * 4, elements * 4 * 2 * (world - 1) / world


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"context parallel, causal forward, N={BATCH} E={EMBED} H={HEADS} float32, {os.cpu_count()} CPU cores, "
          "1 thread per process")
    print("| L | P | median time (s) | per-rank peak memory (MiB) |")
    print("|---|---|---|---|")
    for length in args.lengths:
        for world in [1, *args.procs]:
            seconds, mib = context_parallel(length, world, args.repeat)
            label = "1 (SDPA)" if world == 1 else str(world)
            print(f"| {length} | {label} | {seconds:.2f} | {mib:.0f} |", flush=True)
    print("\nhead parallel: all-reduce per forward (float32), ideal = the output once")
    print("| L | P | output bytes (ideal) | bytes sent per rank (ring all-reduce) |")
    print("|---|---|---|---|")
    for length in args.lengths:
        for world in args.procs:
            ideal, sent = head_parallel_volume(length, world)
            print(f"| {length} | {world} | {ideal / 2**20:.1f} MiB | {sent / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
