"""assign_windows: group consecutive trained DiT calls into windows of ``config.window`` steps.

A window holds consecutive trained calls of the same module with the same static argument
structure (same keywords, same constants), so their inputs can be batch-concatenated. A call
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
from jaggc.runtime.window import partition

from .context import PassContext, Window


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
    if not isinstance(cfg.window, int) or cfg.window < 2:
        raise JaggInputError(f"window={cfg.window!r}: a JAGG window needs an int of at least 2 steps")
    trained = ctx.trained_calls(gm)
    if len(trained) < 2:
        raise JaggInputError(
            f"the loss makes {len(trained)} grad-enabled DiT call: a JAGG window needs at least 2 steps, so "
            f"there is nothing to aggregate. Call the loss uncompiled (one DiT backward per step is "
            f"already the minimum)")
    if cfg.window > len(trained):
        raise JaggInputError(
            f"window={cfg.window} is larger than the {len(trained)} grad-enabled DiT calls in the loss; "
            f"use window <= {len(trained)}")
    ctx.windows = []
    for run in batch_compatible_runs(trained):
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
    if len(ctx.windows) > len(partition(len(trained), cfg.window)):
        ctx.notes.append("some DiT calls differ in argument structure; windows were cut at those calls")
    return gm
