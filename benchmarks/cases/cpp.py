"""cpp: benchmarks/bench_cpp.cpp, torchmha's C++ module against LibTorch's, run as a binary."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Optional

from harness import REPO_ROOT, RESULTS_DIR, Row, Settings, Target, case


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
