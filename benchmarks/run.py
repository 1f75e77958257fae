"""torchmha benchmark suite: torchmha.MultiheadAttention against torch.nn.MultiheadAttention and a
plain-torch SDPA implementation of the same math, case by case, each with a target.

    python benchmarks/run.py --quick                  # 50-80 s on 2 CPU cores
    python benchmarks/run.py --device cuda            # full run on a GPU
    python benchmarks/run.py --quick --cases fast_path,train_step

Peers (the same weights everywhere):
    ours   torchmha.MultiheadAttention (forward runs the C++ op)
    torch  torch.nn.MultiheadAttention
    sdpa   the same projections in plain torch around F.scaled_dot_product_attention; it never
           returns attention weights, so it only runs where need_weights=False
    floor  (small_default, fast_path) only the GEMMs any implementation runs, on prepared inputs:
           floor/torch is the lowest ours/torch reachable on the machine (see gemm_floor); without
           weights the attention's least cost is added (attention_floor)
Case generation (whole cached generations through nn.Transformer's decoder) has its own peers:
    ours torchmha.CachedDecoder, hand a plain-PyTorch cache (HandCache), recompute the decoder over
    the whole prefix at every token; its floor is computed from each step's bytes and FLOPs

Writes benchmarks/results/<device>.json, <device>.md and the plots <device>_time_vs_len.png and
<device>_memory_vs_len.png, then prints the Markdown table. Times are medians of
torch.utils.benchmark blocked_autorange (the best of a few alternating rounds, see measure()).
The exit code is 0 even when targets miss: this is a report.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import benchmark
from tqdm import tqdm

import torchmha
from bench_decoding import streaming_rate  # the read rate bench_decoding.py's floor uses

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# The long-sequence setting (cases long_seq and seq_series): one sequence, small model, so the
# L x L attention dominates time and, unless it is never materialised, memory.
LONG_SEQ_MODEL = {"N": 1, "E": 256, "H": 4}
LONG_SEQ_TARGET_L = 8192
LONG_SEQ_MEMORY_LENGTHS = (4096, 8192)  # peak(8192) / peak(4096) ~ 2 means memory is linear in L
# The default call (need_weights=True) at a length where torch's per-head scores dominate memory.
DEFAULT_CALL_MODEL = {"N": 1, "L": 2048, "E": 512, "H": 8}

Peers = dict[str, Callable[[], object]]  # peer name -> a call that runs it once


# --------------------------------------------------------------------------- settings and results


@dataclass(frozen=True)
class Settings:
    device: str
    quick: bool

    @property
    def min_run_time(self) -> float:
        """Seconds of timing per peer in measure(), split over the rounds."""
        return 0.5 if self.quick else 2.0

    @property
    def rounds(self) -> int:
        """Alternating timing rounds per peer in measure()."""
        return 3 if self.quick else 5

    @property
    def series_lengths(self) -> tuple[int, ...]:
        return (1024, 4096, 8192) if self.quick else (512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Target:
    metric: str  # what is compared, e.g. "ours/torch"
    op: str  # "<=" or ">="
    threshold: float

    def holds(self, value: float) -> bool:
        return {"<=": operator.le, ">=": operator.ge}[self.op](value, self.threshold)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


@dataclass
class Row:
    case: str
    setting: str
    times_ms: dict[str, float] = field(default_factory=dict)  # median ms per peer that ran
    max_abs_diff: Optional[float] = None  # max |ours - torch| over outputs (and gradients)
    target: Optional[Target] = None
    value: Optional[float] = None  # the target's metric as measured; None = skipped
    notes: str = ""
    data: dict = field(default_factory=dict)  # case-specific numbers for the JSON and the plots
    limit: Optional[float] = None  # the best the target's metric can reach here, where not a GEMM floor

    @property
    def ratios(self) -> dict[str, float]:
        ours = self.times_ms.get("ours")
        return {f"ours/{peer}": ours / t for peer, t in self.times_ms.items() if peer not in ("ours", "floor") and ours}

    @property
    def floor_ratio(self) -> Optional[float]:
        """GEMM floor / torch where the case timed the floor (see gemm_floor): ours/torch cannot go
        much below it, so a target under it cannot hold on this machine. Rows whose metric is not a
        time ratio give their own limit (efficiency: the cap the softmax leaves)."""
        if self.limit is not None:
            return self.limit
        if "floor" not in self.times_ms or "torch" not in self.times_ms:
            return None
        return self.times_ms["floor"] / self.times_ms["torch"]

    @property
    def status(self) -> str:
        if self.target is None:
            return "-"
        if self.value is None:
            return "SKIP"
        return "PASS" if self.target.holds(self.value) else "MISS"

    def to_json(self) -> dict:
        result = asdict(self)
        result.update(target=str(self.target) if self.target else None, ratios=self.ratios, status=self.status,
                      floor_ratio=self.floor_ratio)
        return result


class Measured(NamedTuple):
    times_ms: dict[str, float]  # each peer's lowest median over the rounds
    max_abs_diff: float  # ours vs torch
    round_ratios: list[float]  # ours/torch within each round: their spread is this row's noise


def ratio_row(case: str, setting: str, measured: Measured, threshold: float, notes: str = "") -> Row:
    """The common row: target on ours / torch.nn.MultiheadAttention, with the spread of the
    per-round ratios in the notes (a target inside that spread is not decided by this run)."""
    times_ms, ratios = measured.times_ms, measured.round_ratios
    spread = f"rounds {min(ratios):.2f}-{max(ratios):.2f}"
    target = Target("ours/torch", "<=", threshold)
    return Row(case, setting, times_ms, measured.max_abs_diff, target, times_ms["ours"] / times_ms["torch"],
               f"{notes}; {spread}" if notes else spread, data={"round_ratios": ratios})


# --------------------------------------------------------------------------- shared helpers


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


def build_pair(E: int, H: int, *, batch_first: bool, device: str, dtype: torch.dtype = torch.float32,
               training: bool = False) -> tuple[nn.MultiheadAttention, torchmha.MultiheadAttention]:
    """torch's module and ours with identical weights, dropout 0, in train or eval mode."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, device=device, dtype=dtype).train(training)
    with torch.no_grad():  # torch initialises the biases to zero, which would hide bias bugs
        ref.in_proj_bias.normal_(std=0.1)
        ref.out_proj.bias.normal_(std=0.1)
    ours = torchmha.MultiheadAttention(E, H, batch_first=batch_first, device=device, dtype=dtype).train(training)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def sdpa_attention(module: nn.MultiheadAttention, x: Tensor) -> Tensor:
    """module(x, x, x, need_weights=False)[0] written in plain torch: packed in-projection,
    heads to (N, H, L, hd), F.scaled_dot_product_attention, heads merged, out-projection."""
    x_nle = x if module.batch_first else x.transpose(0, 1)
    N, L, E = x_nle.shape
    H = module.num_heads
    q, k, v = (
        F.linear(x_nle, module.in_proj_weight, module.in_proj_bias)
        .view(N, L, 3, H, E // H)
        .permute(2, 0, 3, 1, 4)  # (3, N, H, L, hd)
    )
    dropout_p = module.dropout if module.training else 0.0
    heads = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    out = F.linear(heads.transpose(1, 2).reshape(N, L, E), module.out_proj.weight, module.out_proj.bias)
    return out if module.batch_first else out.transpose(0, 1)


def self_attention_peers(ref: nn.MultiheadAttention, ours: nn.MultiheadAttention, x: Tensor, *,
                         need_weights: bool, no_grad: bool, with_floor: bool = False,
                         floor_bmm: bool = True) -> Peers:
    """One forward of self-attention on x for each peer (sdpa only when weights are not needed;
    the GEMM floor on request, with the two per-head bmm of the weights unless floor_bmm=False)."""
    peers: Peers = {
        "ours": lambda: ours(x, x, x, need_weights=need_weights),
        "torch": lambda: ref(x, x, x, need_weights=need_weights),
    }
    if not need_weights:
        peers["sdpa"] = lambda: sdpa_attention(ref, x)
    if with_floor:
        peers["floor"] = gemm_floor(ref, x, need_weights and floor_bmm)
    if no_grad:
        peers = {name: torch.no_grad()(fn) for name, fn in peers.items()}
    return peers


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


def inference_peers(N: int, L: int, E: int, H: int, *, device: str, dtype: torch.dtype = torch.float32,
                    batch_first: bool = True, need_weights: bool = False, with_floor: bool = False,
                    floor_bmm: bool = True) -> Peers:
    """Eval mode, torch.no_grad, self-attention on a fresh random (N, L, E) input."""
    ref, ours = build_pair(E, H, batch_first=batch_first, device=device, dtype=dtype)
    shape = (N, L, E) if batch_first else (L, N, E)
    x = torch.randn(shape, device=device, dtype=dtype)
    return self_attention_peers(ref, ours, x, need_weights=need_weights, no_grad=True, with_floor=with_floor,
                                floor_bmm=floor_bmm)


def attention_gflop(N: int, L: int, E: int) -> float:
    """Forward FLOPs of self-attention: QK^T and PV (4 N L^2 E) plus four E x E projections (8 N L E^2)."""
    return (4 * N * L**2 * E + 8 * N * L * E**2) / 1e9


# --------------------------------------------------------------------------- long-sequence measurements


def long_seq_peers(L: int, device: str) -> Peers:
    m = LONG_SEQ_MODEL
    return inference_peers(m["N"], L, m["E"], m["H"], device=device, batch_first=False)


@functools.lru_cache(maxsize=None)
def long_seq_times(L: int, settings: Settings) -> Measured:
    """Median ms per peer and max |ours - torch| at length L; cached so long_seq and seq_series share it."""
    return measure(long_seq_peers(L, settings.device), settings)


_peak_mib_cache: dict[tuple[str, str, int, Settings], float] = {}


def default_call_peers(L: int, device: str) -> Peers:
    """The call most code makes: need_weights=True (torch's default), eval, no_grad, (L, N, E)."""
    m = DEFAULT_CALL_MODEL
    return inference_peers(m["N"], L, m["E"], m["H"], device=device, batch_first=False, need_weights=True,
                           with_floor=True)


# The settings whose peak memory is measured in a child process: name -> peers at length L.
PEAK_MEMORY_SETTINGS: dict[str, Callable[[int, str], Peers]] = {
    "long_seq": long_seq_peers, "default_call": default_call_peers}


def long_seq_peak_mib(peer: str, lengths: tuple[int, ...], settings: Settings,
                      setting: str = "long_seq") -> dict[int, float]:
    """Peak memory one forward of `peer` adds at each length, in MiB. The lengths not measured yet
    go to one fresh child process (see peak_memory_child), so this process's own allocations and
    caches never count; results are cached so long_seq and seq_series share them."""
    missing = [L for L in lengths if (setting, peer, L, settings) not in _peak_mib_cache]
    if missing:
        env = dict(os.environ)
        # A fixed mmap threshold stops glibc from raising it dynamically and keeping freed buffers
        # in the heap, so the resident size follows the live tensors, also from one length to the next.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        spec = f"{setting}:{peer}:{','.join(map(str, missing))}"
        cmd = [sys.executable, __file__, "--device", settings.device, "--peak-memory-child", spec]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"peak-memory child {spec} failed:\n{done.stderr[-2000:]}")
        extra_bytes = json.loads(done.stdout.strip().splitlines()[-1])
        for L in missing:
            _peak_mib_cache[setting, peer, L, settings] = extra_bytes[str(L)] / 2**20
    return {L: _peak_mib_cache[setting, peer, L, settings] for L in lengths}


def read_proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_extra_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak memory fn() allocates beyond what is held when it starts."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline
    try:  # writing 5 to clear_refs resets the high-water mark VmHWM to the current VmRSS
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        baseline_kb = read_proc_status_kb("VmRSS")
    except OSError:  # no permission (or older kernel): count from the high-water mark so far
        baseline_kb = read_proc_status_kb("VmHWM")
    fn()
    return (read_proc_status_kb("VmHWM") - baseline_kb) * 1024


def peak_memory_child(spec: str, device: str) -> None:
    """Child-process side of long_seq_peak_mib. spec is SETTING:PEER:L1,L2,...; prints a JSON object
    {L: bytes} of the peak one forward adds over the module and its input, which are built first."""
    setting, peer, lengths = spec.split(":")
    peers_at = PEAK_MEMORY_SETTINGS[setting]
    peers_at(64, device)[peer]()  # one-time lazy set-up (thread pool, kernels) is not the forward's
    result = {}
    for L in map(int, lengths.split(",")):
        fn = peers_at(L, device)[peer]
        result[L] = peak_extra_bytes(fn, device)
        del fn  # drops this length's module and input before the next baseline
    print(json.dumps(result))


# --------------------------------------------------------------------------- cases

CASES: dict[str, Callable[[Settings], list[Row]]] = {}


def case(fn: Callable[[Settings], list[Row]]) -> Callable[[Settings], list[Row]]:
    """Registers a case under its function name, in definition order."""
    CASES[fn.__name__] = fn
    return fn


@case
def small_default(settings: Settings) -> list[Row]:
    """Overhead-bound default call: tiny input, need_weights=True, autograd on, (L, N, E) layout."""
    N, L, E, H = 1, 16, 256, 4
    ref, ours = build_pair(E, H, batch_first=False, device=settings.device)
    x = torch.randn(L, N, E, device=settings.device)
    rows = []
    for mode in ("train", "eval"):
        for module in (ref, ours):
            module.train(mode == "train")
        peers = self_attention_peers(ref, ours, x, need_weights=True, no_grad=False, with_floor=True)
        # Microseconds per call: more time, and three times the rounds, as a burst of other load
        # on the machine spoils a whole round and the target is a difference of two times.
        measured = measure(peers, settings, min_run_time=2 * settings.min_run_time, rounds=3 * settings.rounds)
        row = ratio_row("small_default", f"{mode}, N={N} L={L} E={E} H={H}, need_weights", measured, 0.5)
        if mode == "eval":  # the work around the GEMMs, as a share of torch's whole call
            times = measured.times_ms
            row.target = Target("(ours - floor)/torch", "<=", 0.15)
            row.value = (times["ours"] - times["floor"]) / times["torch"]
        rows.append(row)
    return rows


FAST_PATH_MARGIN = 0.05  # without weights, the target is the measured floor plus this (issue 26)


@case
def fast_path(settings: Settings) -> list[Row]:
    """torch's fused inference path: eval, no_grad, batch_first, self-attention. The floor column
    is the least any implementation pays here: the projections' GEMMs as timed, plus the
    attention's two products at torch.mm's rate and a softmax a score (attention_floor). With
    weights the target is 0.8 of torch; without, torch's fused kernel is already near that floor,
    so the target is the floor + 0.05, measured in the same run."""
    N, L, E, H = 8, 128, 512, 8
    rows = []
    for need_weights in (True, False):
        peers = inference_peers(N, L, E, H, device=settings.device, need_weights=need_weights, with_floor=True,
                                floor_bmm=False)
        setting = f"eval no_grad, N={N} L={L} E={E} H={H}, need_weights={need_weights}"
        row = ratio_row("fast_path", setting, measure(peers, settings), 0.8)
        attention_floor(row, N, L, E, H, settings)
        if not need_weights:
            row.target = Target("ours/torch", "<=", round(row.limit + FAST_PATH_MARGIN, 3))
        rows.append(row)
    return rows


def attention_floor(row: Row, N: int, L: int, E: int, H: int, settings: Settings) -> None:
    """Adds to the row's GEMM floor the least the attention itself costs: its two products at
    torch.mm's rate (a 2048^3 product, faster than any per-head one) and a softmax per score."""
    rate = mm_gflops(torch.float32, settings)
    softmax_ns = softmax_ns_per_score(settings)
    attention_ms = 1e3 * (4 * N * L * L * E / 1e9 / rate + N * H * L * L * softmax_ns * 1e-9)
    row.limit = (row.times_ms["floor"] + attention_ms) / row.times_ms["torch"]
    row.notes += (f"; floor = GEMMs {row.times_ms['floor'] / row.times_ms['torch']:.2f} + attention at torch.mm's "
                  f"{rate:.0f} GFLOP/s and {softmax_ns:.2f} ns a score of softmax")


@case
def default_call(settings: Settings) -> list[Row]:
    """need_weights=True, eval, no_grad: time, and the peak memory a forward adds (torch's holds the
    (N, H, L, S) scores; ours only the (N, L, S) weights it returns)."""
    m = DEFAULT_CALL_MODEL
    L = m["L"]
    model = f"N={m['N']} L={L} E={m['E']} H={m['H']}"
    time_row = ratio_row("default_call", f"eval no_grad, {model}, need_weights", measure(
        default_call_peers(L, settings.device), settings), 0.8)
    peak = {peer: long_seq_peak_mib(peer, (L,), settings, setting="default_call")[L] for peer in ("ours", "torch")}
    weights_mib = m["N"] * L * L * 4 / 2**20
    memory_row = Row(
        "default_call_memory", f"peak extra memory of one forward, {model}",
        target=Target("peak ours/peak torch", "<=", 0.3), value=peak["ours"] / peak["torch"],
        notes=f"ours {peak['ours']:.1f} MiB, torch {peak['torch']:.1f} MiB; the returned weights are {weights_mib:.0f} MiB",
        data={"peak_mib": peak},
    )
    return [time_row, memory_row]


@case
def train_step(settings: Settings) -> list[Row]:
    """Forward + backward of output.sum(); the diff covers the output and every gradient."""
    N, L, E, H = 8, 256, 512, 8
    ref, ours = build_pair(E, H, batch_first=True, device=settings.device, training=True)
    x = torch.randn(N, L, E, device=settings.device, requires_grad=True)  # as if from an earlier layer
    forwards = {
        "ours": lambda: ours(x, x, x, need_weights=False)[0],
        "torch": lambda: ref(x, x, x, need_weights=False)[0],
        "sdpa": lambda: sdpa_attention(ref, x),
    }

    def step(forward: Callable[[], Tensor], module: nn.Module) -> Callable[[], tuple]:
        leaves = [x, module.in_proj_weight, module.in_proj_bias, module.out_proj.weight, module.out_proj.bias]

        def run() -> tuple:
            for t in leaves:
                t.grad = None
            out = forward()
            out.sum().backward()
            return (out, *(t.grad for t in leaves))

        return run

    peers = {name: step(fwd, ours if name == "ours" else ref) for name, fwd in forwards.items()}
    setting = f"train fwd+bwd, N={N} L={L} E={E} H={H}, need_weights=False"
    rows = [ratio_row("train_step", setting, measure(peers, settings), 0.9, notes="diff: output and all gradients")]
    # The default call in training (weights returned and used, dropout 0): no target, for the record.
    with_weights = {
        "ours": lambda: (lambda o, w: o.sum() + w.sum())(*ours(x, x, x)),
        "torch": lambda: (lambda o, w: o.sum() + w.sum())(*ref(x, x, x)),
    }
    peers = {name: step(fwd, ours if name == "ours" else ref) for name, fwd in with_weights.items()}
    row = ratio_row("train_step", f"train fwd+bwd, N={N} L={L} E={E} H={H}, need_weights (loss uses both)",
                    measure(peers, settings), 0.9, notes="diff: loss and all gradients")
    row.target = row.value = None
    rows.append(row)
    return rows


@case
def long_seq(settings: Settings) -> list[Row]:
    """One long sequence: time at L=8192, and whether ours' peak memory grows linearly in L."""
    m, L = LONG_SEQ_MODEL, LONG_SEQ_TARGET_L
    model = f"N={m['N']} E={m['E']} H={m['H']}"
    time_row = ratio_row("long_seq", f"eval no_grad, L={L} {model}, need_weights=False", long_seq_times(L, settings), 1.0)

    short, long = LONG_SEQ_MEMORY_LENGTHS
    peak_short, peak_long = long_seq_peak_mib("ours", LONG_SEQ_MEMORY_LENGTHS, settings).values()
    memory_row = Row(
        "long_seq_memory", f"ours' peak extra memory, L={short} vs {long}, {model}",
        target=Target(f"peak({long})/peak({short})", "<=", 2.2), value=peak_long / peak_short,
        notes=f"ours {peak_short:.1f} MiB at L={short}, {peak_long:.1f} MiB at L={long}",
        data={"peak_mib": {short: peak_short, long: peak_long}},
    )
    return [time_row, memory_row]


@case
def bf16_inference(settings: Settings) -> list[Row]:
    N, L, E, H = 4, 1024, 512, 8
    peers = inference_peers(N, L, E, H, device=settings.device, dtype=torch.bfloat16)
    setting = f"bfloat16 eval no_grad, N={N} L={L} E={E} H={H}, need_weights=False"
    return [ratio_row("bf16_inference", setting, measure(peers, settings), 1.0)]


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


@case
def seq_series(settings: Settings) -> list[Row]:
    """Time and peak memory against L for the plots; rows without targets."""
    m = LONG_SEQ_MODEL
    lengths = settings.series_lengths
    peak_mib = {peer: long_seq_peak_mib(peer, lengths, settings) for peer in ("ours", "torch", "sdpa")}
    rows = []
    for L in tqdm(lengths, desc="seq_series lengths", leave=False):
        times, diff, _ = long_seq_times(L, settings)
        peaks = {peer: by_length[L] for peer, by_length in peak_mib.items()}
        notes = "peak MiB: " + ", ".join(f"{peer} {mb:.1f}" for peer, mb in peaks.items())
        setting = f"L={L} N={m['N']} E={m['E']} H={m['H']}"
        rows.append(Row("seq_series", setting, times, diff, notes=notes, data={"L": L, "peak_mib": peaks}))
    return rows


# --------------------------------------------------------------------------- cached generation

# nn.Transformer's decoder as issue 25 item 9 sets it; S = the memory's positions.
GENERATION_MODEL = {"E": 512, "H": 8, "layers": 6, "ff": 2048, "S": 64}
# (dtype, batch, prompt, new tokens); --quick generates a quarter of the new tokens.
GENERATION_SETTINGS = (
    (torch.float32, 1, 16, 256), (torch.float32, 8, 16, 128),
    (torch.float32, 1, 1024, 64), (torch.bfloat16, 1, 16, 64),
)
GENERATION_FLOOR_TARGET = {torch.float32: 0.6, torch.bfloat16: 0.5}  # floor/ours >=


def generation_model(dtype: torch.dtype, device: str) -> nn.Transformer:
    """nn.Transformer (post-norm, relu, dropout 0) in eval; one encoder layer, as only the decoder runs."""
    m = GENERATION_MODEL
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

    def __init__(self, model: nn.Transformer, batch: int, max_length: int, memory: Tensor):
        self.H, self.length = model.nhead, 0
        self.weights = [self._layer_weights(layer) for layer in model.decoder.layers]
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

    def step(self, x: Tensor) -> Tensor:
        """Appends x (T, N, E) and returns the decoder's output there."""
        h = x.transpose(0, 1)  # (N, T, E), the layout the heads split from
        for w, keys, values, memory_kv in zip(self.weights, self.keys, self.values, self.memory_kv):
            h = self._norm(h + self._self_attention(w, h, keys, values), *w["norm1"])
            h = self._norm(h + self._cross_attention(w, h, memory_kv), *w["norm2"])
            h = self._norm(h + F.linear(F.relu(F.linear(h, *w["linear1"])), *w["linear2"]), *w["norm3"])
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


def generation_floor_ms(model: nn.Transformer, N: int, P: int, G: int, read_bytes_s: float,
                        mm_gflop_s: float) -> float:
    """The sum over steps of the longer of reading the step's bytes and running its GEMM FLOPs."""
    work = [step_work(model, N, position, T) for position, T in generation_steps(P, G)]
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
    floor_notes = (f"floor {m.floor_ms:.0f} ms: per step max(bytes / {m.read_gb_s:.1f} GB/s read, "
                   f"GEMM FLOPs / {m.mm_gflop_s:.0f} GFLOP/s torch.mm), summed over the prefill and {G} tokens")
    rows.append(Row("generation_floor", setting, {"ours": t["ours"], "floor": m.floor_ms}, m.diffs["ours"],
                    Target("floor/ours", ">=", GENERATION_FLOOR_TARGET[dtype]), floor_of_ours, floor_notes, data))
    if N == 1 and G == 256:  # issue 25: the cache must pay off 10x on a long batch-1 generation
        rows.append(Row("generation_recompute", setting, {"ours": t["ours"], "recompute": t["recompute"]},
                        m.diffs["ours"], Target("recompute/ours", ">=", 10), recompute_of_ours, data=data))
    return rows


@case
def generation(settings: Settings) -> list[Row]:
    """Whole generations (prefill + every new token) through nn.Transformer's decoder, issue 25
    item 9: torchmha.CachedDecoder against the cache a user writes by hand and against
    recomputing the prefix, and against a floor from what each step must read and compute."""
    mm_rates: dict[torch.dtype, float] = {}
    rows = []
    for dtype, N, P, G in tqdm(GENERATION_SETTINGS, desc="generation settings", leave=False):
        G = G // 4 if settings.quick else G
        if dtype not in mm_rates:
            mm_rates[dtype] = mm_gflops(dtype, settings)
        rows += generation_rows(dtype, N, P, G, measure_generation(settings, dtype, N, P, G, mm_rates[dtype]))
    return rows


def find_cpp_benchmark() -> Optional[Path]:
    candidates = [os.environ.get("TORCHMHA_BENCH_CPP")]
    if os.environ.get("TORCHMHA_BUILD_DIR"):  # set by the Makefile
        candidates.append(os.path.join(os.environ["TORCHMHA_BUILD_DIR"], "bench_cpp"))
    candidates.append(str(REPO_ROOT / "build" / "bench_cpp"))
    return next((Path(c) for c in candidates if c and os.access(c, os.X_OK)), None)


@case
def cpp(settings: Settings) -> list[Row]:
    """benchmarks/bench_cpp.cpp: torchmha's C++ module against LibTorch's torch::nn::MultiheadAttention."""
    setting = "C++, eval NoGradGuard, N=1 L=1024 E=512 H=8; ours need_weights=False, LibTorch's always builds weights"
    target = Target("ours/torch", "<=", 0.7)
    binary = find_cpp_benchmark()
    if binary is None:
        return [Row("cpp", setting, target=target,
                    notes="skipped: no bench_cpp binary (build with -DTORCHMHA_BUILD_BENCHMARKS=ON "
                          "or set TORCHMHA_BENCH_CPP)")]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS_DIR / f"{settings.device}_cpp.tmp"
    repeats = "10" if settings.quick else "50"
    done = subprocess.run([str(binary), str(json_path), settings.device, repeats], capture_output=True, text=True)
    if done.returncode != 0:  # e.g. a CPU-only LibTorch asked for cuda: report it, keep the other rows
        return [Row("cpp", setting, target=target, notes=f"failed: {binary}: {done.stderr.strip()[-300:]}")]
    result = json.loads(json_path.read_text())
    json_path.unlink()
    times = {"ours": result["ours_ms"], "torch": result["libtorch_ms"]}
    return [Row("cpp", setting, times, result["max_abs_diff"], target, result["ratio"],
                notes="torch = LibTorch torch::nn::MultiheadAttention")]


# --------------------------------------------------------------------------- report


def machine_info(device: str) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.strip()
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchmha": torchmha.__version__,
        "git": commit,
        # Other work on the machine skews every timing; the load average shows how much there was.
        "load_average_1_5_15min": [round(load, 2) for load in os.getloadavg()],
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def fmt(value: Optional[float], spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if spec == "ms":  # milliseconds: three significant figures without scientific notation
        return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.3f}"
    return format(value, spec)


def markdown_table(rows: list[Row]) -> str:
    columns = ["case", "setting", "ours ms", "torch ms", "sdpa ms", "ours/torch", "ours/sdpa", "floor",
               "max abs diff", "target", "measured", "result", "notes"]
    lines = ["| " + " | ".join(columns) + " |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for row in rows:
        t, r = row.times_ms, row.ratios
        cells = [
            row.case, row.setting, fmt(t.get("ours"), "ms"), fmt(t.get("torch"), "ms"), fmt(t.get("sdpa"), "ms"),
            fmt(r.get("ours/torch"), ".2f"), fmt(r.get("ours/sdpa"), ".2f"), fmt(row.floor_ratio, ".2f"),
            fmt(row.max_abs_diff, ".1e"),
            str(row.target or "-"), fmt(row.value, ".3f"), row.status, row.notes,
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |")
    return "\n".join(lines)


def targets_summary(rows: list[Row]) -> str:
    with_target = [row for row in rows if row.target is not None]
    measured = [row for row in with_target if row.status != "SKIP"]
    held = [row for row in measured if row.status == "PASS"]
    skipped = len(with_target) - len(measured)
    lines = [f"Targets held: {len(held)} of {len(measured)}" + (f" ({skipped} skipped)" if skipped else "")]
    for row in with_target:
        floor = f" (floor {row.floor_ratio:.3f})" if row.floor_ratio is not None else ""
        lines.append(f"- {row.status} {row.case} ({row.setting}): {row.target}, measured {fmt(row.value, '.3f')}{floor}")
    return "\n".join(lines)


def plot_series(rows: list[Row], device: str, stem: str) -> list[Path]:
    """<stem>_time_vs_len.png and <stem>_memory_vs_len.png from the seq_series rows (none if that
    case did not run)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    series = [row for row in rows if row.case == "seq_series"]
    if not series:
        return []
    lengths = [row.data["L"] for row in series]
    m = LONG_SEQ_MODEL
    title = f"{device}: N={m['N']} E={m['E']} H={m['H']}, eval no_grad, need_weights=False"
    labels = {"ours": "torchmha", "torch": "torch.nn.MultiheadAttention", "sdpa": "plain torch + SDPA"}
    paths = []
    for kind, ylabel, values_of in (
        ("time", "forward time (ms, median)", lambda row: row.times_ms),
        ("memory", "peak extra memory (MiB)", lambda row: row.data["peak_mib"]),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for peer, label in labels.items():
            ax.plot(lengths, [values_of(row)[peer] for row in series], marker="o", label=label)
        # log-log, so quadratic and linear growth show as slopes 2 and 1; plain numbers on the ticks
        ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel=ylabel, title=title)
        ax.xaxis.set_major_locator(ticker.FixedLocator(lengths))
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_locator(ticker.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = RESULTS_DIR / f"{stem}_{kind}_vs_len.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(rows: list[Row], info: dict, settings: Settings, cases: list[str], wall_s: float,
                 case_seconds: dict[str, float]) -> str:
    """Writes <device>.md, <device>.json and the plots; returns the table and the targets summary.
    A --cases subset writes <device>_partial.* instead, so it never overwrites a whole run's report."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    device = settings.device
    stem = device if cases == list(CASES) else f"{device}_partial"
    table_and_summary = markdown_table(rows) + "\n\n" + targets_summary(rows)
    plots = plot_series(rows, device, stem)
    header = (
        f"# torchmha benchmarks: {device} ({'--quick' if settings.quick else 'full'})\n\n"
        + "\n".join(f"- {key}: {value}" for key, value in info.items())
        + f"\n- wall time: {wall_s:.0f} s\n\n"
        "Times are medians in ms; ratios are ours / peer (lower is faster). "
        "max abs diff = max |ours - torch.nn.MultiheadAttention| of the outputs.\n\n"
    )
    images = "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
    (RESULTS_DIR / f"{stem}.md").write_text(header + table_and_summary + "\n" + images)
    report = {
        "machine": info,
        "settings": {"device": device, "quick": settings.quick, "cases": cases, "rounds": settings.rounds,
                     "min_run_time_s": settings.min_run_time, "series_lengths": list(settings.series_lengths)},
        "wall_time_s": wall_s,
        "case_seconds": case_seconds,
        "rows": [row.to_json() for row in rows],
        "plots": [str(p.relative_to(REPO_ROOT)) for p in plots],
    }
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    return table_and_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings and fewer series points")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(CASES)}")
    parser.add_argument("--peak-memory-child", help=argparse.SUPPRESS)  # internal: SETTING:PEER:L1,L2,..
    args = parser.parse_args()

    if args.peak_memory_child:
        peak_memory_child(args.peak_memory_child, args.device)
        return

    selected = args.cases.split(",") if args.cases else list(CASES)
    unknown = [name for name in selected if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False")

    settings = Settings(device=args.device, quick=args.quick)
    info = machine_info(args.device)  # before the cases, so the load average is other work's, not ours
    started = time.perf_counter()
    rows: list[Row] = []
    case_seconds = {}  # where the wall time goes, for whoever tunes --quick
    progress = tqdm(selected, desc="cases", unit="case")
    for name in progress:
        progress.set_postfix_str(name)
        case_started = time.perf_counter()
        rows.extend(CASES[name](settings))
        case_seconds[name] = round(time.perf_counter() - case_started, 1)
    wall_s = time.perf_counter() - started

    print("\n" + write_report(rows, info, settings, selected, wall_s, case_seconds))
    print(f"\nwall time {wall_s:.0f} s; results in {RESULTS_DIR.relative_to(REPO_ROOT)}/")

if __name__ == "__main__":
    main()
