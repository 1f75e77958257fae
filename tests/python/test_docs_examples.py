"""Every ```python block of README.md and docs/**/*.md runs as written, alone, in a fresh namespace,
so an example cannot drift from the API (nor use a name it never defines). The blocks use small
sizes, so the whole module takes a few seconds. A failure names the block as `README.md:75`, the
line of its opening fence: line k of the traceback is line 75 + k of the file."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks():
    """(path relative to the repository root, line of the opening fence, source) of each block."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for file in files:
        text = file.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            yield file.relative_to(ROOT).as_posix(), line, match.group(1)


BLOCKS = list(python_blocks())


def test_readme_has_python_blocks():
    # Guards the collection itself: a changed fence or a moved README would otherwise pass vacuously.
    assert sum(path == "README.md" for path, _, _ in BLOCKS) >= 5


@pytest.mark.parametrize("path, line, source", BLOCKS, ids=[f"{path}:{line}" for path, line, _ in BLOCKS])
def test_python_block_runs(path, line, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks may write files (the checkpoint example does)
    exec(compile(source, f"{path}:{line}", "exec"), {"__name__": "__docs_example__"})
