"""The modes every node runs under (grad mode, autocast state): tagged from the capture's switches,
placed again after the rewrite.

A frontend records ``with torch.no_grad():`` as ``_set_grad_enabled(False)`` / ``(True)`` nodes
(Dynamo does; the FX frontend emits the same) and ``with torch.autocast(...):`` as autocast
switches: jaggc's absolute ``set_autocast(state)`` (the FX frontend) or Dynamo's
``_enter_autocast`` / ``_exit_autocast`` pairs. ``tag_modes`` turns them into per-node facts,
``meta["jagg_grad"]`` and ``meta["jagg_autocast"]``. A switch node has no data edges, so the
rewrite's topological re-sort may move glue across it: step 0's glue moves below the window node at
step 3, and a no-grad block (a KL reference, a diagnostic) or an autocast block (the trainers'
bf16 block around the DiT call) between them would silently change the mode that glue runs
under. So ``place_modes`` drops every switch and rebuilds them from the facts after every move;
the autocast switches it emits are jaggc's absolute ones (runtime/autocast.py).

Nodes the rewrite creates (window nodes, their getitems) carry both facts too; placeholders and
``get_attr`` nodes compute nothing and need no mode.

Invariant after ``place_modes``: running the nodes in order and applying each switch, every node
runs under its ``meta["jagg_grad"]`` and ``meta["jagg_autocast"]``, consecutive switches of one
kind differ, and the graph returns in its entry modes.
"""

from __future__ import annotations

import contextlib
import warnings

from torch import fx

from jaggc._compat import DYNAMO_ENTER_AUTOCAST, DYNAMO_EXIT_AUTOCAST, SET_GRAD_ENABLED
from jaggc.errors import JaggInternalError
from jaggc.graph_ops import is_autocast_switch, set_autocast
from jaggc.node_meta import AUTOCAST, GRAD
from jaggc.runtime.autocast import autocast_applied, current_autocast

from .context import PassContext
from .infra import Fact, ensure, graph_pass


def is_grad_switch(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is SET_GRAD_ENABLED


def is_mode_switch(node: fx.Node) -> bool:
    return is_grad_switch(node) or is_autocast_switch(node)


def _ensure_tagged(gm: fx.GraphModule, ctx: PassContext) -> None:
    for node in gm.graph.nodes:
        ensure(GRAD.on(node) and AUTOCAST.on(node), "tag_modes", f"{node.name} has its grad mode and autocast state")


@graph_pass(requires={Fact.CANONICAL}, provides={Fact.MODES}, analysis=True, ensures=_ensure_tagged)
def tag_modes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """``meta["jagg_grad"]`` and ``meta["jagg_autocast"]`` on every node, from the switches.

    Dynamo's autocast regions are relative (``_enter_autocast("cpu", None, True, None)`` takes the
    dtype the device has at that point), so they are entered and exited here for real, in graph
    order from the entry state, and each node's fact is the state read off the thread: exactly what
    running the captured graph would do."""
    grad = ctx.entry_grad
    regions: dict[fx.Node, object] = {}
    with contextlib.ExitStack() as unwind, autocast_applied(ctx.entry_autocast), warnings.catch_warnings():
        # a CUDA region traced on a machine without CUDA warns that it disables itself
        warnings.simplefilter("ignore", UserWarning)
        unwind.callback(lambda: [region.__exit__(None, None, None) for region in reversed(regions.values())])
        for node in gm.graph.nodes:
            if is_grad_switch(node):
                grad = bool(node.args[0])
            elif node.op == "call_function" and node.target is set_autocast:
                for region in reversed(list(regions.values())):
                    region.__exit__(None, None, None)
                regions.clear()
                regions[node] = autocast_applied(node.args[0])
                regions[node].__enter__()
            elif node.op == "call_function" and node.target is DYNAMO_ENTER_AUTOCAST:
                regions[node] = DYNAMO_ENTER_AUTOCAST(*node.args)
            elif node.op == "call_function" and node.target is DYNAMO_EXIT_AUTOCAST:
                region = regions.pop(node.args[0], None)
                if region is None:
                    raise JaggInternalError(f"{node.name} exits an autocast region that was not entered")
                DYNAMO_EXIT_AUTOCAST(region)
            GRAD.set(node, grad)
            AUTOCAST.set(node, current_autocast())


def _ensure_modes_placed(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replay the switches in order: each node runs in its facts' modes, no switch repeats the
    mode in force, and the output is reached in the entry modes."""
    grad, autocast = ctx.entry_grad, ctx.entry_autocast
    for node in gm.graph.nodes:
        if is_grad_switch(node):
            ensure(bool(node.args[0]) != grad, "place_modes", f"{node.name} switches grad mode to the mode in force")
            grad = bool(node.args[0])
        elif node.op == "call_function" and node.target is set_autocast:
            ensure(node.args[0] != autocast, "place_modes", f"{node.name} switches autocast to the state in force")
            autocast = node.args[0]
        elif node.op == "output":
            ensure((grad, autocast) == (ctx.entry_grad, ctx.entry_autocast), "place_modes",
                   "the graph returns in its entry modes")
        elif node.op not in ("placeholder", "get_attr"):
            ensure((GRAD.of(node), AUTOCAST.of(node)) == (grad, autocast), "place_modes",
                   f"{node.name} runs under its recorded grad mode and autocast state")


@graph_pass(requires={Fact.MODES, Fact.CLEAN}, provides={Fact.PLACED_MODES}, ensures=_ensure_modes_placed)
def place_modes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Place grad-mode and autocast switches where the recorded modes change, after the rewrite."""
    graph = gm.graph
    # an _exit_autocast reads its _enter_autocast: erase users before what they read
    for node in reversed([n for n in graph.nodes if is_mode_switch(n)]):
        graph.erase_node(node)
    grad, autocast = ctx.entry_grad, ctx.entry_autocast
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            wanted_grad, wanted_autocast = ctx.entry_grad, ctx.entry_autocast
        else:
            wanted_grad, wanted_autocast = GRAD.get(node), AUTOCAST.get(node)
            if wanted_grad is None or wanted_autocast is None:
                raise JaggInternalError(f"node {node.name} ({node.format_node()}) has no grad-mode or autocast "
                                        f"fact; a pass created it without node_meta.GRAD / node_meta.AUTOCAST")
        if wanted_autocast != autocast:
            autocast = wanted_autocast
            _insert_switch(graph, node, set_autocast, autocast, grad, autocast)
        if wanted_grad != grad:
            grad = wanted_grad
            _insert_switch(graph, node, SET_GRAD_ENABLED, grad, grad, autocast)
    return gm


def _insert_switch(graph: fx.Graph, before: fx.Node, target, value, grad: bool, autocast) -> None:
    """A mode switch ``target(value)`` before ``before``, itself in the modes it leaves in force."""
    with graph.inserting_before(before):
        switch = graph.call_function(target, (value,))
    GRAD.set(switch, grad)
    AUTOCAST.set(switch, autocast)
