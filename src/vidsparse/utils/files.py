"""Small file helpers shared by the plan, search, plot and CLI writers."""

from __future__ import annotations

import contextlib
import os
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
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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
