"""rewrite_windows: replace each JAGG window's W ``dit_call`` nodes by one ``jagg_window`` node.

The node is placed after the window's last call and reads the W calls' (args, kwargs); one
``getitem`` per step takes over the uses of the old call. Uses of an early step can precede the
last call in graph order (the unrolled loop interleaves step k's loss with step k+1's inputs),
so the graph is re-sorted topologically afterwards.

Invariant after: no trained ``dit_call`` of a JAGG window remains; each JAGG window is one
``jagg_window`` node; exact windows keep their ``dit_call`` nodes, now with their step number. With
``backward="lowmem"`` every window, exact ones included, is one ``jagg_lowmem_window`` node (its
plan's term count and last-window flag are filled in by ``place_lowmem_terms``).
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
import warnings

from torch import fx

from jaggc.errors import JaggGraphError, JaggInternalError
from jaggc.graph_ops import (DeferredGroupPlan, LowMemPlan, LowMemWindowPlan, TrajectoryPlan, WindowPlan,
                             copy_output, dit_call, jagg_lowmem_window, jagg_trajectory, jagg_window)
from jaggc.node_meta import AUTOCAST, CALL, GRAD, WINDOW
from jaggc.runtime.window import deferred_grad_forwards

from .context import PassContext
from .infra import Fact, ensure, graph_pass
from .effects import effect_order, written_outputs


def _ensure_rewritten(gm: fx.GraphModule, ctx: PassContext) -> None:
    lowmem = ctx.config.options.backward.support.backward_in_forward
    rewritten = {w.index for w in ctx.windows if lowmem or w.mode in ("jagg", "routed")}
    live = set(gm.graph.nodes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is dit_call and CALL.on(node):
            site = CALL.of(node)
            ensure(site.step is None or site.window not in rewritten, "rewrite_windows",
                   f"{node.name}: no trained dit_call of a rewritten window (here {site.window}) remains")
            ensure(site.step is None or node.kwargs.get("step") == site.step, "rewrite_windows",
                   f"{node.name}: an exact window's dit_call carries its step number")
    for w in ctx.windows:
        ensure(w.index not in rewritten or w.node in live, "rewrite_windows", f"window {w.index} runs as one runtime node")
    targets = {jagg_window, jagg_lowmem_window}   # a jagg_trajectory node's plan lists its windows
    ensure(all(WINDOW.on(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in targets),
           "rewrite_windows", "every runtime window node records its window")


@graph_pass(requires={Fact.WEIGHTS, Fact.EFFECTS}, provides={Fact.REWRITTEN}, ensures=_ensure_rewritten)
def rewrite_windows(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace each window's W ``dit_call`` nodes by one runtime node (``jagg_window`` and its kin)."""
    graph = gm.graph
    _rewrite_routed(gm, ctx)
    deferred = _deferred_group_plan(ctx)
    lowmem = ctx.config.options.backward.support.backward_in_forward
    if lowmem and ctx.windows:
        gm.jagg_lowmem_plan = LowMemPlan(num_windows=len(ctx.windows), first_window=ctx.windows[0].index)
    _cached_references(gm, ctx)
    written = written_outputs(gm)
    for w in ctx.windows:
        if w.mode == "routed":
            continue
        if w.mode != "jagg" and not lowmem:
            for node in w.nodes:
                node.kwargs = {**node.kwargs, "step": CALL.of(node).step}
            continue
        options = dataclasses.replace(ctx.config.options, time_arg=w.time_arg)
        plan_name = f"jagg_plan_{w.index}"
        if lowmem:
            # every window, exact ones too (all steps knots): each must free its activations early
            w.plan = LowMemWindowPlan(index=w.index, steps=tuple(w.steps), options=options, exact=w.mode != "jagg",
                                      terms={}, last=False, shared=gm.jagg_lowmem_plan)
            target = jagg_lowmem_window
        else:
            w.plan = WindowPlan(index=w.index, steps=tuple(w.steps), options=options, deferred=deferred)
            target = jagg_window
        setattr(gm, plan_name, w.plan)
        last = w.nodes[-1]
        calls = tuple((n.args[1], n.args[2]) for n in w.nodes)
        with graph.inserting_after(last), warnings.catch_warnings():
            # get_attr of a plain object: fx warns because it only expects modules/tensors there
            warnings.simplefilter("ignore", UserWarning)
            plan = graph.get_attr(plan_name)
        with graph.inserting_after(plan):
            window_node = graph.call_function(target, (last.args[0], calls, plan))
        WINDOW.set(window_node, w.index)
        # a window's calls are trained, grad-enabled calls of one autocast state (assign_windows)
        GRAD.set(window_node, True)
        AUTOCAST.set(window_node, w.autocast)
        w.node = window_node
        anchor = window_node
        for pos, old in enumerate(w.nodes):
            with graph.inserting_after(anchor):
                out = graph.call_function(operator.getitem, (window_node, pos))
            anchor = out
            CALL.set(out, CALL.of(old))
            WINDOW.set(out, w.index)
            GRAD.set(out, True)
            AUTOCAST.set(out, w.autocast)
            if old in written:
                out = anchor = _writable_copy(graph, out)
            old.replace_all_uses_with(out)
        for old in w.nodes:
            ctx.replaced[old] = window_node
            graph.erase_node(old)
        w.nodes = [u for u in window_node.users]
    restore_topological_order(gm.graph, effect_order(ctx))
    return gm


def _writable_copy(graph: fx.Graph, out: fx.Node) -> fx.Node:
    """A window hands out its steps' outputs as views of one autograd function's outputs, which
    autograd does not let the loss write in place; a step output the loss writes into (``v.mul_``)
    is handed out as a copy, which only the loss holds, as it held the DiT's output."""
    with graph.inserting_after(out):
        copy = graph.call_function(copy_output, (out,))
    for fact in (CALL, WINDOW, GRAD, AUTOCAST):
        fact.set(copy, fact.of(out))
    return copy


def _cached_references(gm: fx.GraphModule, ctx: PassContext) -> None:
    """With a rollout cache, no-grad reference calls look their output up in it first (the split
    uncond half of a CFG call was part of the rollout's call)."""
    if ctx.config.options.rollout_cache is None:
        return
    gm.jagg_reference_options = ctx.config.options
    for node in ctx.dit_calls(gm):
        if CALL.of(node).role == "reference" and "options" not in node.kwargs:
            with gm.graph.inserting_before(node), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                attr = gm.graph.get_attr("jagg_reference_options")
            node.kwargs = {**node.kwargs, "options": attr}


def restore_topological_order(graph: fx.Graph, effects: list[tuple[fx.Node, fx.Node]] = ()) -> None:
    """Reorder ``graph`` in place so every node follows its inputs and every ``(earlier, later)``
    pair of ``effects`` (in-place writes and the reads around them, effects.py) keeps its order,
    keeping the original order wherever the dependencies allow (Kahn's algorithm, ready nodes taken
    by original position).

    A window node sits after the window's last call, so the glue of its earlier steps, which now
    reads the window's outputs, must move below it. Nodes are relinked, not copied: fx's
    ``stable_topological_sort`` rebuilds the whole graph (2.5 s for a 50-step loss)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    effects = {(a, b) for a, b in effects if a in position and b in position}
    after: dict[fx.Node, list[fx.Node]] = {}
    for earlier, later in effects:
        after.setdefault(earlier, []).append(later)
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    for _, later in effects:
        waiting[later] += 1
    ready = [position[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for user in list(node.users) + after.get(node, []):
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, position[user])
    if len(order) != len(nodes):
        stuck = [n for n in nodes if waiting[n]]
        steps = sorted({CALL.of(n).step for n in stuck
                        if CALL.on(n) and CALL.of(n).step is not None})
        raise JaggInternalError(
            f"the rewritten graph cannot be ordered: DiT steps {steps} wait for each other ({len(stuck)} nodes, "
            f"from {stuck[0].name}); check_window_inputs should have refused this loss naming the steps")
    if order == nodes:
        return
    nodes[0].prepend(order[0])
    for prev, node in zip(order, order[1:]):
        if prev.next is not node:
            prev.append(node)


def _rewrite_routed(gm: fx.GraphModule, ctx: PassContext) -> None:
    """All routed windows become ONE ``jagg_trajectory`` node: choosing the best ⌊jagg_frac·n⌋
    windows needs every window's score before any window runs. It is placed after the last of their
    calls; the independence pass proved no call's input depends on a DiT output, so every input is
    available there and the topological sort only moves readers of early steps after it."""
    routed = [w for w in ctx.windows if w.mode == "routed"]
    if not routed:
        return
    states = {w.autocast for w in routed}
    if len(states) > 1:
        other = next(w for w in routed if w.autocast != routed[0].autocast)
        raise JaggGraphError(
            f"{CALL.of(other.nodes[0]).source or 'the loss'}: routing scores all windows in one "
            f"trajectory node, but step {other.steps[0]} runs in autocast {other.autocast.describe()} and step "
            f"{routed[0].steps[0]} in {routed[0].autocast.describe()}. Keep the trained DiT calls in one autocast "
            f"state, or route without a score (jaggc.Routing(jagg_frac=1.0), no threshold)")
    graph = gm.graph
    options = dataclasses.replace(ctx.config.options, time_arg=routed[0].time_arg)
    plan = TrajectoryPlan(windows=tuple(tuple(w.steps) for w in routed),
                          window_indices=tuple(w.index for w in routed), options=options,
                          routing=ctx.config.routing)
    gm.jagg_trajectory_plan = plan
    nodes = [n for w in routed for n in w.nodes]
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(nodes, key=order.__getitem__)
    calls = tuple(tuple((n.args[1], n.args[2]) for n in w.nodes) for w in routed)
    with graph.inserting_after(last), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        plan_node = graph.get_attr("jagg_trajectory_plan")
    with graph.inserting_after(plan_node):
        node = graph.call_function(jagg_trajectory, (last.args[0], calls, plan_node))
    GRAD.set(node, True)
    AUTOCAST.set(node, routed[0].autocast)
    anchor = node
    written = written_outputs(gm)
    for pos, old in enumerate(nodes):
        with graph.inserting_after(anchor):
            out = graph.call_function(operator.getitem, (node, pos))
        anchor = out
        CALL.set(out, CALL.of(old))
        WINDOW.set(out, CALL.of(old).window)
        GRAD.set(out, True)
        AUTOCAST.set(out, routed[0].autocast)
        if old in written:
            out = anchor = _writable_copy(graph, out)
        old.replace_all_uses_with(out)
    for old in nodes:
        ctx.replaced[old] = node
        graph.erase_node(old)
    for w in routed:
        w.node, w.plan = node, plan


def _deferred_group_plan(ctx: PassContext) -> DeferredGroupPlan | None:
    """In per-window backward mode, the group the JAGG windows of one loss evaluation share."""
    jagg = [w for w in ctx.windows if w.mode == "jagg"]
    if not ctx.config.options.backward.support.knots_in_backward or not jagg:
        return None
    total = deferred_grad_forwards([w.steps for w in jagg], ctx.config.options)
    ctx.notes.append("backward='per_window': each window's knot forward re-runs inside loss.backward() and is "
                     "freed after its joint backward (peak activations: one window)")
    return DeferredGroupPlan(grad_forwards=total, first_window=jagg[0].index)
