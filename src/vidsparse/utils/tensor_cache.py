"""Values derived from tensors, kept per source tensor: one mechanism for every cache of the
library that must never hand back a stale value.

Block lists are usually built once and used by many calls (every layer of a step, every step
of a plan, a forward and its backward); what is derived from them (a validation's verdict, the
transposed lists, a rank's head slice) can be reused while the sources are unchanged. An entry
is keyed by the sources' identity and checked against their version counters, so a source
modified in place is derived again (as is one whose data pointer, shape or strides changed:
``t.data = other``, ``t.set_(...)``); a finalizer drops the entry when the first of its sources
is freed, so a new tensor at a recycled address never hits. Bypassed (``make`` runs every
time, nothing is stored) while tracing for torch.compile (fake tensors), during CUDA-graph
capture (the value would live in the graph's memory pool) and for inference tensors (they
carry no version counter, so an in-place change could not be seen).

Writes that bypass the version counter (through ``t.numpy()``, ``t.data[...] = ...``, DLPack)
are not seen: callers that must not trust a stale value then ``discard`` the sources' entries
(``block_sparse_attn(..., validate=True)`` does), and kernels stay memory-safe whatever the
lists hold.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["TensorCache"]


class TensorCache:
    def __init__(self, capacity: int = 128):
        self._entries: dict[tuple, tuple[tuple[int, ...], Any]] = {}
        self._capacity = capacity

    @staticmethod
    def cacheable(sources: Sequence[torch.Tensor | None]) -> bool:
        present = [t for t in sources if t is not None]
        if torch.compiler.is_compiling() or any(t.is_inference() for t in present):
            return False
        return not (any(t.is_cuda for t in present) and torch.cuda.is_current_stream_capturing())

    @staticmethod
    def _key(name: str, sources, params: tuple) -> tuple:
        return (name, *(None if t is None else id(t) for t in sources), *params)

    @staticmethod
    def _versions(sources) -> tuple:
        return tuple(
            (t._version, t.data_ptr(), tuple(t.shape), t.stride()) for t in sources if t is not None
        )

    def contains(self, name: str, sources, params: tuple = ()) -> bool:
        """Whether a value for ``sources`` as they are now is stored (False when bypassed)."""
        if not self.cacheable(sources):
            return False
        entry = self._entries.get(self._key(name, sources, params))
        return entry is not None and entry[0] == self._versions(sources)

    def put(self, name: str, sources, params: tuple, value) -> None:
        """Store ``value`` for ``sources`` as they are now (nothing when bypassed)."""
        if not self.cacheable(sources):
            return
        key = self._key(name, sources, params)
        if key not in self._entries:
            if len(self._entries) >= self._capacity:
                self._entries.pop(next(iter(self._entries)))  # the oldest
            for t in sources:
                if t is not None:
                    weakref.finalize(t, self._entries.pop, key, None)
        self._entries[key] = (self._versions(sources), value)

    def get(self, name: str, sources, params: tuple, make: Callable[[], Any]):
        """The stored value for ``sources``, else ``make()`` (stored where cacheable)."""
        if self.contains(name, sources, params):
            return self._entries[self._key(name, sources, params)][1]
        value = make()
        self.put(name, sources, params, value)
        return value

    def discard(self, sources) -> None:
        """Drop every entry derived from any of ``sources`` (whatever its name and params)."""
        ids = {id(t) for t in sources if t is not None}
        for key in [k for k in self._entries if ids.intersection(k[1:])]:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
