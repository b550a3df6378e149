"""``SparsitySchedule``: fine-tune from a dense checkpoint by raising VSA sparsity stepwise.

Starting a dense checkpoint at high sparsity throws away most attention at once; the loss
spikes. The schedule keeps it dense for a warmup, then climbs to the target in ``num_levels``
equal steps over ``ramp_steps`` optimiser steps, then holds the target::

    sparsity
    target |                          ______________
           |                   ______|
           |            ______|
           |     ______|
         0 |____|
           +----+------+------+------+--------------> step
           0  warmup       (ramp_steps split into num_levels levels)

With ``w = warmup_steps``, ``R = ramp_steps``, ``L = num_levels`` and ``s = step - w``:

- ``step < w``: 0;
- ``0 <= s < R``: ``target * (floor(s * L / R) + 1) / L`` (level 1 starts right after warmup);
- ``s >= R``: ``target``.

The last level (the target) starts at ``step = w + ceil((L - 1) * R / L)``. ``R = 0`` jumps
straight to the target after warmup.

Training loop lines::

    schedule = SparsitySchedule(target=0.875, warmup_steps=500, ramp_steps=3000, num_levels=4)
    for step in range(start_step, total_steps):
        schedule.apply(model, step)        # every VideoSparseAttention in model gets .sparsity
        ...                                # forward, backward, optimiser step
    checkpoint["sparsity_schedule"] = schedule.state_dict()
"""

from __future__ import annotations

import dataclasses

from torch import nn

from vidsparse.nn.vsa import VideoSparseAttention, VSAGate, check_sparsity
from vidsparse.utils.checks import check_non_negative_int

__all__ = ["SparsitySchedule"]


@dataclasses.dataclass
class SparsitySchedule:
    """Piecewise-constant sparsity: 0 during warmup, ``num_levels`` levels up to ``target``.

    Args:
        target: final sparsity, in ``[0, 1)`` (e.g. 0.875 keeps 1/8 of the key tiles).
        warmup_steps: steps at sparsity 0 (dense) first.
        ramp_steps: steps over which the levels rise; 0 jumps to the target after warmup.
        num_levels: distinct non-zero sparsity values on the way, the last being ``target``;
            at least 1.

    Example (target 0.8, warmup 100, ramp 400, 4 levels): steps 0-99 -> 0.0, 100-199 -> 0.2,
    200-299 -> 0.4, 300-399 -> 0.6, 400 onwards -> 0.8.

    It is a plain dataclass: ``state_dict()`` / ``load_state_dict()`` (or ``dataclasses.asdict``)
    checkpoint it; the sparsity itself is a function of the step, so resuming at the saved step
    restores it exactly.
    """

    target: float
    warmup_steps: int = 0
    ramp_steps: int = 0
    num_levels: int = 1

    def __post_init__(self) -> None:
        self.target = check_sparsity("target", self.target)
        check_non_negative_int("warmup_steps", self.warmup_steps)
        check_non_negative_int("ramp_steps", self.ramp_steps)
        check_non_negative_int("num_levels", self.num_levels)
        if self.num_levels < 1:
            raise ValueError(f"num_levels must be at least 1, got {self.num_levels}")

    def __call__(self, step: int) -> float:
        """Sparsity at optimiser step ``step`` (a non-negative int)."""
        check_non_negative_int("step", step)
        if step < self.warmup_steps:
            return 0.0
        into_ramp = step - self.warmup_steps
        if into_ramp >= self.ramp_steps:
            return self.target
        level = into_ramp * self.num_levels // self.ramp_steps + 1  # 1 .. num_levels
        return self.target * level / self.num_levels

    @property
    def target_step(self) -> int:
        """The first step at ``target``; every later step stays there (400 in the example)."""
        if self.target == 0.0 or self.ramp_steps == 0:
            return 0 if self.target == 0.0 else self.warmup_steps
        # __call__ reaches the last level once into_ramp * num_levels >= (num_levels - 1) * ramp.
        levels_below = (self.num_levels - 1) * self.ramp_steps
        return self.warmup_steps + -(-levels_below // self.num_levels)

    def apply(self, model: nn.Module, step: int) -> float:
        """Set ``.sparsity`` of every :class:`VideoSparseAttention` and :class:`VSAGate` in
        ``model`` (the diffusers integration's gates are ``VSAGate``); return it.

        Raises ``ValueError`` if ``model`` holds no such module (a schedule that silently does
        nothing is almost always a wiring mistake).
        """
        sparsity = self(step)
        modules = [m for m in model.modules() if isinstance(m, (VideoSparseAttention, VSAGate))]
        if not modules:
            raise ValueError(
                f"model ({type(model).__name__}) contains no VideoSparseAttention or VSAGate "
                "module (the diffusers integration adds gates with gate=True)"
            )
        for module in modules:
            module.sparsity = sparsity
        return sparsity

    def state_dict(self) -> dict:
        """The schedule's arguments, as a plain dict (checkpoint-friendly)."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the arguments from :meth:`state_dict`, validating them."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = set(state_dict) - fields
        if unknown:
            raise ValueError(f"unknown SparsitySchedule fields in state_dict: {sorted(unknown)}")
        loaded = dataclasses.replace(self, **state_dict)  # runs __post_init__ validation
        for name in fields:
            setattr(self, name, getattr(loaded, name))
