"""atomic_write: files get the mode a plain open() would leave (umask honoured)."""

import os
import stat

import pytest

from vidsparse.utils import files
from vidsparse.utils.files import atomic_write


@pytest.fixture
def umask():
    """Set the process umask for one test, restoring the old one after it."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _write(path, data=b"x"):
    atomic_write(path, lambda f: f.write(data))


@pytest.mark.parametrize(("mask", "want"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_honours_the_umask(tmp_path, umask, mask, want):
    umask(mask)
    path = tmp_path / "out.bin"
    _write(path)
    assert _mode(path) == want
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"x")
    assert _mode(plain) == want  # what a plain open() leaves
    assert path.read_bytes() == b"x"


def test_existing_file_keeps_its_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    _write(path, b"new")
    assert _mode(path) == 0o640
    assert path.read_bytes() == b"new"


def test_umask_without_proc(monkeypatch, umask):
    """Where /proc is missing, the umask is read through os.umask and left as it was."""
    umask(0o027)

    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/self/status")

    monkeypatch.setattr(files, "open", no_proc, raising=False)
    assert files._umask() == 0o027
    assert os.umask(0o027) == 0o027  # unchanged by the read


# --------------------------------------------------------------------------- interrupted writes


def test_temporaries_name_their_writer(tmp_path, monkeypatch):
    seen = []
    real = files.tempfile.mkstemp

    def spy(**kwargs):
        fd, name = real(**kwargs)
        seen.append(os.path.basename(name))
        return fd, name

    monkeypatch.setattr(files.tempfile, "mkstemp", spy)
    _write(tmp_path / "plan.json")
    assert seen[0].startswith(f".plan.json.{files._HOST}-{os.getpid()}.")
    assert files._TEMP_TAIL.fullmatch(seen[0][len(".plan.json.") :])


def _dead_pid() -> int:
    """A pid no process has (one of a child that has exited and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    """SIGKILL during save_plan left .plan.json.*.tmp files (4 of 12 kills): the next save of
    that plan removes them, and only them."""
    target = tmp_path / "plan.json"
    dead = tmp_path / f".plan.json.{files._HOST}-{_dead_pid()}.abcd1234.tmp"
    dead.write_bytes(b"half a plan")
    _write(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_live_writers_and_other_targets_are_left_alone(tmp_path):
    target = tmp_path / "plan.json"
    live = [
        tmp_path / f".plan.json.{files._HOST}-{os.getpid()}.abcd1234.tmp",  # another thread
        tmp_path / f".plan.json.{files._HOST}-1.abcd1234.tmp",  # pid 1: alive
        tmp_path / f".plan.json.otherhost-{_dead_pid()}.abcd1234.tmp",  # not ours to judge
        tmp_path / ".plan.json.abcd1234.tmp",  # an older vidsparse's, recent
        tmp_path / f".plan.json.b.{files._HOST}-{_dead_pid()}.abcd1234.tmp",  # plan.json.b's
        tmp_path / f".other.json.{files._HOST}-{_dead_pid()}.abcd1234.tmp",
        tmp_path / ".plan.json.notes.txt",
    ]
    for p in live:
        p.write_bytes(b"x")
    _write(target)
    assert sorted(os.listdir(tmp_path)) == sorted(["plan.json", *(p.name for p in live)])


def test_old_temporaries_without_a_live_owner_go_after_a_day(tmp_path):
    target = tmp_path / "plan.json"
    legacy = tmp_path / ".plan.json.abcd1234.tmp"
    foreign = tmp_path / ".plan.json.otherhost-12.abcd1234.tmp"
    for p in (legacy, foreign):
        p.write_bytes(b"x")
        old = os.stat(p).st_mtime - files.STALE_AFTER_S - 60
        os.utime(p, (old, old))
    assert sorted(files.remove_stale_temps(target)) == sorted([legacy, foreign])
    assert os.listdir(tmp_path) == []
