"""The case registry. @case registers a function Settings -> list[Row] under its name, in the
order the case modules are imported (benchmarks/cases/__init__.py sets that order); @plot
registers a function (rows, device, stem) -> list of written image paths, called by the report."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .core import Row, Settings

Case = Callable[[Settings], list[Row]]
Plot = Callable[[list[Row], str, str], list[Path]]

CASES: dict[str, Case] = {}
PLOTS: list[Plot] = []


def case(fn: Case) -> Case:
    """Registers a case under its function name."""
    if fn.__name__ in CASES:
        raise ValueError(f"two cases named {fn.__name__}")
    CASES[fn.__name__] = fn
    return fn


def plot(fn: Plot) -> Plot:
    """Registers a plot: fn(rows, device, stem) writes results/<stem>_*.png from the rows it wants
    (none when its case did not run) and returns the paths."""
    PLOTS.append(fn)
    return fn
