"""Shard a diffusers transformer's sequence over a process group as its ``_cp_plan`` says:
sequence parallelism for training (and inference) on any backend, gloo on the CPU included.

diffusers' ``enable_parallelism`` installs the same plan, but it builds a device mesh on the
accelerator (a CPU-only torch is refused) and hands every attention of the model, the
cross-attention included, to its own context-parallel attention. Here only the plan's splits and
gathers are installed, as diffusers installs them (``HookRegistry`` hooks that wrap a module's
``forward``, so torch forward pre-hooks, vidsparse's latent-grid hook on the transformer among
them, always see the whole inputs):

- ``ContextParallelInput`` entries keep this rank's equal chunk along ``split_dim`` of a
  module's named input (or, with ``split_output=True``, of its output at that index), where
  the tensor has ``expected_dims`` dims (Wan: the first block's ``hidden_states``, the rotary
  tables, a per-token ``timestep``);
- ``ContextParallelOutput`` entries all-gather a module's output along ``gather_dim`` (Wan:
  ``proj_out``), so the model returns the whole output on every rank.

Inputs only the cross-attention reads (``CROSS_ATTENTION_INPUTS``; LTX-Video's plan splits
them) stay whole on every rank: under ``enable_parallelism`` diffusers' attention dispatch
gathers them again for the cross-attention, which here runs the stock attention locally, the
rank's queries against the whole text, i.e. the rows of its shard. LTX-2 is refused
(``UNSHARDABLE``): its audio-video cross-attentions take the video as keys, so a rank would
attend to its own video shard only.

The video self-attention then sees sequence shards: route it through Ulysses with
``apply_sparse_attention(transformer, method, ulysses=UlyssesAttention(group))``.

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

try:  # the hooks are diffusers' own, so they wrap forward as its context parallelism does
    from diffusers.hooks import ModelHook
except ImportError:  # pragma: no cover - diffusers is needed to shard a diffusers model anyway
    ModelHook = object

__all__ = ["CROSS_ATTENTION_INPUTS", "SequenceParallel", "apply_sequence_parallel"]

CROSS_ATTENTION_INPUTS = ("encoder_hidden_states", "encoder_attention_mask")
UNSHARDABLE = {
    "LTX2VideoTransformer3DModel": "its audio-video cross-attentions take the video as keys and "
    "values, so a rank would attend to its own video shard only",
}
_HOOK_NAME = "vidsparse-sequence-parallel"


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

    def __init__(self, group, modules: list[nn.Module]):
        self.group, self.modules = group, modules

    def remove(self) -> None:
        for module in self.modules:
            module._diffusers_hook.remove_hook(_HOOK_NAME, recurse=False)
        self.modules = []


def apply_sequence_parallel(transformer: nn.Module, group=None) -> SequenceParallel:
    """Install ``type(transformer)._cp_plan`` on ``group`` (default WORLD): every rank runs
    the model on its equal, contiguous chunk of the sequence and gets the whole output.

    Raises ``ValueError`` for a model without a plan or one in ``UNSHARDABLE``, and
    ``RuntimeError`` without a process group; a sequence that does not split evenly raises at
    the forward, naming the sizes.
    """
    name = type(transformer).__name__
    plan = getattr(type(transformer), "_cp_plan", None)
    if not plan:
        raise ValueError(f"{name} has no _cp_plan: diffusers does not say how to shard it")
    if name in UNSHARDABLE:
        raise ValueError(f"{name} cannot be sequence-sharded by its _cp_plan: {UNSHARDABLE[name]}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "apply_sequence_parallel needs an initialised process group: call "
            "torch.distributed.init_process_group first"
        )
    from diffusers.hooks import HookRegistry
    from diffusers.models._modeling_parallel import ContextParallelOutput

    group = dist.group.WORLD if group is None else group
    modules = []
    for module_id, entry in plan.items():
        if isinstance(entry, dict):
            entry = {k: v for k, v in entry.items() if k not in CROSS_ATTENTION_INPUTS}
            if not entry:
                continue
        elif isinstance(entry, ContextParallelOutput):
            entry = [entry]
        for module in _submodules(transformer, module_id):  # a hook object per module
            hook = _Split(entry, group) if isinstance(entry, dict) else _Gather(list(entry), group)
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, _HOOK_NAME)
            modules.append(module)
    return SequenceParallel(group, modules)


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
    tensor of ``cpi.expected_dims`` dims); a list of inputs for a list or tuple ``x``."""
    if isinstance(cpi, (list, tuple)):
        return type(x)(_split(v, c, group) for v, c in zip(x, cpi, strict=True))
    if not torch.is_tensor(x) or (cpi.expected_dims is not None and x.dim() != cpi.expected_dims):
        return x
    world, size = dist.get_world_size(group), x.shape[cpi.split_dim]
    if size % world:
        raise ValueError(
            f"sequence parallelism splits dim {cpi.split_dim} of a {tuple(x.shape)} tensor into "
            f"{world} equal chunks: {size} is not divisible by {world}"
        )
    return x.chunk(world, cpi.split_dim)[dist.get_rank(group)]


def _listed(output) -> tuple[list, bool]:
    single = torch.is_tensor(output)
    return ([output] if single else list(output)), single


def _unlisted(out: list, single: bool, like):
    return out[0] if single else type(like)(out)


class _Split(ModelHook):
    """Splits the named inputs before the forward, the indexed outputs (``split_output``)
    after it."""

    def __init__(self, entry: dict, group):
        super().__init__()
        self.group = group
        self.inputs = {k: c for k, c in entry.items() if not getattr(c, "split_output", False)}
        self.outputs = {k: c for k, c in entry.items() if getattr(c, "split_output", False)}

    def initialize_hook(self, module):
        self.names = list(inspect.signature(type(module).forward).parameters)[1:]  # after self
        return module

    def pre_forward(self, module, *args, **kwargs):
        args = list(args)
        for name, cpi in self.inputs.items():
            if name in kwargs:
                kwargs[name] = _split(kwargs[name], cpi, self.group)
            elif (index := self.names.index(name)) < len(args):
                args[index] = _split(args[index], cpi, self.group)
        return tuple(args), kwargs

    def post_forward(self, module, output):
        if not self.outputs:
            return output
        out, single = _listed(output)
        for index, cpi in self.outputs.items():
            out[index] = _split(out[index], cpi, self.group)
        return _unlisted(out, single, output)


class _Gather(ModelHook):
    """All-gathers each output its plan names (``None``: left alone) after the forward."""

    def __init__(self, plan: list, group):
        super().__init__()
        self.plan, self.group = plan, group

    def post_forward(self, module, output):
        out, single = _listed(output)
        for i, cpo in enumerate(self.plan):
            x = out[i]
            if cpo is not None and (cpo.expected_dims is None or x.dim() == cpo.expected_dims):
                out[i] = _GatherSequence.apply(x, cpo.gather_dim, self.group)
        return _unlisted(out, single, output)
