"""Where a ``train_vsa`` training step reads tensor values back to the host.

On a GPU, such a read (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``, ...)
waits for every kernel queued before it, so the host stops getting ahead of the GPU. Inside a
training step that turns launch overhead into idle GPU time. This runs the warm-up steps (the
compiles among them), then one step with the reading methods of ``torch.Tensor`` wrapped.
It prints every site that read, as the innermost lines of vidsparse or diffusers on its
stack, with the tensor's device and a count. On CUDA the step also runs under
``torch.cuda.set_sync_debug_mode("warn")``, which also reports the syncs made inside
operators (``nonzero``, boolean indexing, ...)::

    PYTHONPATH=src python benchmarks/profile/find_host_reads.py --compile blocks
    TRITON_INTERPRET=1 VIDSPARSE_BACKEND=triton PYTHONPATH=src \\
        python benchmarks/profile/find_host_reads.py --tiny --device cpu --arms vsa0.875

On the CPU every tensor is a host tensor, so every read is listed. The ones in library code
would be syncs on a GPU. The harness's own reads there are AdamW's step counters (on a GPU
the fused AdamW reads none back) and ``loss.item()`` at the step's end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import tempfile
import traceback
import warnings

import diffusers
import torch

import vidsparse
import vidsparse.testing
from vidsparse.bench.ops import train_vsa
from vidsparse.testing import reading_methods_watched

# Frames in the vidsparse and diffusers packages are "our code", named from the package down.
PACKAGES = tuple(os.path.dirname(m.__file__) + os.sep for m in (vidsparse, diffusers))
# The watcher's own wrapper frames: where a read goes through it, its caller is the site.
WATCHER = vidsparse.testing.__file__


def call_site(frames, depth: int = 4) -> str:
    """The innermost ``depth`` frames of our code, innermost first, as ``package/path:line``
    (the watcher's wrapper left out)."""
    ours = [
        (short, f.lineno)
        for f in frames
        if f.filename != WATCHER and (short := _in_package(f.filename))
    ]
    return " <- ".join(f"{path}:{line}" for path, line in ours[-depth:][::-1])


def _in_package(filename: str) -> str | None:
    for package in PACKAGES:
        if filename.startswith(package):
            return os.path.basename(package[:-1]) + "/" + filename[len(package) :]
    return None


@contextlib.contextmanager
def host_reads():
    """Counts ``{(method, device, site): calls}`` of ``torch.Tensor``'s reading methods made
    while the block runs (``vidsparse.testing.reading_methods_watched``)."""
    counts: collections.Counter = collections.Counter()

    def count(name, tensor):
        site = call_site(traceback.extract_stack())
        counts[(name, tensor.device.type, site)] += 1

    with reading_methods_watched(count):
        yield counts


@contextlib.contextmanager
def sync_debug_mode(device: torch.device):
    """CUDA's sync debug mode at "warn" while the block runs (nothing off CUDA)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def sync_warnings():
    """``[(site, message)]`` of the synchronisation warnings raised while the block runs, each
    placed by ``call_site`` from the stack it was raised on. A warning's own file and line
    would name the innermost Python frame, which for ``loss.item()`` under ``host_reads`` is
    the watcher's wrapper, not the line that read."""
    syncs: list[tuple[str, str]] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            site = call_site(traceback.extract_stack()) or f"{filename}:{lineno}"
            syncs.append((site, str(message)[:80]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored by catch_warnings on exit
        yield syncs


def library_reads(counts) -> dict:
    """The reads whose innermost site is vidsparse's library code (not its benchmarks)."""
    return {key: n for key, n in counts.items() if _in_library(key[2].split(" <- ")[0])}


def library_syncs(syncs) -> list:
    """The syncs whose innermost site is vidsparse's library code."""
    return [(site, message) for site, message in syncs if _in_library(site.split(" <- ")[0])]


def _in_library(path: str) -> bool:
    return path.startswith("vidsparse/") and not path.startswith("vidsparse/bench/")


def step_reads(arm: str, args) -> tuple[collections.Counter, list]:
    """Runs ``args.warmup`` steps of ``arm``, then one watched step."""
    device = torch.device(args.device)
    argv = ["--arm", arm, "--device", args.device, "--compile", args.compile]
    with tempfile.TemporaryDirectory() as out:
        run = train_vsa.prepare(train_vsa.parse_args([*argv, "--out", out, *args.size]), device)
        for step in range(args.warmup):
            train_vsa.train_step(run, step)
        with sync_warnings() as syncs, host_reads() as counts, sync_debug_mode(device):
            train_vsa.train_step(run, args.warmup)
    return counts, syncs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="dense,vsa0.875", help="train_vsa arms, comma-separated")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the watched one")
    ap.add_argument("--tiny", action="store_true", help="train_vsa's tiny model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", choices=("none", "blocks"), default="none")
    args = ap.parse_args(argv)
    args.size = ["--tiny"] if args.tiny else []
    for arm in args.arms.split(","):
        counts, syncs = step_reads(arm, args)
        print(f"{arm}: {sum(counts.values())} host reads in one step, "
              f"{sum(library_reads(counts).values())} of them in library code; "
              f"{len(syncs)} syncs, {len(library_syncs(syncs))} in library code")  # fmt: skip
        for (name, device, site), n in counts.most_common():
            print(f"  {n:5d}x {name:9s} {device:5s} {site}")
        for site, message in syncs:
            print(f"  sync: {site}: {message}")


if __name__ == "__main__":
    main()
