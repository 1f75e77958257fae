"""seq_series: time and peak memory against the sequence length, in long_seq's setting, for the
plots results/<device>_time_vs_len.png and <device>_memory_vs_len.png."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from cases.attention import LONG_SEQ_MODEL, long_seq_times
from harness import Row, Settings, case, peak_mib, plot, plot_vs_length


@case
def seq_series(settings: Settings) -> list[Row]:
    """Time and peak memory against L for the plots; rows without targets."""
    m = LONG_SEQ_MODEL
    lengths = settings.series_lengths
    peak_by_peer = {peer: peak_mib("long_seq", peer, lengths, settings) for peer in ("ours", "torch", "sdpa")}
    rows = []
    for L in tqdm(lengths, desc="seq_series lengths", leave=False):
        times, diff, _ = long_seq_times(L, settings)
        peaks = {peer: by_length[L] for peer, by_length in peak_by_peer.items()}
        notes = "peak MiB: " + ", ".join(f"{peer} {mb:.1f}" for peer, mb in peaks.items())
        setting = f"L={L} N={m['N']} E={m['E']} H={m['H']}"
        rows.append(Row("seq_series", setting, times, diff, notes=notes, data={"L": L, "peak_mib": peaks}))
    return rows


@plot
def seq_series_plots(rows: list[Row], device: str, stem: str) -> list[Path]:
    """<stem>_time_vs_len.png and <stem>_memory_vs_len.png from the seq_series rows (none if that
    case did not run)."""
    series = [row for row in rows if row.case == "seq_series"]
    if not series:
        return []
    m = LONG_SEQ_MODEL
    title = f"{device}: N={m['N']} E={m['E']} H={m['H']}, eval no_grad, need_weights=False"
    labels = {"ours": "torchmha", "torch": "torch.nn.MultiheadAttention", "sdpa": "plain torch + SDPA"}
    return plot_vs_length(series, stem, title, labels, [
        ("time", "forward time (ms, median)", lambda row: row.times_ms),
        ("memory", "peak extra memory (MiB)", lambda row: row.data["peak_mib"]),
    ])
