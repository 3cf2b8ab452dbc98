"""What a pass is: a function over a GraphModule with its contract made executable.

Modelled on ``torch.fx.passes.infra.pass_base`` (``requires``, ``call``, ``ensures``): each pass
declares the facts it needs before it runs (``requires``), the facts it leaves (``provides``), the
facts it makes stale (``invalidates``: a transform that adds nodes the analyses never saw), when
it applies (``applies``: the low-memory pass only with ``backward="lowmem"``), and ``ensures``,
its docstring's "Invariant after" as code. The pipeline checks the order from the declarations
and, when asked (``check=True``: always in the tests, ``JAGGC_CHECK_PASSES=1`` or
``Options(check_passes=True)`` for users), runs each pass's ``ensures`` after it.

Facts are the symbols of ``Fact`` (a ``str`` enum: ``Fact.MODES == "modes"``). Every fact a pass
provides is required by a later pass or by ``RUNNABLE`` (what the graph that runs needs), so the
whole order is checked, rewrite -> low-memory terms -> cleanup -> mode placement included. A pass
that does not apply (``applies``: the CFG split with ``split_batches=False``, the low-memory pass
outside its mode) still provides its facts: they hold vacuously (no CFG call split, no term to
place). ``run_passes`` checks the order before it starts and each pass's ``requires`` against the
facts that hold as it runs, for the default passes and for ``passes=...`` alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from torch import fx

from jaggc.errors import JaggInternalError

from .context import PassContext


class Fact(str, Enum):
    """What holds of the graph after the pass that provides it (module docstring)."""

    CANONICAL = "canonical"         # every DiT call is a dit_call node (check_frontend)
    MODES = "modes"                 # every node carries its grad mode and autocast state (tag_modes)
    SPLITS = "splits"               # CFG batches split where a slice is detached (split_cfg_batches)
    DIT_CALLS = "dit_calls"         # CallSites on the DiT calls, ctx.dit (find_dit_calls)
    INDEPENDENT = "independent"     # the trained calls are gradient-independent (check_independence)
    WINDOWS = "windows"             # ctx.windows (assign_windows)
    EFFECTS = "effects"             # the windows' input writes and order constraints (check_window_inputs)
    WEIGHTS = "weights"             # each window's knots and basis (compute_weights)
    REWRITTEN = "rewritten"         # each window one runtime node (rewrite_windows)
    LOWMEM_TERMS = "lowmem_terms"   # the per-step terms feed their windows (place_lowmem_terms)
    CLEAN = "clean"                 # no dead node (cleanup)
    PLACED_MODES = "placed_modes"   # the grad/autocast switches where the modes change (place_modes)

    __hash__ = str.__hash__         # a fact and its name are one set member

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


#: the facts the graph that runs needs: the last pass's (every earlier one is required on the way)
RUNNABLE: frozenset = frozenset({Fact.REWRITTEN, Fact.CLEAN, Fact.PLACED_MODES})


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
        requires_, provides_, invalidates_ = (frozenset(Fact(f) for f in fs) for fs in (requires, provides, invalidates))
        return GraphPass(fn, requires_, provides_, invalidates_,
                         ensures or _nothing, analysis, applies or _always)
    return wrap


def check_order(passes, available: frozenset = frozenset(), *, finish: frozenset | None = RUNNABLE) -> None:
    """Refuse an order in which a pass runs before the facts it requires exist, or which ends
    without the facts of ``finish`` (default: ``RUNNABLE``; None: a partial pipeline)."""
    have = set(available)
    for p in passes:
        missing = p.requires - have
        if missing:
            raise JaggInternalError(f"pass {p.__name__} requires {sorted(missing)}, which no earlier pass of "
                                    f"{[q.__name__ for q in passes]} provides (or a later one made stale)")
        have -= p.invalidates
        have |= p.provides
    missing = (finish or frozenset()) - have
    if missing:
        raise JaggInternalError(f"the passes {[q.__name__ for q in passes]} end without {sorted(missing)}, which "
                                f"the graph that runs needs (infra.RUNNABLE)")


def check_requires(p: GraphPass, have) -> None:
    """While the passes run: refuse a pass whose required facts do not hold of the graph now."""
    missing = p.requires - set(have)
    if missing:
        raise JaggInternalError(f"pass {p.__name__} requires {sorted(missing)}, which do not hold of the graph "
                                f"as it stands (not provided yet, or made stale by a transform)")


def ensure(condition: bool, pass_name: str, what: str) -> None:
    """An ``ensures`` clause: a pass that left its invariant broken is a jaggc bug."""
    if not condition:
        raise JaggInternalError(f"pass {pass_name} broke its invariant: {what}")


__all__ = ["Fact", "GraphPass", "RUNNABLE", "check_order", "check_requires", "ensure", "graph_pass"]
