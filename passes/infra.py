"""What a pass is: a function over a GraphModule with its contract made executable.

Modelled on ``torch.fx.passes.infra.pass_base`` (``requires``, ``call``, ``ensures``): each pass
declares the facts it needs before it runs (``requires``), the facts it leaves (``provides``), the
facts it makes stale (``invalidates``: a transform that adds nodes the analyses never saw), when
it applies (``applies``: the low-memory pass only with ``backward="lowmem"``), and ``ensures``,
its docstring's "Invariant after" as code. The pipeline checks the order from the declarations
and, when asked (``check=True``: always in the tests, ``JAGGC_CHECK_PASSES=1`` or
``Options(check_passes=True)`` for users), runs each pass's ``ensures`` after it.

Facts are names: ``canonical`` (DiT calls are ``dit_call`` nodes), ``modes`` (every node's grad
mode and autocast state), ``dit_calls`` (CallSites, ``ctx.dit``), ``independent``, ``windows``,
``effects``, ``weights``, ``rewritten``, ``lowmem_terms``, ``clean``, ``placed_modes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import fx

from jaggc.errors import JaggInternalError

from .context import PassContext


def _always(ctx: PassContext) -> bool:
    return True


def _nothing(gm: fx.GraphModule, ctx: PassContext) -> None:
    return None


@dataclass(frozen=True)
class GraphPass:
    """A pass and its contract (module docstring); call it like the function it wraps."""

    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule | None]
    requires: frozenset = frozenset()
    provides: frozenset = frozenset()
    invalidates: frozenset = frozenset()
    ensures: Callable[[fx.GraphModule, PassContext], None] = _nothing
    analysis: bool = False      # reads the graph and stores facts; never changes the node list
    applies: Callable[[PassContext], bool] = _always

    @property
    def __name__(self) -> str:
        return self.fn.__name__

    @property
    def __doc__(self) -> str | None:
        return self.fn.__doc__

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        if not self.applies(ctx):
            return gm
        out = self.fn(gm, ctx)
        return gm if out is None else out

    def __repr__(self) -> str:
        return f"GraphPass({self.__name__})"


def graph_pass(*, requires=(), provides=(), invalidates=(), ensures=None, analysis: bool = False,
               applies: Callable[[PassContext], bool] | None = None):
    """Declare a function a pass (module docstring)."""
    def wrap(fn):
        return GraphPass(fn, frozenset(requires), frozenset(provides), frozenset(invalidates),
                         ensures or _nothing, analysis, applies or _always)
    return wrap


def check_order(passes, available: frozenset = frozenset()) -> None:
    """Refuse an order in which a pass runs before the facts it requires exist."""
    have = set(available)
    for p in passes:
        missing = p.requires - have
        if missing:
            raise JaggInternalError(f"pass {p.__name__} requires {sorted(missing)}, which no earlier pass of "
                                    f"{[q.__name__ for q in passes]} provides (or a later one made stale)")
        have -= p.invalidates
        have |= p.provides


def ensure(condition: bool, pass_name: str, what: str) -> None:
    """An ``ensures`` clause: a pass that left its invariant broken is a jaggc bug."""
    if not condition:
        raise JaggInternalError(f"pass {pass_name} broke its invariant: {what}")


__all__ = ["GraphPass", "check_order", "ensure", "graph_pass"]
