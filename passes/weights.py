"""compute_weights: fix each JAGG window's knots, basis and timestep argument.

The weights themselves depend on the timestep values, which are data: the runtime computes
Φ from them at every call. This pass fixes everything static: where the timestep is read from
(``time_arg``: the keyword ``timestep`` if the calls pass it, else position 1), the basis, and
which window positions are knots.

Invariant after: every JAGG window has ``knots``, ``basis`` and ``time_arg``, its knot calls have
role "knot", and every call of the window passes the timestep argument.
"""

from __future__ import annotations

from torch import fx

from jaggc.errors import JaggInputError
from jaggc.node_meta import CALL
from jaggc.runtime.calls import time_position
from jaggc.runtime.weights import resolve_basis

from .context import PassContext
from .infra import Fact, ensure, graph_pass


def time_arg_of(node: fx.Node, time_arg):
    """Where a DiT call node passes its timestep (runtime/calls.py's layout); refused if it does not."""
    _, args, kwargs = node.args[:3]
    time_arg = time_position(kwargs, time_arg)
    present = time_arg in kwargs if isinstance(time_arg, str) else time_arg < len(args)
    if not present:
        site = CALL.of(node)
        raise JaggInputError(
            f"step {site.step} (node {node.name}{', ' + site.source if site.source else ''}): the DiT call has "
            f"no timestep argument {time_arg!r}; pass jagg_compile(options=jaggc.Options(time_arg=<keyword name or position of the timestep>))")
    return time_arg


def _ensure_weights(gm: fx.GraphModule, ctx: PassContext) -> None:
    for w in ctx.windows:
        if w.mode not in ("jagg", "routed"):
            continue
        ensure(bool(w.knots) and bool(w.basis) and w.time_arg is not None, "compute_weights",
               f"window {w.index} has its knots, basis and time argument")
        ensure(all(CALL.of(w.nodes[p]).role == "knot" for p in (w.knots[0], w.knots[-1])), "compute_weights",
               f"the endpoint calls of window {w.index} are knots")
        ensure(all(time_arg_of(n, w.time_arg) == w.time_arg for n in w.nodes), "compute_weights",
               f"every call of window {w.index} passes the timestep argument")


@graph_pass(requires={Fact.WINDOWS}, provides={Fact.WEIGHTS}, analysis=True, ensures=_ensure_weights)
def compute_weights(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Fix each JAGG window's knots, basis and timestep argument."""
    basis = resolve_basis(ctx.config.options.weights)
    for w in ctx.windows:
        if w.mode not in ("jagg", "routed"):
            continue
        w.time_arg = time_arg_of(w.nodes[0], ctx.config.options.time_arg)
        for node in w.nodes[1:]:
            # each call resolved on its own: a call that passes the timestep elsewhere must not be
            # read at the first call's position
            if time_arg_of(node, ctx.config.options.time_arg) != w.time_arg:
                raise JaggInputError(f"node {node.name}: timestep argument differs within window {w.index}")
        w.knots = basis.knot_positions(len(w.nodes))
        w.basis = basis.label()
        # a randomized basis draws its interior knot per call: only the endpoints are knots every time
        fixed = w.knots if basis.kind != "randomized" else (w.knots[0], w.knots[-1])
        for pos in fixed:
            CALL.of(w.nodes[pos]).role = "knot"
    return gm
