"""The report: the machine's description, the Markdown table, the targets summary, the plots and
results/<stem>.md / .json."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import torchmha

from .core import REPO_ROOT, RESULTS_DIR, Row, Settings
from .registry import CASES, PLOTS


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


def plot_vs_length(rows: list[Row], stem: str, title: str, labels: dict[str, str],
                   panels: list[tuple[str, str, Callable[[Row], dict[str, float]]]]) -> list[Path]:
    """One log-log figure per panel (kind, y label, row -> value per peer) against row.data["L"],
    a line per peer in `labels`, written to results/<stem>_<kind>_vs_len.png."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    lengths = [row.data["L"] for row in rows]
    paths = []
    for kind, ylabel, values_of in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        for peer, label in labels.items():
            ax.plot(lengths, [values_of(row)[peer] for row in rows], marker="o", label=label)
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
    plots = [path for plot in PLOTS for path in plot(rows, device, stem)]
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
