"""assign_windows: group consecutive trained DiT calls into windows of ``config.window`` steps.

The grouping rule is jaggc's one rule (runtime/grouping.py: streams of two-call CFG, runs of one
argument structure, windows of ``window`` steps with a shorter tail its own), applied here to fx
nodes: two calls are one sampling step when their state and timestep are the same expression of
the graph's inputs, and can share a batched call when their static signatures (argument structure
and constants, graph values erased) and their autocast states agree: a window whose calls would
run in different autocast states is cut there, as a change of module state is. ``window`` is the
largest window: a loss with fewer trained calls (MixGRPO's window shrinking to 3, 2, 1 steps at the
end of its run) gets windows of its length, and one with none (or one) has nothing to aggregate and
runs as written (its one call exact). Without routing (``jagg_frac`` 1 or 0, no threshold or
timestep rule) every window of more than 2 steps is "jagg" (or "exact" at jagg_frac 0); with
routing such windows are "routed": the runtime scores them and picks JAGG or exact per call
(runtime/routing.py).

Invariant after: every trained call belongs to exactly one window, windows are ordered by step
within each stream, and each call's CallSite has its window index and role ("knot", "interior" or
"exact").
"""

from __future__ import annotations

import warnings

from torch import fx

from jaggc._compat import tree_flatten
from jaggc.graph_ops import is_graph_value
from jaggc.node_meta import CALL
from jaggc.runtime.calls import argument_at, state_position, time_position
from jaggc.runtime.grouping import cut_announcement, group_windows, leaf_difference
from jaggc.runtime.window import check_window_size

from .context import PassContext, Window
from .infra import Fact, ensure, graph_pass


def _expr_key(node, memo: dict):
    """A structural key of a value: equal keys compute the same value from the same inputs (the
    state ``batch["latents"][:, j]`` written twice is one value)."""
    if not isinstance(node, fx.Node):
        return ("const", repr(node))
    if node in memo:
        return memo[node]
    if node.op in ("placeholder", "get_attr"):
        key = (node.op, node.target)
    else:
        leaves, spec = tree_flatten((node.args, node.kwargs))
        key = (node.op, str(node.target), str(spec), tuple(_expr_key(x, memo) for x in leaves))
    memo[node] = key
    return key


def _state_and_time(node: fx.Node, time_arg) -> tuple:
    """The graph values a DiT call takes as its state and its timestep (runtime/calls.py's layout)."""
    _, args, kwargs = node.args[:3]
    state = argument_at(args, kwargs, state_position(args, kwargs, is_graph_value))
    return state, argument_at(args, kwargs, time_position(kwargs, time_arg))


def same_step_of(calls: list[fx.Node], time_arg):
    """Calls j and k make one sampling step when their state and timestep are the same expression
    (the state ``batch["latents"][:, j]`` written twice is one value)."""
    memo: dict = {}
    keys = [tuple(_expr_key(v, memo) for v in _state_and_time(n, time_arg)) for n in calls]
    return lambda j, k: keys[j] == keys[k]


def static_signature(node: fx.Node):
    """The call's structure with graph values erased: calls with equal signatures can be batched."""
    _, args, kwargs = node.args[:3]
    leaves, spec = tree_flatten((args, kwargs))
    return node.args[0].target, spec, tuple("<node>" if isinstance(x, fx.Node) else repr(x) for x in leaves)


def _announce_cuts(grouping, trained: list[fx.Node], window: int, ctx: PassContext) -> None:
    """Never silently slow: a cut that makes more windows (more DiT backward passes) is announced,
    naming the argument that differs (a Python-number timestep makes every step its own structure)."""
    def differ(j: int, k: int) -> str:
        a, b = CALL.of(trained[j]).autocast, CALL.of(trained[k]).autocast
        if a != b:
            return f"the autocast state ({a.describe()} vs {b.describe()})"
        return leaf_difference(tuple(trained[j].args[1:3]), tuple(trained[k].args[1:3]),
                               is_value=lambda x: isinstance(x, fx.Node))

    note = cut_announcement(grouping, window, differ, calls_named="steps")
    if note is not None:
        ctx.notes.append(note)
        warnings.warn(f"jaggc: {note}", stacklevel=2)


def _ensure_windows(gm: fx.GraphModule, ctx: PassContext) -> None:
    trained = ctx.trained_calls(gm)
    members = [n for w in ctx.windows for n in w.nodes]
    ensure(sorted(members, key=lambda n: CALL.of(n).step) == trained and len(set(members)) == len(members),
           "assign_windows", "every trained call is in exactly one window")
    for w in ctx.windows:
        ensure(w.steps == sorted(w.steps) and len(w.nodes) <= ctx.config.window, "assign_windows",
               f"window {w.index} is ordered by step and at most {ctx.config.window} steps")
        ensure(all(CALL.of(n).window == w.index and CALL.of(n).role in ("knot", "interior", "exact") for n in w.nodes),
               "assign_windows", f"the calls of window {w.index} know their window and role")
        ensure(len({CALL.of(n).autocast for n in w.nodes}) == 1, "assign_windows",
               f"the calls of window {w.index} run in one autocast state")


@graph_pass(requires={Fact.DIT_CALLS, Fact.INDEPENDENT}, provides={Fact.WINDOWS}, analysis=True, ensures=_ensure_windows)
def assign_windows(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Group consecutive trained DiT calls into windows of ``config.window`` steps."""
    cfg = ctx.config
    check_window_size(cfg.window)
    trained = ctx.trained_calls(gm)
    ctx.windows = []
    if not trained:
        return gm
    grouping = group_windows(len(trained), cfg.window, same_step=same_step_of(trained, cfg.options.time_arg),
                             batch_key=lambda k: (static_signature(trained[k]), CALL.of(trained[k]).autocast))
    ctx.notes.extend(grouping.notes())
    _announce_cuts(grouping, trained, cfg.window, ctx)
    for idx in grouping.windows:
        nodes = [trained[k] for k in idx]
        if len(nodes) <= 2:
            mode = "exact"
        elif cfg.routing.active:
            mode = "routed"
        else:
            mode = "jagg" if cfg.routing.jagg_frac == 1.0 else "exact"
        w = Window(index=len(ctx.windows), nodes=nodes, mode=mode, steps=[CALL.of(n).step for n in nodes],
                   autocast=CALL.of(nodes[0]).autocast)
        ctx.windows.append(w)
        for n in nodes:
            site = CALL.of(n)
            site.window = w.index
            site.role = "exact" if mode == "exact" else "interior"
    return gm
