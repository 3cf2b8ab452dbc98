"""check_independence: no gradient path from one DiT call's output into a later call's input.

JAGG replaces Σ_k J_kᵀ g_k, which is the true gradient only if the steps are independent: the
stored states are data. The pass follows the dataflow without the edges that carry no gradient
(``detach`` and ops run with grad disabled) and refuses any path from a trained call to a later
trained call, naming both steps and the path (found on the networkx dataflow graph).

Invariant after: for trained calls i < j, call j's inputs are not gradient-reachable from call i.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import fx

from jaggc.errors import JaggGraphError
from jaggc.graph_ops import is_in_place, user_source
from jaggc.node_meta import CALL, GRAD

from .context import PassContext
from .infra import Fact, ensure, graph_pass
from .effects import effect_edges

_DETACH_TARGETS = {torch.detach, torch.Tensor.detach, "detach", "detach_", torch.ops.aten.detach.default}


def carries_gradient(node: fx.Node) -> bool:
    if not GRAD.get(node, True):
        return False
    if node.op in ("call_method", "call_function") and node.target in _DETACH_TARGETS:
        return False
    return True


def gradient_dataflow(gm: fx.GraphModule, written: dict | None = None) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_node(node.name)
        if not carries_gradient(node):
            continue
        for inp in list(node.all_input_nodes) + (written or {}).get(node, []):
            g.add_edge(inp.name, node.name)
    return g


def written_inputs(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, list[fx.Node]]:
    """node -> the in-place writes before it into storage it reads (effects.py): what they wrote
    flows into it like an argument, a gradient included."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for earlier, later, write in effect_edges(gm, ctx):
        if earlier is write:
            out.setdefault(later, []).append(write)
    return out


def reaching_calls(gm: fx.GraphModule, trained: list[fx.Node], written: dict | None = None) -> dict[fx.Node, int]:
    """For each trained call, the bitmask of the trained calls whose output reaches one of its
    inputs along gradient-carrying edges (bit i: ``trained[i]``), in-place writes into the storage
    a node reads counted as its inputs (``written``). One sweep in graph order, so a 100-step loss
    costs what its node count costs (``nx.descendants`` per call was quadratic)."""
    bit = {node: 1 << i for i, node in enumerate(trained)}
    reached: dict[fx.Node, int] = {}
    into_calls: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        mask = 0
        if carries_gradient(node):
            for inp in list(node.all_input_nodes) + (written or {}).get(node, []):
                mask |= reached.get(inp, 0)
        if node in bit:
            into_calls[node] = mask
            mask |= bit[node]
        reached[node] = mask
    return into_calls


def _ensure_independent(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Re-checked another way than the pass: from each trained call, what its output reaches in the
    gradient dataflow (networkx), instead of the pass's one-sweep reachability bitmasks."""
    trained = ctx.trained_calls(gm)
    flow = gradient_dataflow(gm, written_inputs(gm, ctx))
    names = {n.name for n in trained}
    for node in trained:
        reached = nx.descendants(flow, node.name) & names if node.name in flow else set()
        ensure(not reached, "check_independence", f"no trained call's input depends on {node.name}: {sorted(reached)}")


@graph_pass(requires={Fact.DIT_CALLS}, provides={Fact.INDEPENDENT}, analysis=True, ensures=_ensure_independent)
def check_independence(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Refuse a gradient path from one trained DiT call's output into a later call's input."""
    trained = ctx.trained_calls(gm)
    written = written_inputs(gm, ctx)
    into_calls = reaching_calls(gm, trained, written)
    for dst in sorted(trained, key=lambda n: CALL.of(n).step):
        mask = into_calls[dst]
        if not mask:
            continue
        node = trained[(mask & -mask).bit_length() - 1]          # the earliest call reaching it
        path = nx.shortest_path(gradient_dataflow(gm, written), node.name, dst.name)
        a, b = CALL.of(node), CALL.of(dst)
        writes = [n for n in gm.graph.nodes if n.name in path and is_in_place(n)]
        how = (f" (the in-place write {writes[0].name} at {user_source(writes[0]) or 'an unknown line'} puts it "
               f"into storage step {b.step} reads)" if writes else "")
        raise JaggGraphError(
            f"step {b.step} (node {dst.name}, {b.source or 'no source line'}) takes an input that depends on "
            f"the output of step {a.step} (node {node.name}) through {' -> '.join(path)}{how}. JAGG needs "
            f"stored trajectory states: `.detach()` the states (or compute them under torch.no_grad()) "
            f"so no gradient flows between DiT calls")
    return gm
