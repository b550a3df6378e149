"""What vidsparse tells ``torch.compile`` (Dynamo) about its functions, without importing Dynamo.

``torch._dynamo`` imports Triton, and importing vidsparse must not; the marks below set the
same attributes the ``torch.compiler`` decorators set, so they cost nothing at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["host_constant"]

F = TypeVar("F", bound=Callable)


def host_constant(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``, without importing ``torch._dynamo``
    (which imports Triton) when vidsparse is imported: that decorator only sets this flag.

    Dynamo does not trace a function so marked: at trace time it calls it on the host with the
    Python values of its arguments (they must be constants) and puts the tensors it returns
    into the graph as constants. Only for functions whose result depends on nothing else.
    """
    fn._dynamo_marked_constant = True
    return fn
