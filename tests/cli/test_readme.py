"""The README's snippets run as written: the `Use` block (engine, VSA, PSA, STA) on CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(heading: str) -> str:
    text = README.read_text()
    match = re.search(rf"^## {re.escape(heading)}\n.*?```python\n(.*?)```", text, re.S | re.M)
    assert match, f"no python block under '## {heading}' in README.md"
    return match.group(1)


@pytest.mark.slow
def test_use_snippet_runs_as_written(tmp_path):
    """In a fresh interpreter, as a user pastes it (the default backend: PyTorch on a CPU)."""
    script = tmp_path / "use.py"
    script.write_text(_block("Use") + "\nprint('ok', tuple(o.shape))\n")
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("ok (1, 2, 2304, 64)")


def test_readme_starts_with_the_two_make_commands():
    first_block = README.read_text().split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
