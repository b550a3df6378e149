"""The Makefile's install stamp: a different TORCH (or a newer pyproject.toml) reinstalls.

Runs make on the repository's Makefile with a throw-away VENV whose python is a stub, so no
package is installed: only what make decides, and what the stamp records, are checked.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE_VARIABLES = ("PYTHON", "VENV", "TORCH", "CONSTRAINTS")

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or not (ROOT / "Makefile").is_file(),
    reason="needs make and the repository's Makefile",
)


def _make(venv: Path, *args: str) -> subprocess.CompletedProcess:
    # Not the variables of a make that runs this suite (`make test CONSTRAINTS=...` in CI):
    # make hands its command-line variables to the makes below it through MAKEFLAGS and puts
    # them in their environment, where `CONSTRAINTS ?=` would take them.
    inherited = {"MAKEFLAGS", "MAKEOVERRIDES", "MFLAGS", "MAKELEVEL", *MAKEFILE_VARIABLES}
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", "PYTHON=true", *args],
        capture_output=True,
        text=True,
        env=env,
    )


@pytest.fixture
def venv(tmp_path):
    """A VENV whose bin/python accepts any command and does nothing."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    return venv


def _stamp(venv: Path) -> Path:
    return venv / "bin" / ".vidsparse-installed"


def _up_to_date(venv: Path, torch: str) -> bool:
    proc = _make(venv, "-q", f"TORCH={torch}", str(_stamp(venv)))
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


def test_stamp_records_torch_and_a_new_torch_reinstalls(venv):
    stamp = _stamp(venv)
    assert not _up_to_date(venv, "torch==2.13.0")  # no install yet
    proc = _make(venv, "TORCH=torch==2.13.0", str(stamp))
    assert proc.returncode == 0, proc.stderr
    assert stamp.read_text() == "torch==2.13.0\n"
    assert _up_to_date(venv, "torch==2.13.0")
    assert not _up_to_date(venv, "torch")

    # The dry run of `make demo` shows the install with the new TORCH, and none with the old.
    new = _make(venv, "-n", "demo", "TORCH=torch").stdout
    assert 'pip install -q --upgrade "torch" -e' in new
    same = _make(venv, "-n", "demo", "TORCH=torch==2.13.0").stdout
    assert "pip install" not in same and "vidsparse demo" in same

    proc = _make(venv, "TORCH=torch", str(stamp))
    assert proc.returncode == 0, proc.stderr
    assert stamp.read_text() == "torch\n"
    assert _up_to_date(venv, "torch") and not _up_to_date(venv, "torch==2.13.0")


def test_an_empty_stamp_or_a_newer_pyproject_reinstalls(venv):
    stamp = _stamp(venv)
    newer = (ROOT / "pyproject.toml").stat().st_mtime + 60
    stamp.write_text("")  # an older Makefile's stamp: which torch is unknown
    os.utime(stamp, (newer, newer))
    assert not _up_to_date(venv, "torch==2.13.0")

    stamp.write_text("torch==2.13.0\n")
    os.utime(stamp, (newer, newer))
    assert _up_to_date(venv, "torch==2.13.0")
    older = newer - 3600
    os.utime(stamp, (older, older))
    assert not _up_to_date(venv, "torch==2.13.0")


def test_constraints_are_used_recorded_and_a_newer_file_reinstalls(venv, tmp_path):
    """CI's toolchains: CONSTRAINTS goes to pip as -c, the stamp records it with TORCH, and
    another value or a newer constraints file reinstalls."""
    stamp = _stamp(venv)
    pins = tmp_path / "pins.txt"
    pins.write_text("triton==3.6.0\n")
    args = ("TORCH=torch==2.13.0", f"CONSTRAINTS={pins}")
    dry = _make(venv, "-n", "install", *args).stdout
    assert f'pip install -q --upgrade -c "{pins}" "torch==2.13.0" -e ".[test]"' in dry
    proc = _make(venv, "install", *args)
    assert proc.returncode == 0, proc.stderr
    assert stamp.read_text() == f"torch==2.13.0 {pins}\n"
    assert _make(venv, "-q", *args, str(stamp)).returncode == 0  # up to date
    assert _make(venv, "-q", "TORCH=torch==2.13.0", str(stamp)).returncode == 1  # no constraints
    newer = stamp.stat().st_mtime + 60
    os.utime(pins, (newer, newer))
    assert _make(venv, "-q", *args, str(stamp)).returncode == 1  # the file changed


def test_ci_runs_make_test_on_both_toolchains():
    """.ci/run: `make test` (the README's command) with each toolchain's constraints file."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "make test" in script
    for name in ("triton3.6", "newest"):
        path = ROOT / ".ci" / f"constraints-{name}.txt"
        assert f"CONSTRAINTS=.ci/constraints-{name}.txt" in script
        pins = [line for line in path.read_text().splitlines() if line and line[0] != "#"]
        assert pins and all("==" in pin or "<" in pin for pin in pins), pins  # pins, not ranges
        # every pin says why: a comment right above it
        lines = path.read_text().splitlines()
        for pin in pins:
            assert lines[lines.index(pin) - 1].startswith("#"), pin
