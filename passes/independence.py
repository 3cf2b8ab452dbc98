"""check_independence: no gradient path from one DiT call's output into a later call's input.

JAGG replaces Σ_k J_kᵀ g_k, which is the true gradient only if the steps are independent: the
stored states are data. The pass builds the dataflow graph (networkx), drops edges that carry no
gradient (``detach`` and ops run with grad disabled), and refuses any path from a trained call
to a later trained call, naming both steps and the path.

Invariant after: for trained calls i < j, call j's inputs are not gradient-reachable from call i.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import fx

from jaggc.errors import JaggGraphError

from .context import PassContext

_DETACH_TARGETS = {torch.detach, torch.Tensor.detach, "detach", "detach_", torch.ops.aten.detach.default}


def carries_gradient(node: fx.Node) -> bool:
    if not node.meta.get("jagg_grad", True):
        return False
    if node.op in ("call_method", "call_function") and node.target in _DETACH_TARGETS:
        return False
    return True


def gradient_dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_node(node.name)
        if not carries_gradient(node):
            continue
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    return g


def check_independence(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    trained = ctx.trained_calls(gm)
    flow = gradient_dataflow(gm)
    later = {n.name: n for n in trained}
    for node in trained:
        reach = nx.descendants(flow, node.name)
        dependent = [later[name] for name in reach if name in later and name != node.name]
        if dependent:
            dst = min(dependent, key=lambda n: n.meta["jagg_call"].step)
            path = nx.shortest_path(flow, node.name, dst.name)
            a, b = node.meta["jagg_call"], dst.meta["jagg_call"]
            raise JaggGraphError(
                f"step {b.step} (node {dst.name}, {b.source or 'no source line'}) takes an input that depends on "
                f"the output of step {a.step} (node {node.name}) through {' -> '.join(path)}. JAGG needs "
                f"stored trajectory states: `.detach()` the states (or compute them under torch.no_grad()) "
                f"so no gradient flows between DiT calls")
    return gm
