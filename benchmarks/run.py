"""torchmha benchmark suite: torchmha.MultiheadAttention against torch.nn.MultiheadAttention and a
plain-torch SDPA implementation of the same math, case by case, each with a target.

    python benchmarks/run.py --quick                  # 2-4 min on 2 CPU cores
    python benchmarks/run.py --device cuda            # full run on a GPU
    python benchmarks/run.py --quick --cases fast_path,train_step

The harness (timing, peers, floors, peak memory, report) is in benchmarks/harness/, the cases in
benchmarks/cases/ (one module per family); benchmarks/README.md describes peers, floors and targets.
Writes benchmarks/results/<device>.json, <device>.md and the plots <device>_time_vs_len.png and
<device>_memory_vs_len.png (<device>_partial.* with --cases), then prints the Markdown table.
The exit code is 0 even when targets miss: this is a report.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # harness, cases and bench_decoding live beside this file
    sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from harness import CASES, REPO_ROOT, RESULTS_DIR, Row, Settings, machine_info, peak_memory_child, write_report  # noqa: E402

importlib.import_module("cases")  # registers every case, in run order (benchmarks/cases/__init__.py)


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
