"""Small file helpers shared by the plan, search, plot and CLI writers."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "remove_stale_temps"]


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Write a file through ``write(binary_file)`` atomically.

    The data goes to a temporary file in the target's folder (so ``os.replace`` is a rename on
    one file system), is flushed to disk, then replaces the target in one step. If anything
    fails, the temporary file is removed and the target is untouched. A process killed mid-write
    leaves its temporary behind: the next write of the same target removes it
    (``remove_stale_temps``).

    The file gets the mode a plain ``open(path, "wb")`` would leave: an existing target keeps
    its mode, a new one gets ``0o666`` less the umask (``mkstemp`` alone would leave ``0o600``).
    """
    path = Path(path)
    mode = _mode_for(path)
    remove_stale_temps(path)  # those an interrupted earlier write (SIGKILL) left behind
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
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


# ---------------------------------------------------------------------------------------------
# temporaries of interrupted writes
# ---------------------------------------------------------------------------------------------

# A temporary's name says who writes it: ``.<target name>.<host>-<pid>.<random>.tmp``. One of
# this host whose process is gone is stale at once; any other (another host's, on a shared file
# system, or an older vidsparse's ``.<target name>.<random>.tmp``) only after STALE_AFTER_S
# seconds without a change: no write of ours takes that long, and a live writer's is never
# touched (unless its host reuses a pid, which leaves the file, never removes a live one).
STALE_AFTER_S = 24 * 3600
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:16] or "host"
_TEMP_TAIL = re.compile(r"(?:(?P<host>[A-Za-z0-9-]+)-(?P<pid>[0-9]+)\.)?[a-z0-9_]{8}\.tmp")


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{_HOST}-{os.getpid()}."


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries that interrupted ``atomic_write`` calls of ``path`` left (only
    that target's, only stale ones: see ``STALE_AFTER_S``); returns those removed. Best
    effort: a file it cannot list or remove is left as it is."""
    path = Path(path)
    head = f".{path.name}."
    removed = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        match = _TEMP_TAIL.fullmatch(name[len(head) :]) if name.startswith(head) else None
        if match is None:
            continue
        tmp = path.parent / name
        if match["pid"] is not None and match["host"] == _HOST:
            stale = not _pid_alive(int(match["pid"]))
        else:
            try:
                stale = now - tmp.lstat().st_mtime > STALE_AFTER_S
            except OSError:
                continue
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
                removed.append(tmp)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name != "posix":
        return True  # another thread of ours may be writing it; elsewhere kill(pid, 0) kills
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's), or cannot tell: keep the file
    return True
