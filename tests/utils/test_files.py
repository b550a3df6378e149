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
