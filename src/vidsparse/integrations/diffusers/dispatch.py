"""Where vidsparse enters a diffusers model: the attention call of its own processors.

Every diffusers video transformer this integration covers computes attention through
``dispatch_attention_fn``, imported into the model's module. For each covered model module we
replace that one name with a shim, once, while a patched model of that module exists::

    WanAttnProcessor.__call__ (stock: projections, norms, RoPE, masks, output projection)
        -> transformer_wan.dispatch_attention_fn(q, k, v, attn_mask, ..., backend=...)
             = shim: a vidsparse self-attention call is active?  (ROUTES, set by hooks.py)
                  no  -> diffusers' dispatch_attention_fn, the same arguments: stock, bit for bit
                  yes -> the route: the method's attention, or the dense call above

The processors stay diffusers' own objects, so ``set_attention_backend``, the
``attention_backend()`` context manager and context parallelism configure them as usual; the
route hands every call it does not make sparse back to diffusers' dispatch with the backend the
processor chose.

``ROUTES`` is process-global (a stack: the innermost active self-attention last), so two
patched models must not run concurrently in threads of one process.

Under ``torch.compile``: Dynamo does not guard on module hooks (its default
``skip_nnmodule_hook_guards``), and regional compilation shares one cache between every block
of a class, in every model. A block graph traced through the shim with no route open (a model
not patched, while another patched model keeps the shim installed) would then be reused for a
patched model's blocks: the hooks never run and attention stays dense, silently (a trained
gate got no gradient). So the shim reads ``_EPOCH``, which every attach and detach changes:
each graph traced through it guards on the value and is traced again after a model is patched
or unpatched (once per compiled region; diffusers' dispatch and the shim differ by identity,
which Dynamo guards on too).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("vidsparse.integrations.diffusers")

DISPATCH_NAME = "dispatch_attention_fn"
# The signature the shim mirrors (diffusers 0.36 .. 0.42); checked before any model is patched.
DISPATCH_PARAMETERS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
    "attention_kwargs",
    "backend",
    "parallel_config",
)
SUPPORTED_DIFFUSERS = ">= 0.36 (tested up to 0.42)"

ROUTES: list = []  # the active self-attention calls (hooks.py pushes and pops them)
_EPOCH = 0  # changed by every attach and detach (the module docstring: compiled graphs)

# model module name -> (diffusers' function, the patched transformers that route through it)
_SHIMS: dict[str, tuple[Any, weakref.WeakSet]] = {}


@dataclass(frozen=True)
class DispatchArgs:
    """What a processor passed to ``dispatch_attention_fn`` besides q, k and v."""

    attn_mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    attention_kwargs: dict | None
    backend: Any
    parallel_config: Any
    original: Any  # diffusers' dispatch_attention_fn

    def dense(self, query, key, value) -> torch.Tensor:
        """Diffusers' own attention of ``[B, S, H, D]`` q/k/v, as the processor asked for it."""
        return self.original(
            query,
            key,
            value,
            self.attn_mask,
            self.dropout_p,
            self.is_causal,
            self.scale,
            self.enable_gqa,
            self.attention_kwargs,
            backend=self.backend,
            parallel_config=self.parallel_config,
        )


def _make_shim(original):
    def dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        attention_kwargs=None,
        *,
        backend=None,
        parallel_config=None,
    ):
        if _routed():
            args = DispatchArgs(
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                attention_kwargs,
                backend,
                parallel_config,
                original,
            )
            return ROUTES[-1].attend(query, key, value, args)
        return original(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            attention_kwargs,
            backend=backend,
            parallel_config=parallel_config,
        )

    dispatch_attention_fn.__wrapped__ = original
    dispatch_attention_fn.__doc__ = original.__doc__
    dispatch_attention_fn._vidsparse_shim = True
    return dispatch_attention_fn


def _routed() -> bool:
    """Is a vidsparse self-attention call open? ``_EPOCH`` is read first, so that a graph
    Dynamo traces through the shim guards on its value (module docstring)."""
    return _EPOCH >= 0 and len(ROUTES) > 0  # not bool(list): Dynamo in torch 2.11 cannot trace it


def _new_epoch() -> None:
    global _EPOCH
    _EPOCH += 1


def diffusers_dispatch():
    """diffusers' ``dispatch_attention_fn``, its signature checked; ``ImportError`` naming the
    supported versions on a diffusers without it."""
    try:
        import diffusers
        from diffusers.models import attention_dispatch
    except ImportError as exc:
        raise ImportError(
            f"vidsparse.integrations.diffusers needs diffusers {SUPPORTED_DIFFUSERS} "
            "(pip install 'vidsparse[diffusers]')"
        ) from exc
    original = getattr(attention_dispatch, DISPATCH_NAME, None)
    names = () if original is None else tuple(inspect.signature(original).parameters)
    if names != DISPATCH_PARAMETERS:
        raise ImportError(
            f"diffusers {diffusers.__version__} has no dispatch_attention_fn{DISPATCH_PARAMETERS}"
            f" (found {names or 'none'}); vidsparse supports diffusers {SUPPORTED_DIFFUSERS}"
        )
    return original


def check_routable(module_name: str) -> None:
    """``TypeError`` unless ``module_name`` calls diffusers' dispatch (or our shim of it)."""
    original = diffusers_dispatch()
    current = getattr(importlib.import_module(module_name), DISPATCH_NAME, None)
    if current is original or getattr(current, "_vidsparse_shim", False):
        return
    raise TypeError(
        f"{module_name}.{DISPATCH_NAME} is not diffusers' function (another library replaced "
        f"it: {current!r}); vidsparse routes attention only through diffusers' own"
    )


def attach(module_name: str, owner) -> None:
    """Install the shim in ``module_name`` (once) for ``owner``, a patched transformer."""
    check_routable(module_name)
    module = importlib.import_module(module_name)
    entry = _SHIMS.get(module_name)
    if entry is None:
        entry = _SHIMS[module_name] = (getattr(module, DISPATCH_NAME), weakref.WeakSet())
    if not getattr(getattr(module, DISPATCH_NAME), "_vidsparse_shim", False):
        setattr(module, DISPATCH_NAME, _make_shim(entry[0]))
        logger.debug("vidsparse: routing %s.%s", module_name, DISPATCH_NAME)
    entry[1].add(owner)
    _new_epoch()


def detach(module_name: str, owner) -> None:
    """Drop ``owner``; the last one out puts diffusers' function back."""
    entry = _SHIMS.get(module_name)
    if entry is None:
        return
    entry[1].discard(owner)
    _new_epoch()
    if len(entry[1]):
        return
    module = importlib.import_module(module_name)
    if getattr(getattr(module, DISPATCH_NAME, None), "_vidsparse_shim", False):
        setattr(module, DISPATCH_NAME, entry[0])
    del _SHIMS[module_name]
