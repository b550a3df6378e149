"""FastVideo's VSA (the fastvideo-kernel wheel) as a benchmark peer: found and imported once,
on its Triton path; the ``vsa`` op times it, and the registry's ``fastvideo`` requirement asks
:func:`fastvideo_unavailable` (``benchmarks/README.md``, "VSA: vsa", says how to install the
wheel on a GPU machine without network access)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from vidsparse.bench import harness

# Import paths tried for FastVideo's VSA, first that works wins: the package root re-exports
# ``ops.video_sparse_attn`` in 0.3.x; ``.ops`` directly in case the root import grows extras.
FASTVIDEO_CANDIDATES = (
    ("fastvideo_kernel", "video_sparse_attn"),
    ("fastvideo_kernel.ops", "video_sparse_attn"),
)
NOT_INSTALLED = "not installed"


_FASTVIDEO: list = []  # memo of load_fastvideo(): [(fn or None, module path, version, error)]


def load_fastvideo() -> tuple[Callable | None, str | None, str | None, str | None]:
    """``(video_sparse_attn, module path, version, error)`` of FastVideo's VSA, probed once.

    ``FASTVIDEO_VSA_TRITON=1`` must be set before the import: FastVideo picks its kernel from
    it (its sm_90a kernel did not load on the H200). A missing package gives the
    error "not installed"; a package that fails to import (no GPU driver, missing deps) gives
    the import error. Raises that error when called from a provider, so the case records it.
    """
    if not _FASTVIDEO:
        os.environ.setdefault("FASTVIDEO_VSA_TRITON", "1")
        _FASTVIDEO.append(_probe_fastvideo())
    return _FASTVIDEO[0]


def _probe_fastvideo():
    error = NOT_INSTALLED
    for module_name, attr in FASTVIDEO_CANDIDATES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and not module_name.startswith(exc.name):
                error = f"import failed: {harness.error_message(exc)}"  # a dependency is missing
            continue
        except Exception as exc:  # noqa: BLE001 - e.g. Triton finding no GPU driver
            error = f"import failed: {harness.error_message(exc)}"
            continue
        fn = getattr(module, attr, None)
        if fn is not None:
            version = getattr(sys.modules.get("fastvideo_kernel"), "__version__", None)
            return fn, f"{module_name}.{attr}", version, None
    return None, None, None, error


class FastVideoUnavailable(RuntimeError):
    """FastVideo's VSA cannot run here: the message says why (``load_fastvideo``'s error)."""


def require_fastvideo() -> None:
    """Raise :class:`FastVideoUnavailable` unless FastVideo's VSA loaded."""
    fn, _, _, error = load_fastvideo()
    if fn is None:
        raise FastVideoUnavailable(error)


def fastvideo_unavailable() -> str | None:
    """``None`` when FastVideo's VSA loaded, else why not (one line)."""
    return load_fastvideo()[3]
