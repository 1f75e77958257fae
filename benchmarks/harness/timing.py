"""Timing: median_ms (one peer), timed_rounds (peers in alternating rounds), measure (warm-up, the
correctness check ours vs torch, then timed_rounds), and max_abs_diff."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils import benchmark

from .core import Measured, Peers, Settings


def median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """Median milliseconds per call of fn (already warm). Timer synchronises CUDA itself;
    num_threads is set because Timer's default is one thread, which is not how modules are used."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    one_call = timer.timeit(number=1).median
    if one_call >= min_run_time:  # a slow call: blocked_autorange would spend one more just sizing its blocks
        return one_call * 1e3
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def max_abs_diff(a: object, b: object) -> float:
    """Largest |a - b| over two results (tensors or tuples of tensors; None entries skipped)."""
    a_parts = a if isinstance(a, (tuple, list)) else (a,)
    b_parts = b if isinstance(b, (tuple, list)) else (b,)
    diffs = [
        (x.detach().float() - y.detach().float()).abs().max().item()
        for x, y in zip(a_parts, b_parts)
        if x is not None and y is not None
    ]
    return max(diffs, default=0.0)


def measure(peers: Peers, settings: Settings, min_run_time: Optional[float] = None,
            rounds: Optional[int] = None) -> Measured:
    """Runs every peer once (warm-up, and the correctness check ours vs torch), then times the peers
    in alternating rounds (see timed_rounds). Also returns ours/torch of each round, back-to-back
    timings whose spread shows the run's noise."""
    diff = max_abs_diff(peers["ours"](), peers["torch"]())
    for name, fn in peers.items():
        if name not in ("ours", "torch"):
            fn()  # warm-up
    times, round_ratios = timed_rounds(peers, settings, min_run_time, rounds)
    return Measured(times, diff, round_ratios)


def timed_rounds(peers: Peers, settings: Settings, min_run_time: Optional[float] = None,
                 rounds: Optional[int] = None, reference: str = "torch",
                 rounds_of: Optional[dict[str, int]] = None) -> tuple[dict[str, float], list[float]]:
    """Times warm peers in alternating rounds and keeps each one's lowest median: on a shared
    machine a burst of other load then spoils one round of every peer instead of all the samples
    of one peer. Returns those medians and ours/reference within each round. rounds_of gives some
    peers fewer rounds (the first ones), for calls of many seconds."""
    rounds = rounds or settings.rounds
    rounds_of = rounds_of or {}
    round_time = (min_run_time or settings.min_run_time) / rounds
    best = {name: float("inf") for name in peers}
    round_ratios = []
    for round_index in range(rounds):
        # Order reversed every other round, so no peer always runs first (after the case's
        # set-up) or right after the same neighbour.
        order = list(peers.items()) if round_index % 2 == 0 else list(peers.items())[::-1]
        this_round = {name: median_ms(fn, round_time) for name, fn in order
                      if round_index < rounds_of.get(name, rounds)}
        best.update({name: min(best[name], ms) for name, ms in this_round.items()})
        round_ratios.append(this_round["ours"] / this_round[reference])
    return best, round_ratios
