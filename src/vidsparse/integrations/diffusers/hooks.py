"""Installing and removing a method on a transformer: a forward pre-hook on the transformer
records the latent grid (and step) before any layer runs; a pre-hook and an always-called
post-hook on each video self-attention module open and close its route, so the shim of
``dispatch.py`` sends that module's attention call to :meth:`Route.attend`.

The hooks are small objects holding the state (not closures), so ``copy.deepcopy`` of a
patched transformer gives hooks bound to the copy's own state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vidsparse.integrations.diffusers import dispatch
from vidsparse.integrations.diffusers.models import (
    attention_dims,
    check_no_foreign_parallelism,
    spec_for,
)
from vidsparse.integrations.diffusers.state import (
    STATE_ATTR,
    Call,
    Method,
    ModelSpec,
    SparseState,
    logger,
    state_of,
)


def install(
    transformer: nn.Module,
    make_method: Callable[[ModelSpec], Method],
    ulysses=None,
    scheduler=None,
) -> SparseState:
    """Hook ``transformer``'s video self-attention up to a method; all layers share one state."""
    spec = spec_for(transformer)
    _check_ulysses(ulysses, spec)
    if getattr(transformer, STATE_ATTR, None) is not None:
        raise ValueError(
            "sparse attention (or a calibration capture) is already applied to this "
            "transformer; call remove_sparse_attention(transformer) first"
        )
    layers = spec.self_attention(transformer)
    check_no_foreign_parallelism(layers, sequence_parallel=ulysses is not None)
    modules = sorted({type(attn.processor).__module__ for _, attn in layers})
    for name in modules:
        dispatch.check_routable(name)
    heads, head_dim, dim = attention_dims(layers[0][1])
    impl = make_method(spec)
    if spec.extra_tokens != "none" and not impl.supports_text_tokens:
        raise ValueError(
            f"method={impl.name!r} is not supported on {spec.name}: its self-attention holds "
            "text tokens"
        )
    impl.check_model(num_layers=len(layers), heads=heads)

    state = SparseState(
        spec=spec, method=impl, ulysses=ulysses, scheduler=scheduler, owner=transformer
    )
    state.layers = list(layers)
    state.dispatch_modules = tuple(modules)
    enter, leave = _Enter(state), _Exit()
    ids = None  # the first layer's hook ids, shared by the others (_add_route_hooks)
    try:
        for index, (path, attn) in enumerate(layers):
            parent = transformer.get_submodule(path.rpartition(".")[0])
            state.added += impl.add_modules(parent, attn, dim=dim, heads=heads, head_dim=head_dim)
            attn._vidsparse_layer = index  # a module attribute: see _Enter
            ids = _add_route_hooks(attn, enter, leave, ids)
            state.handles += [(attn, hook_id) for hook_id in ids]
        handle = transformer.register_forward_pre_hook(_GridHook(state), with_kwargs=True)
        state.handles.append((transformer, handle.id))
    except BaseException:
        _restore(state)  # never leave a half-patched model behind
        raise
    for name in modules:
        dispatch.attach(name, transformer)
    setattr(transformer, STATE_ATTR, state)
    logger.info(
        "vidsparse: %s on %d video self-attention layers of %s (%s)",
        impl.name, len(layers), spec.name, ", ".join(sorted({p.split(".")[0] for p, _ in layers})),
    )  # fmt: skip
    return state


def uninstall(transformer: nn.Module) -> None:
    """Undo :func:`install`: no hooks, no added modules, diffusers' dispatch again."""
    state = state_of(transformer)
    _restore(state)
    for name in state.dispatch_modules:
        dispatch.detach(name, transformer)
    delattr(transformer, STATE_ATTR)


def _restore(state: SparseState) -> None:
    for module, hook_id in state.handles:
        _remove_hook(module, hook_id)
    for module, name in state.added:
        delattr(module, name)
    for _, attn in state.layers:
        attn.__dict__.pop("_vidsparse_layer", None)
    state.handles.clear()
    state.added.clear()


# Where nn.Module keeps a hook and its flags (what RemovableHandle.remove deletes). Hooks are
# removed by (module, id), not through handles: a deep copy of the state then names the copy's
# modules, where a copied handle would still point into the original's hook dicts.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _add_route_hooks(attn: nn.Module, enter, leave, ids: tuple[int, int] | None):
    """Register the route's pre-hook (with kwargs) and always-called post-hook on ``attn``,
    under the hook ids ``ids`` when given (those of the first layer). ``nn.Module`` numbers
    hooks globally and Dynamo guards on the ids it looks up, so one id per layer would compile
    one graph per layer under regional compilation; the same ids on every layer share one."""
    if ids is None:
        pre = attn.register_forward_pre_hook(enter, with_kwargs=True)
        post = attn.register_forward_hook(leave, always_call=True)
        return pre.id, post.id
    pre_id, post_id = ids
    attn._forward_pre_hooks[pre_id] = enter
    attn._forward_pre_hooks_with_kwargs[pre_id] = True
    attn._forward_hooks[post_id] = leave
    attn._forward_hooks_always_called[post_id] = True
    return ids


def _remove_hook(module: nn.Module, hook_id: int) -> None:
    for name in _HOOK_DICTS:
        getattr(module, name, {}).pop(hook_id, None)


class _GridHook:
    """The transformer's forward pre-hook: the latent grid and step of this forward."""

    def __init__(self, state: SparseState):
        self.state = state

    def __call__(self, module, args, kwargs):
        state = self.state
        shape = state.spec.grid(module, args, kwargs)
        state.method.check_grid(shape)
        state.shape = shape
        state.forwards += 1
        if state.spec.text_lengths is not None:
            lengths = state.spec.text_lengths(module, args, kwargs)
            state.text_lengths = tuple(int(n) for n in lengths.tolist())  # one host read
        if state.method.uses_step:
            state.step = state.current_step()
        state.method.before_forward(state, _device_of(args, kwargs))
        return None


def _device_of(args, kwargs) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


class _Enter:
    """The video self-attention modules' pre-hook: opens the module's route for the shim.

    One object for all layers, the layer index an attribute of the module read only where a
    method needs it (``Call.layer``): under regional compilation the blocks then share one
    graph (Dynamo guards on an int it reads from a module: one graph per layer)."""

    def __init__(self, state: SparseState):
        self.state = state

    def __call__(self, module, args, kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        dispatch.ROUTES.append(Route(self.state, module, hidden_states))
        return None


class _Exit:
    """The matching post-hook (always called, also when the forward raised)."""

    def __call__(self, module, args, output):
        dispatch.ROUTES.pop()
        return None


class Route:
    """One open self-attention call: what the shim hands the attention call to."""

    def __init__(self, state: SparseState, attn: nn.Module, hidden_states):
        self.state, self.attn, self.hidden_states = state, attn, hidden_states

    def attend(self, query, key, value, args: dispatch.DispatchArgs) -> torch.Tensor:
        """``[B, S, H, D]`` in and out, as ``dispatch_attention_fn``."""
        state = self.state
        dense_fn = args.dense
        if args.parallel_config is not None and state.ulysses is None:
            raise ValueError(
                "context parallelism is enabled on this transformer, so its attention sees "
                "sequence shards: pass ulysses=vidsparse.parallel.UlyssesAttention() to "
                "apply_sparse_attention"
            )
        reason = _not_sparse_reason(query, key, value, args)
        if reason is not None:
            state.log_once(reason, "vidsparse: %s runs dense attention: %s", self.attn_path, reason)
            return dense_fn(query, key, value)
        if state.ulysses is not None:
            shape = state.video_shape(query.shape[1] * state.ulysses.world_size)
            call = self._call(shape, 0, None, None, args.scale, dense_fn)
            return state.method.attend_sharded(query, key, value, call, state.ulysses)
        mask, reason = _key_mask(args.attn_mask, state.spec, query.shape[0], query.shape[1])
        if reason is not None:
            state.log_once(reason, "vidsparse: %s runs dense attention: %s", self.attn_path, reason)
            return dense_fn(query, key, value)
        text = self._extra_tokens(query.shape[1])
        shape = state.video_shape(query.shape[1] - text)
        state.log_kernels_once(query.device)
        mask_id = ("forward", state.forwards) if state.spec.square_key_mask else args.attn_mask
        lengths = None
        if mask is not None and state.text_lengths is not None:
            video = shape[0] * shape[1] * shape[2]
            lengths = tuple(video + n for n in state.text_lengths)
        call = self._call(shape, text, mask, mask_id, args.scale, dense_fn, lengths)
        if lengths is not None and not state.lengths_checked:
            _check_lengths(state, call)
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        return state.method.attend(q, k, v, call).transpose(1, 2)

    def _call(self, shape, text, mask, mask_id, scale, dense_fn, lengths=None) -> Call:
        return Call(
            self.attn, self.state.step, shape, text, self.hidden_states, mask, lengths, mask_id,
            scale, dense_fn,
        )  # fmt: skip

    @property
    def attn_path(self) -> str:
        return self.state.layers[self.attn._vidsparse_layer][0]

    def _extra_tokens(self, seq: int) -> int:
        shape = self.state.shape
        video = 0 if shape is None else shape[0] * shape[1] * shape[2]
        if self.state.spec.extra_tokens == "none" or seq <= video:
            return 0
        return seq - video


@torch.compiler.disable  # a host read, once per patched model; eager under torch.compile
def _check_lengths(state: SparseState, call: Call) -> None:
    """The real lengths the model's inputs gave must be those of the mask it built (a
    diffusers version that builds its mask differently would otherwise attend padding)."""
    from vidsparse.integrations.diffusers.methods import real_lengths

    from_mask = tuple(real_lengths(call.mask))
    if from_mask != call.real_lengths:
        raise RuntimeError(
            f"vidsparse: {state.spec.name}'s attention mask keeps {list(from_mask)} tokens per "
            f"sample, but its inputs give {list(call.real_lengths)}: this diffusers version "
            "builds the mask differently from the one vidsparse's models table was written for"
        )
    state.lengths_checked = True


def _not_sparse_reason(query, key, value, args) -> str | None:
    """Why a call cannot take the sparse path (it then runs diffusers' dense attention, logged
    once), or ``None``."""
    if query.ndim != 4 or key.shape[1] != query.shape[1] or value.shape[1] != key.shape[1]:
        raise ValueError(
            f"a video self-attention call got q {tuple(query.shape)}, k {tuple(key.shape)}, "
            f"v {tuple(value.shape)}: expected [B, S, H, D] with the same S"
        )
    if args.is_causal:
        return "is_causal=True"
    if args.enable_gqa or key.shape[2] != query.shape[2]:
        return "grouped-query attention"
    if args.dropout_p:
        return f"attention dropout {args.dropout_p}"
    if args.attention_kwargs:
        return f"backend-specific attention_kwargs {sorted(args.attention_kwargs)}"
    return None


def _key_mask(attn_mask, spec: ModelSpec, batch: int, seq: int):
    """``(key mask [B, 1, 1, S] bool or None, None)`` for a mask the sparse path honours, or
    ``(None, reason)`` for one it cannot (the call then runs dense, logged once): a float
    (additive) mask, or a full ``[B, 1, S, S]`` mask such as a block-causal one."""
    if attn_mask is None:
        return None, None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"{spec.name}'s attention got a {type(attn_mask).__name__} mask (its own sparse "
            "attention, e.g. Kandinsky's NABLA, is configured): vidsparse replaces dense "
            "attention only; switch the model's own sparse attention off"
        )
    if attn_mask.dtype != torch.bool:
        return None, f"an additive {attn_mask.dtype} attention mask"
    if attn_mask.ndim == 2 and tuple(attn_mask.shape) == (batch, seq):
        return attn_mask[:, None, None, :], None
    if attn_mask.ndim == 4 and attn_mask.shape[-1] == seq and attn_mask.shape[-2] == 1:
        return attn_mask.expand(batch, 1, 1, seq), None
    if attn_mask.ndim == 4 and attn_mask.shape[-2:] == (seq, seq) and spec.square_key_mask:
        return attn_mask[:, :1, :1, :].expand(batch, 1, 1, seq), None
    return None, f"a {tuple(attn_mask.shape)} attention mask that is not a key mask"


def _check_ulysses(ulysses, spec: ModelSpec) -> None:
    if ulysses is None:
        return
    from vidsparse.parallel import UlyssesAttention

    if not isinstance(ulysses, UlyssesAttention):
        raise TypeError(
            f"ulysses must be a vidsparse.parallel.UlyssesAttention, got {type(ulysses).__name__}"
        )
    if ulysses.layout != "bshd":
        raise ValueError(
            f"ulysses must use layout='bshd' (diffusers' [B, S, H, D]), got {ulysses.layout!r}"
        )
    if spec.extra_tokens != "none":
        raise ValueError(
            f"sequence parallelism (ulysses=) is not supported on {spec.name} yet: its joint "
            "attention holds text tokens"
        )
