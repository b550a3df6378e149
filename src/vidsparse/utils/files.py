"""Small file helpers shared by the plan, search, plot and CLI writers."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Write a file through ``write(binary_file)`` atomically.

    The data goes to a temporary file in the target's folder (so ``os.replace`` is a rename on
    one file system), is flushed to disk, then replaces the target in one step. If anything
    fails, the temporary file is removed and the target is untouched.

    The file gets the mode a plain ``open(path, "wb")`` would leave: an existing target keeps
    its mode, a new one gets ``0o666`` less the umask (``mkstemp`` alone would leave ``0o600``).
    """
    path = Path(path)
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Also on KeyboardInterrupt: never leave a half-written temporary behind.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _mode_for(path: Path) -> int:
    """The permission bits ``open(path, "wb")`` would leave on ``path``."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask. Read from /proc where Linux has it; elsewhere set and restored at
    once (``os.umask`` is the only call that reads it there)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
