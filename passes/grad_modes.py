"""place_grad_modes: rebuild the grad-mode switches from the per-node grad facts.

A frontend records ``with torch.no_grad():`` as ``_set_grad_enabled(False)`` / ``(True)`` nodes
(Dynamo does; the FX frontend emits the same), and ``find_dit_calls`` stores the mode every node
runs under as ``meta["jagg_grad"]``. A switch node has no data edges, so the rewrite's topological
re-sort may move glue across it: step 0's glue moves below the window node at step 3, and a
no-grad block (a KL reference, a diagnostic) between them would silently change the mode that glue
runs under. So the switches are dropped and rebuilt from the facts after every move.

Nodes the rewrite creates (window nodes, their getitems) carry ``jagg_grad`` too; placeholders and
``get_attr`` nodes compute nothing and need no mode.

Invariant after: running the nodes in order and applying each switch, every node runs under its
``meta["jagg_grad"]``, consecutive switches differ, and the graph returns in its entry mode.
"""

from __future__ import annotations

from torch import fx

from jaggc._compat import SET_GRAD_ENABLED
from jaggc.errors import JaggInternalError

from .context import PassContext


def is_grad_switch(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is SET_GRAD_ENABLED


def place_grad_modes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    for node in [n for n in graph.nodes if is_grad_switch(n)]:
        graph.erase_node(node)
    mode = ctx.entry_grad
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        wanted = ctx.entry_grad if node.op == "output" else node.meta.get("jagg_grad")
        if wanted is None:
            raise JaggInternalError(f"node {node.name} ({node.format_node()}) has no grad-mode fact; "
                                    f"a pass created it without meta['jagg_grad']")
        if wanted != mode:
            with graph.inserting_before(node):
                switch = graph.call_function(SET_GRAD_ENABLED, (wanted,))
            switch.meta["jagg_grad"] = wanted
            mode = wanted
    return gm
