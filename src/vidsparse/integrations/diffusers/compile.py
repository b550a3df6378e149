"""Regional compilation of a diffusers transformer for training.

Inductor's mix-order reduction (on by default from torch 2.10) fuses the backward's reductions
over tokens and over channels into one kernel; where the gradients of several ``chunk()``
slices of one parameter land in a shared buffer (Wan's per-block ``scale_shift_table``, any
DiT whose modulation slices one table), it writes the slices' gradients into a temporary and
leaves the parameter's gradient buffer unwritten: the step runs, the loss is computed
correctly, and those gradients are garbage (PyTorch issue 193061). On an H200 with torch 2.11
a Wan model's ``scale_shift_table`` and time-embedder gradients came out 20-260x off and its
training diverged (``benchmarks/tuning/check_compiled_train.py``). The forward is unaffected,
so inference compiles as users have it.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_MIX_ORDER = "triton.mix_order_reduction"


def training_compile_options() -> dict[str, bool]:
    """Inductor options for a compiled training step: mix-order reduction off where the
    installed torch has it."""
    triton_config = getattr(torch._inductor.config, "triton", None)
    if getattr(triton_config, "mix_order_reduction", None) is None:
        return {}
    return {_MIX_ORDER: False}


def compile_for_training(model: torch.nn.Module, *, fullgraph: bool = True) -> None:
    """``model.compile_repeated_blocks(fullgraph=...)`` (diffusers' regional compilation: one
    graph for every block), in place, with inductor's mix-order reduction off, so that the
    backward computes every parameter's gradient (see the module's docstring)."""
    options = training_compile_options()
    if options:
        logger.info("vidsparse: compiling %s for training with inductor's mix-order reduction "
                    "off (it drops gradients of sliced modulation tables)",
                    type(model).__name__)  # fmt: skip
    model.compile_repeated_blocks(fullgraph=fullgraph, options=options)
