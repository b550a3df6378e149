"""Device facts the launchers need, queried without ever requiring a GPU at import."""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """What the tile configs are keyed on."""

    backend: str  # "cuda" | "hip" | "cpu"
    arch: int | str  # 90 for sm_90, "gfx942" for MI300, ... ; 0 for the CPU interpreter

    @property
    def is_hopper(self) -> bool:
        return self.backend == "cuda" and isinstance(self.arch, int) and 90 <= self.arch < 100

    @property
    def is_cdna(self) -> bool:
        return self.backend == "hip" and str(self.arch).startswith("gfx9")


CPU_INTERPRETER = Target("cpu", 0)


def target_of(device: torch.device) -> Target:
    """The compile target for ``device``; the interpreter target for CPU tensors. Cached per
    device (``target_of.cache_clear()``); under ``torch.compile`` the lookup is traced into a
    graph constant, so it reads the uncached function there (Dynamo warns on caches)."""
    if torch.compiler.is_compiling():
        return _query_target.__wrapped__(device)
    return _query_target(device)


@functools.cache
def _query_target(device: torch.device) -> Target:
    if device.type != "cuda":
        return CPU_INTERPRETER
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        return Target("hip", props.gcnArchName.split(":")[0])
    return Target("cuda", props.major * 10 + props.minor)


target_of.cache_clear = _query_target.cache_clear


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def triton_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed Triton, read from its package metadata (Triton is
    not imported), or None without one. Configs that depend on the compiler read it: the same
    kernel can spill with one Triton's LLVM and ptxas and not with another's."""
    for dist in ("triton", "pytorch-triton-rocm", "pytorch-triton"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        match = re.match(r"(\d+)\.(\d+)", version)
        if match:
            return int(match.group(1)), int(match.group(2))
    return None
