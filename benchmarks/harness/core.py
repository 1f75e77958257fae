"""The benchmark's data: Settings (one run's timing budget), Target, Row (one line of the report),
Measured (what measure() returns), the common ratio row, and the paths every module writes to."""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional

BENCH_DIR = Path(__file__).resolve().parent.parent  # benchmarks/
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
RUN_PY = BENCH_DIR / "run.py"  # the entry point; the peak-memory child re-runs it

Peers = dict[str, Callable[[], object]]  # peer name -> a call that runs it once


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
        """GEMM floor / torch where the case timed the floor (see floors.gemm_floor): ours/torch
        cannot go much below it, so a target under it cannot hold on this machine. Rows whose
        metric is not a time ratio give their own limit (efficiency: the cap the softmax leaves)."""
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
