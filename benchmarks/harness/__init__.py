"""The benchmark harness: what every case uses, so a case module imports from here only.

    core      Settings, Target, Row, Measured, ratio_row, Peers, the paths
    timing    median_ms, measure, timed_rounds, max_abs_diff
    floors    mm_gflops, softmax_ns_per_score, streaming_rate, gemm_floor
    peers     build_pair, sdpa_attention, self_attention_peers, inference_peers
    memory    peak memory in a child process (peak_mib, @peak_memory_setting, the child's side)
    registry  CASES and @case, PLOTS and @plot
    report    machine_info, the Markdown table, the targets summary, plots, results/<stem>.md/.json

benchmarks/ must be on sys.path (run.py puts it there): the harness imports bench_decoding.
"""

from .core import BENCH_DIR, REPO_ROOT, RESULTS_DIR, Measured, Peers, Row, Settings, Target, ratio_row
from .floors import gemm_floor, mm_gflops, softmax_ns_per_score, streaming_rate
from .memory import peak_memory_child, peak_memory_setting, peak_mib
from .peers import build_pair, inference_peers, sdpa_attention, self_attention_peers
from .registry import CASES, PLOTS, case, plot
from .report import machine_info, plot_vs_length, write_report
from .timing import max_abs_diff, measure, median_ms, timed_rounds

__all__ = [
    "BENCH_DIR", "REPO_ROOT", "RESULTS_DIR", "Measured", "Peers", "Row", "Settings", "Target", "ratio_row",
    "gemm_floor", "mm_gflops", "softmax_ns_per_score", "streaming_rate",
    "peak_memory_child", "peak_memory_setting", "peak_mib",
    "build_pair", "inference_peers", "sdpa_attention", "self_attention_peers",
    "CASES", "PLOTS", "case", "plot",
    "machine_info", "plot_vs_length", "write_report",
    "max_abs_diff", "measure", "median_ms", "timed_rounds",
]
