"""Run a test body on several CPU processes of one gloo group (``torch.multiprocessing.spawn``).

``spawn_gloo(body, world, tmp, job, *args)`` runs ``body(rank, world, *args)`` on every rank
(``body`` a module-level function: the children import it) and returns each rank's return
value, saved with ``torch.save``. The ranks run the reference backend on one thread each, and
a collective that waits longer than a minute fails instead of hanging.

Each rank leaves with ``os._exit(0)`` once its result is on disk: the interpreter's teardown
destroys what still refers to the group (torch._dynamo's caches, module-level state of the
code under test) after the group is gone, and gloo then aborts the process now and then
(SIGABRT from ``mp.spawn``, seen on CI machines under load), which would fail a run whose
results were all written.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)


def spawn_gloo(body, world: int, tmp: Path, job: str, *args, env: dict | None = None) -> list:
    """``[body(rank, world, *args) for each rank]``, run on ``world`` gloo processes; ``job``
    names the store and result files in ``tmp`` (a fresh name for every spawn); ``env`` is
    set in each rank before the group is made."""
    mp.spawn(_rank, args=(body, world, str(tmp), job, args, env or {}), nprocs=world, join=True)
    return [torch.load(Path(tmp) / f"{job}-rank{rank}.pt") for rank in range(world)]


def _rank(rank: int, body, world: int, tmp: str, job: str, args: tuple, env: dict) -> None:
    os.environ.update({"VIDSPARSE_BACKEND": "torch", **env})
    torch.set_num_threads(1)  # several processes on two cores
    # Imported before the group exists: imported later (the engine does on its first call),
    # it keeps references to the group past destroy_process_group.
    importlib.import_module("torch._dynamo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/{job}-store",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    result = body(rank, world, *args)
    dist.barrier()  # no rank closes its connections while another still has work in flight
    dist.destroy_process_group()
    torch.save(result, Path(tmp) / f"{job}-rank{rank}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown (module docstring)
