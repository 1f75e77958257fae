"""Peak memory of one forward, each peer in a fresh child process (run.py --peak-memory-child), so
this process's own allocations and caches never count. A case names the peers it measures with
@peak_memory_setting("name"): a function (L, device) -> Peers; peak_mib asks the child for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

import torch

from .core import RUN_PY, Peers, Settings

# The settings whose peak memory is measured in a child process: name -> peers at length L.
PEAK_MEMORY_SETTINGS: dict[str, Callable[[int, str], Peers]] = {}

_peak_mib_cache: dict[tuple[str, str, int, Settings], float] = {}


def peak_memory_setting(name: str) -> Callable[[Callable[[int, str], Peers]], Callable[[int, str], Peers]]:
    """Registers a function (L, device) -> Peers under `name`, for peak_mib and the child."""
    def register(peers_at: Callable[[int, str], Peers]) -> Callable[[int, str], Peers]:
        PEAK_MEMORY_SETTINGS[name] = peers_at
        return peers_at
    return register


def peak_mib(setting: str, peer: str, lengths: tuple[int, ...], settings: Settings) -> dict[int, float]:
    """Peak memory one forward of `peer` adds at each length, in MiB. The lengths not measured yet
    go to one fresh child process (see peak_memory_child); results are cached, so cases sharing a
    setting (long_seq and seq_series) share them."""
    missing = [L for L in lengths if (setting, peer, L, settings) not in _peak_mib_cache]
    if missing:
        env = dict(os.environ)
        # A fixed mmap threshold stops glibc from raising it dynamically and keeping freed buffers
        # in the heap, so the resident size follows the live tensors, also from one length to the next.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        spec = f"{setting}:{peer}:{','.join(map(str, missing))}"
        cmd = [sys.executable, str(RUN_PY), "--device", settings.device, "--peak-memory-child", spec]
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
    """Child-process side of peak_mib. spec is SETTING:PEER:L1,L2,...; prints a JSON object
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
