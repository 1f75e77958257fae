"""The examples run as written: examples/generate.py with tiny sizes (same tokens with and without
the cache, a plot written), so it cannot drift from the API. The code blocks of README.md
and docs/: test_docs_examples.py."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # spawns a Python process (a few seconds, most of it importing torch)
def test_generate_example_runs_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "g.png"
    command = [sys.executable, str(ROOT / "examples" / "generate.py"), "--d-model", "32", "--heads", "4",
               "--layers", "2", "--vocab", "50", "--source-length", "5", "--new-tokens", "6", "--beam", "2",
               "--plot", str(plot)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    print(result.stdout, result.stderr, sep="\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "same tokens both ways" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
