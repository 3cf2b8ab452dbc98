"""rewrite_windows: replace each JAGG window's W ``dit_call`` nodes by one ``jagg_window`` node.

The node is placed after the window's last call and reads the W calls' (args, kwargs); one
``getitem`` per step takes over the uses of the old call. Uses of an early step can precede the
last call in graph order (the unrolled loop interleaves step k's loss with step k+1's inputs),
so the graph is re-sorted topologically afterwards.

Invariant after: no trained ``dit_call`` of a JAGG window remains; each JAGG window is one
``jagg_window`` node; exact windows keep their ``dit_call`` nodes, now with their step number.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings

from torch import fx

from jaggc import _compat
from jaggc.graph_ops import DeferredGroupPlan, WindowPlan, jagg_window
from jaggc.runtime.window import deferred_grad_forwards

from .context import PassContext


def rewrite_windows(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    deferred = _deferred_group_plan(ctx)
    for w in ctx.windows:
        if w.mode != "jagg":
            for node in w.nodes:
                node.kwargs = {**node.kwargs, "step": node.meta["jagg_call"].step}
            continue
        options = dataclasses.replace(ctx.config.options, weights=ctx.config.weights, time_arg=w.time_arg)
        plan_name = f"jagg_plan_{w.index}"
        w.plan = WindowPlan(index=w.index, steps=tuple(w.steps), options=options, deferred=deferred)
        setattr(gm, plan_name, w.plan)
        last = w.nodes[-1]
        calls = tuple((n.args[1], n.args[2]) for n in w.nodes)
        with graph.inserting_after(last), warnings.catch_warnings():
            # get_attr of a plain object: fx warns because it only expects modules/tensors there
            warnings.simplefilter("ignore", UserWarning)
            plan = graph.get_attr(plan_name)
        with graph.inserting_after(plan):
            window_node = graph.call_function(jagg_window, (last.args[0], calls, plan))
        window_node.meta["jagg_window"] = w.index
        w.node = window_node
        anchor = window_node
        for pos, old in enumerate(w.nodes):
            with graph.inserting_after(anchor):
                out = graph.call_function(operator.getitem, (window_node, pos))
            anchor = out
            out.meta["jagg_call"] = old.meta["jagg_call"]
            out.meta["jagg_window"] = w.index
            old.replace_all_uses_with(out)
        for old in w.nodes:
            graph.erase_node(old)
        w.nodes = [u for u in window_node.users]
    _compat.topological_sort(gm)
    return gm


def _deferred_group_plan(ctx: PassContext) -> DeferredGroupPlan | None:
    """In per-window backward mode, the group the JAGG windows of one loss evaluation share."""
    jagg = [w for w in ctx.windows if w.mode == "jagg"]
    if ctx.config.options.backward != "per_window" or not jagg:
        return None
    total = deferred_grad_forwards([w.steps for w in jagg], ctx.config.options)
    ctx.notes.append("backward='per_window': each window's knot forward re-runs inside loss.backward() and is "
                     "freed after its joint backward (peak activations: one window)")
    return DeferredGroupPlan(grad_forwards=total, first_window=jagg[0].index)
