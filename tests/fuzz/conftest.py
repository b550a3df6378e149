"""The fuzz harness's hypothesis profiles live in ``fuzzing.py``; this reports the case count."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

import fuzzing  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if fuzzing.CASES["count"]:
        terminalreporter.write_line(
            f"fuzz ({fuzzing.PROFILE} profile): {fuzzing.CASES['count']} cases run"
        )


def pytest_collection_modifyitems(config, items):
    """The long profile runs one test for many minutes: no per-test timeout there (the suite's
    ``timeout = 600`` still bounds the ci profile)."""
    if fuzzing.PROFILE != "long":
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(0))
