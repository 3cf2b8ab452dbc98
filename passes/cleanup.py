"""cleanup: drop dead pure nodes and lint (``run_passes`` recompiles after every transform).

DiT calls and window nodes are kept even when unused: they run module hooks (DDP's forward
bookkeeping, buffer broadcasts) that the user's uncompiled loss would run too. So are in-place ops
and other module calls, whose effects do not flow through their outputs.

Invariant after: the graph lints, and every node is used or has an effect.
"""

from __future__ import annotations

from torch import fx

from jaggc.graph_ops import is_in_place

from .context import PassContext
from .infra import Fact, ensure, graph_pass


def _is_impure(node: fx.Node) -> bool:
    # fx calls every call_method pure (``v.unsqueeze_(0)`` with its result unused would vanish)
    # and a leaf module pure unless it says otherwise; jaggc's runtime targets are registered
    # with torch's has_side_effect (graph_ops.RUNTIME_TARGETS), so is_impure covers them
    return node.is_impure() or node.op == "call_module" or is_in_place(node)


def _ensure_clean(gm: fx.GraphModule, ctx: PassContext) -> None:
    gm.graph.lint()
    for node in gm.graph.nodes:
        ensure(bool(node.users) or node.op in ("output", "placeholder") or _is_impure(node), "cleanup",
               f"{node.name} is used or has an effect")


@graph_pass(requires={Fact.REWRITTEN, Fact.LOWMEM_TERMS}, provides={Fact.CLEAN}, ensures=_ensure_clean)
def cleanup(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Drop dead pure nodes (DiT calls, window nodes and in-place ops stay) and lint."""
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    gm.graph.lint()
    return gm
