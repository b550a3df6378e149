"""Shard a diffusers transformer's sequence over a process group as its ``_cp_plan`` says:
sequence parallelism for training (and inference) on any backend, gloo on the CPU included.

diffusers' ``enable_parallelism`` installs the same plan, but it builds a device mesh on the
accelerator (a CPU-only torch is refused) and hands every attention of the model, the
cross-attention included, to its own context-parallel attention. Here only the plan's splits and
gathers are installed, as torch module hooks:

- ``ContextParallelInput`` entries keep this rank's equal chunk along ``split_dim`` of a
  module's named input (or, with ``split_output=True``, of its output at that index), where
  the tensor has ``expected_dims`` dims (Wan: the first block's ``hidden_states``, the rotary
  tables; not the text, which every rank keeps whole);
- ``ContextParallelOutput`` entries all-gather a module's output along ``gather_dim`` (Wan:
  ``proj_out``), so the model returns the whole output on every rank.

The video self-attention then sees sequence shards: route it through Ulysses with
``apply_sparse_attention(transformer, method, ulysses=UlyssesAttention(group))``. The
cross-attention needs nothing: its queries are the rank's shard and its keys the whole text,
so the stock attention computes the rows of the shard. Forward pre-hooks that run before the
plan's own (vidsparse's latent-grid hook on the transformer) still see the whole input.

Gradients: a split's backward puts the chunk's gradient in place (autograd of ``chunk``), a
gather's backward keeps this rank's slice of the gradient. Every rank computes the same loss
on the gathered output, so each rank's parameter gradients hold its own shard's contribution:
the model's gradient is their **sum** over the group (with DDP, which averages over all
processes, multiply the loss by the group size).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SequenceParallel", "apply_sequence_parallel"]


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; the backward keeps this rank's slice of the gradient (every
    rank holds the gradient of the whole output, so no communication is needed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group):
        ctx.dim, ctx.rank, ctx.world = dim, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.world, ctx.dim)[ctx.rank], None, None


class SequenceParallel:
    """The hooks :func:`apply_sequence_parallel` installed; :meth:`remove` takes them off."""

    def __init__(self, group, handles: list):
        self.group, self.handles = group, handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def apply_sequence_parallel(transformer: nn.Module, group=None) -> SequenceParallel:
    """Install ``type(transformer)._cp_plan`` on ``group`` (default WORLD): every rank runs
    the model on its equal, contiguous chunk of the sequence and gets the whole output.

    Raises ``ValueError`` for a model without a plan and ``RuntimeError`` without a process
    group; a sequence that does not split evenly raises at the forward, naming the sizes.
    """
    plan = getattr(type(transformer), "_cp_plan", None)
    if not plan:
        raise ValueError(
            f"{type(transformer).__name__} has no _cp_plan: diffusers does not say how to shard "
            "its sequence"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "apply_sequence_parallel needs an initialised process group: call "
            "torch.distributed.init_process_group first"
        )
    from diffusers.models._modeling_parallel import ContextParallelOutput

    group = dist.group.WORLD if group is None else group
    handles = []
    for module_id, entry in plan.items():
        for module in _submodules(transformer, module_id):
            if isinstance(entry, dict):
                handles += _install_splits(module, entry, group)
            else:
                outputs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                handles.append(module.register_forward_hook(_gather_outputs(outputs, group)))
    return SequenceParallel(group, handles)


def _submodules(module: nn.Module, name: str) -> list[nn.Module]:
    """The modules a plan key names: ``""`` the module itself, ``a.b`` a submodule, ``*`` every
    item of a module list."""
    if not name:
        return [module]
    head, _, rest = name.partition(".")
    if head == "*":
        return [m for item in module for m in _submodules(item, rest)]
    return _submodules(getattr(module, head), rest)


def _split(x, cpi, group):
    """This rank's chunk of ``x`` along ``cpi.split_dim`` (``x`` as is where it is not a
    tensor of ``cpi.expected_dims`` dims)."""
    if not torch.is_tensor(x) or (cpi.expected_dims is not None and x.dim() != cpi.expected_dims):
        return x
    world, size = dist.get_world_size(group), x.shape[cpi.split_dim]
    if size % world:
        raise ValueError(
            f"sequence parallelism splits dim {cpi.split_dim} of a {tuple(x.shape)} tensor into "
            f"{world} equal chunks: {size} is not divisible by {world}"
        )
    return x.chunk(world, cpi.split_dim)[dist.get_rank(group)]


def _install_splits(module: nn.Module, entry: dict, group) -> list:
    """A pre-hook splitting the named inputs, a hook splitting the outputs (``split_output``)."""
    inputs = {k: cpi for k, cpi in entry.items() if not cpi.split_output}
    outputs = {k: cpi for k, cpi in entry.items() if cpi.split_output}
    names = list(inspect.signature(type(module).forward).parameters)[1:]  # after self
    handles = []

    def split_inputs(module, args, kwargs):
        args = list(args)
        for name, cpi in inputs.items():
            if name in kwargs:
                kwargs[name] = _split(kwargs[name], cpi, group)
            elif names.index(name) < len(args):
                args[names.index(name)] = _split(args[names.index(name)], cpi, group)
        return tuple(args), kwargs

    def split_outputs(module, args, output):
        single = torch.is_tensor(output)
        out = [output] if single else list(output)
        for index, cpi in outputs.items():
            out[index] = _split(out[index], cpi, group)
        return out[0] if single else type(output)(out)

    if inputs:
        handles.append(module.register_forward_pre_hook(split_inputs, with_kwargs=True))
    if outputs:
        handles.append(module.register_forward_hook(split_outputs))
    return handles


def _gather_outputs(plan: list, group):
    """A forward hook all-gathering each output that ``plan`` names (``None``: left alone)."""

    def gather(module, args, output):
        single = torch.is_tensor(output)
        out = [output] if single else list(output)
        for i, cpo in enumerate(plan):
            x = out[i]
            if cpo is not None and (cpo.expected_dims is None or x.dim() == cpo.expected_dims):
                out[i] = _GatherSequence.apply(x, cpo.gather_dim, group)
        return out[0] if single else type(output)(out)

    return gather
