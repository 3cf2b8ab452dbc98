"""assign_windows: group consecutive trained DiT calls into windows of ``config.window`` steps.

A window holds consecutive trained calls of the same module with the same static argument
structure (same keywords, same constants), so their inputs can be batch-concatenated. When every
sampling step makes several calls on the same state and timestep (two-call classifier-free
guidance: uncond, then cond), the calls are first sorted into streams (the s-th call of each step)
and windows are formed per stream: a window never mixes an uncond call with a cond call. A call
that breaks the structure starts a new run; each run is cut into windows of ``window`` steps and
a shorter tail becomes a window of its own length (exact when it has <= 2 steps, since then every
step is a knot). Without routing (``jagg_frac`` 1 or 0, no threshold or timestep rule) every window of
more than 2 steps is "jagg" (or "exact" at jagg_frac 0); with routing such windows are "routed": the
runtime scores them and picks JAGG or exact per call (runtime/routing.py).

Invariant after: every trained call belongs to exactly one window, windows are ordered by step,
and each call's CallSite has its window index and role ("knot", "interior" or "exact").
"""

from __future__ import annotations

from torch import fx

from jaggc._compat import tree_flatten
from jaggc.errors import JaggInputError
from jaggc.runtime.window import check_window_size, partition

from .context import PassContext, Window


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
    _, args, kwargs = node.args[:3]
    state = kwargs.get("hidden_states") if isinstance(kwargs, dict) and "hidden_states" in kwargs else (
        args[0] if args else next(iter(kwargs.values()), None))
    if isinstance(time_arg, int):
        time = args[time_arg] if len(args) > time_arg else None
    else:
        time = kwargs.get(time_arg or "timestep", args[1] if len(args) > 1 else None)
    return state, time


def streams(calls: list[fx.Node], time_arg) -> list[list[fx.Node]]:
    """The trained calls by stream: consecutive calls on the same state and timestep are one
    sampling step (two-call classifier-free guidance: uncond, then cond); the s-th call of every
    step is stream s. One stream when every step makes one call."""
    memo: dict = {}
    steps: list[list[fx.Node]] = []
    previous = None
    for node in calls:
        state, time = _state_and_time(node, time_arg)
        key = (_expr_key(state, memo), _expr_key(time, memo))
        if steps and key == previous:
            steps[-1].append(node)
        else:
            steps.append([node])
        previous = key
    width = max(len(s) for s in steps)
    if width == 1 or any(len(s) != width for s in steps):
        return [calls]
    return [[s[i] for s in steps] for i in range(width)]


def static_signature(node: fx.Node):
    """The call's structure with graph values erased: calls with equal signatures can be batched."""
    _, args, kwargs = node.args[:3]
    leaves, spec = tree_flatten((args, kwargs))
    return node.args[0].target, spec, tuple("<node>" if isinstance(x, fx.Node) else repr(x) for x in leaves)


def batch_compatible_runs(calls: list[fx.Node]) -> list[list[fx.Node]]:
    runs: list[list[fx.Node]] = []
    for node in calls:
        if runs and static_signature(runs[-1][-1]) == static_signature(node):
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def assign_windows(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    cfg = ctx.config
    check_window_size(cfg.window)
    trained = ctx.trained_calls(gm)
    if len(trained) < 2:
        raise JaggInputError(
            f"the loss makes {len(trained)} grad-enabled DiT call: a JAGG window needs at least 2 steps, so "
            f"there is nothing to aggregate. Call the loss uncompiled (one DiT backward per step is "
            f"already the minimum)")
    by_stream = streams(trained, cfg.time_arg)
    shortest = min(len(s) for s in by_stream)
    if cfg.window > shortest:
        per = f" per stream ({len(by_stream)} calls per sampling step)" if len(by_stream) > 1 else " in the loss"
        raise JaggInputError(
            f"window={cfg.window} is larger than the {shortest} grad-enabled DiT calls{per}; "
            f"use window <= {shortest}")
    ctx.windows = []
    if len(by_stream) > 1:
        ctx.notes.append(f"{len(by_stream)} DiT calls per sampling step (classifier-free guidance with separate "
                         f"calls): one window per stream, never mixing streams")
    runs_per_stream = [batch_compatible_runs(stream) for stream in by_stream]
    for run in [r for runs in runs_per_stream for r in runs]:
        for idx in partition(len(run), cfg.window):
            nodes = [run[i] for i in idx]
            if len(nodes) <= 2:
                mode = "exact"
            elif cfg.routing.active:
                mode = "routed"
            else:
                mode = "jagg" if cfg.jagg_frac == 1.0 else "exact"
            w = Window(index=len(ctx.windows), nodes=nodes, mode=mode,
                       steps=[n.meta["jagg_call"].step for n in nodes])
            ctx.windows.append(w)
            for n in nodes:
                site = n.meta["jagg_call"]
                site.window = w.index
                site.role = "exact" if mode == "exact" else "interior"
    if any(len(runs) > 1 for runs in runs_per_stream):
        ctx.notes.append("some DiT calls differ in argument structure; windows were cut at those calls")
    return gm
