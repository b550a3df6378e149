"""The engine's epilogue contract: what a client fuses into the engine's kernels.

A client op (one that adds a second branch to the output, say) declares an
:class:`Epilogue` subclass: jit functions that the kernels call at fixed points, and the host
code that hands them their arguments. The engine calls them without knowing what they do::

    forward   o = forward(o, b, h, q_block, rows, local_rows, dims, *forward_args)
              on the normalised fp32 o [rows, D] of a query block, before its one store
    backward  o, do, lse2 = prologue(o, do, lse2, b, h, q_block, rows, local_rows, dims,
                                     *prologue_args)
              in the preprocess pass: recover the engine's o from the stored output, zero
              do / set lse2 = +inf on rows that carry no gradient, form the client's own
              gradients from this one read of do
              dq = dq(dq, b, h, q_block, local_rows, dims, *grad_args)
              dk, dv = dkdv(dk, dv, b, h, kv_block, dims, *grad_args)
              on the finished gradients, before their stores

``rows`` index the (b, h) sequence, ``local_rows`` the query block (int), ``dims`` the head
dim. An epilogue whose query blocks have rows without gradient (its prologue zeroes their
do, or the caller drops those outputs) says which (:meth:`Epilogue.quiet_rows`), so that
dK/dV may walk fewer query rows there.
``grad_args`` are asked for after the prologue ran, so they may depend on what it wrote.
An epilogue may also keep a tensor of its own from the forward to the backward
(:meth:`Epilogue.forward_saved`): the custom ops allocate it as a forward output, keep it
with o and set it as ``saved`` before either pass, so the forward hook can fill it and the
backward hooks read it (what storing o in a 16-bit dtype rounded away, say).
The same epilogue runs on the PyTorch backend through its ``*_torch`` methods, so every
backend computes the same thing. Subclasses register with :func:`register_epilogue`; the
engine's custom ops carry the epilogue as its name and at most ``MAX_TENSORS`` tensors, and
optionally a ``spec``: host facts of the call (ints a hook needs without reading a tensor
back), a string the custom ops carry after the name (``"name|spec"``; a constant to
``torch.compile``) and hand back to the subclass's constructor as ``spec=``.
Modelled on ``triton_kernels``' ``Epilogue`` / ``FnSpecs``.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

MAX_TENSORS = 7
SPEC_SEPARATOR = "|"


@dataclass(frozen=True)
class FnSpecs:
    """A jit function the kernels call at one hook point, and what its extra arguments are."""

    name: str
    fn: Any  # @triton.jit (or, for the Hopper forward, @gluon.jit) function
    arg_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class EpilogueFns:
    """One function per hook point. ``forward_sm90``, ``dq_sm90`` and ``dkdv_sm90`` are the
    Hopper Gluon kernels' versions of ``forward``, ``dq`` and ``dkdv``; without one that kernel
    is not taken (the Triton one is)."""

    forward: FnSpecs
    prologue: FnSpecs
    dq: FnSpecs
    dkdv: FnSpecs
    forward_sm90: FnSpecs | None = None
    dkdv_sm90: FnSpecs | None = None
    dq_sm90: FnSpecs | None = None


class EngineCall(NamedTuple):
    """What an epilogue's host code may need to know about the engine call."""

    block_q: int
    block_kv: int
    kv_block_sizes: torch.Tensor | None
    scale: float
    dtype: torch.dtype  # q's


def gluon_fn(name: str, module: str, attr: str) -> FnSpecs | None:
    """``FnSpecs`` of a ``@gluon.jit`` hook, or None where Triton has no Gluon (the engine
    then runs its Triton kernels on Hopper too)."""
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError:
        return None
    return FnSpecs(name, fn)


@functools.cache
def _identity_fns() -> EpilogueFns:
    # Imported here: importing vidsparse must need no Triton (the CPU path runs without it).
    from vidsparse.ops.block_sparse_attn.kernels import no_epilogue

    return EpilogueFns(
        forward=FnSpecs("none", no_epilogue.forward_identity),
        prologue=FnSpecs("none", no_epilogue.prologue_identity),
        dq=FnSpecs("none", no_epilogue.dq_identity),
        dkdv=FnSpecs("none", no_epilogue.dkdv_identity),
        forward_sm90=gluon_fn(
            "none", "vidsparse.ops.block_sparse_attn.kernels.fwd_sm90", "forward_identity_sm90"
        ),
        dkdv_sm90=gluon_fn(
            "none", "vidsparse.ops.block_sparse_attn.kernels.bwd_sm90", "dkdv_identity_sm90"
        ),
        dq_sm90=gluon_fn(
            "none", "vidsparse.ops.block_sparse_attn.kernels.bwd_sm90", "dq_identity_sm90"
        ),
    )


class Epilogue:
    """Base class: no epilogue (every hook returns its input). Instances hold the client's
    tensors for one call and the state between its backward hooks."""

    name: ClassVar[str] = "none"
    spec: str = ""  # host facts of the call (module docstring)
    saved: torch.Tensor | None = None  # forward_saved's tensor, set by the custom ops

    def forward_saved(self, q: torch.Tensor) -> torch.Tensor | None:
        """A new tensor for the forward hook to fill and the backward hooks to read (as
        ``saved``), given the engine's q; None (the default): none. It must not depend on
        the values of the epilogue's tensors (the fake forward calls it too)."""
        return None

    def __init__(self, *tensors: torch.Tensor | None):
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"an epilogue carries at most {MAX_TENSORS} tensors")
        self.tensors = tensors

    @property
    def call_name(self) -> str:
        """What the custom ops carry: the registered name, and the spec after ``|``."""
        return f"{self.name}{SPEC_SEPARATOR}{self.spec}" if self.spec else self.name

    def fns(self) -> EpilogueFns:
        """The jit functions (a method: Gluon imports only where it is used)."""
        return _identity_fns()

    def quiet_rows(self, call: EngineCall) -> torch.Tensor | None:
        """int32, at least ``[NQ]``: per query block, the rows from which on no row carries
        gradient (the prologue zeroes their ``do`` or sets ``lse2 = +inf``, or their ``do``
        arrives zero), so the backward may skip them; None (the default): every row may."""
        return None

    # --- Triton path: argument tuples of the hooks
    def forward_args(self, call: EngineCall) -> tuple:
        return ()

    def prologue_args(self, call: EngineCall, do: torch.Tensor) -> tuple:
        return ()

    def grad_args(self, call: EngineCall) -> tuple:
        return ()

    # --- PyTorch path: the same arithmetic on the reference
    def forward_torch(self, o: torch.Tensor, call: EngineCall) -> torch.Tensor:
        return o

    def prologue_torch(self, o, do, call: EngineCall) -> tuple[torch.Tensor, torch.Tensor]:
        """``(the engine's o, the do its gradients come from)``."""
        return o, do

    def grads_torch(self, dq, dk, dv, call: EngineCall) -> tuple[torch.Tensor, ...]:
        return dq, dk, dv

    # --- gradients of the carried tensors, after either path's backward
    def gradients(self) -> tuple[torch.Tensor | None, ...]:
        return (None,) * len(self.tensors)

    def fake_gradients(self) -> tuple[torch.Tensor | None, ...]:
        """Shapes of ``gradients`` for ``torch.compile``'s fake tensors."""
        return (None,) * len(self.tensors)


NO_EPILOGUE = Epilogue()
_REGISTRY: dict[str, type[Epilogue]] = {Epilogue.name: Epilogue}


def register_epilogue(cls: type[Epilogue]) -> type[Epilogue]:
    """Class decorator: make ``cls`` known to the engine's custom ops by its ``name``."""
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"an epilogue named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def epilogue_from(call_name: str, tensors) -> Epilogue:
    """The epilogue a custom op call carries (its ``call_name`` and tensors)."""
    if call_name == Epilogue.name:
        return NO_EPILOGUE
    name, _, spec = call_name.partition(SPEC_SEPARATOR)
    if name not in _REGISTRY:
        raise ValueError(
            f"no epilogue named {name!r} is registered (the module that declares it must be "
            f"imported first); known: {sorted(_REGISTRY)}"
        )
    return _REGISTRY[name](*tensors, spec=spec) if spec else _REGISTRY[name](*tensors)


def padded_tensors(epilogue: Epilogue) -> list[torch.Tensor | None]:
    """The epilogue's tensors in the custom ops' ``MAX_TENSORS`` slots."""
    return [*epilogue.tensors, *([None] * (MAX_TENSORS - len(epilogue.tensors)))]
