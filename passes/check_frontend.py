"""check_frontend: the captured graph is in canonical form.

Invariant after: every DiT call is a ``dit_call`` node whose module argument is a ``get_attr``;
no DiT is left as a ``call_module`` node (that would run un-rewritten with its own backward).
"""

from __future__ import annotations

from torch import fx

from jaggc.errors import JaggGraphError
from jaggc.graph_ops import dit_call

from .context import PassContext
from .infra import Fact, ensure, graph_pass


def _ensure_canonical(gm: fx.GraphModule, ctx: PassContext) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is dit_call:
            ensure(isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr", "check_frontend",
                   f"{node.name} takes its module from get_attr")


@graph_pass(provides={Fact.CANONICAL}, analysis=True, ensures=_ensure_canonical)
def check_frontend(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Refuse a captured graph that is not in canonical form: every DiT call a ``dit_call`` node."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is dit_call:
            module_arg = node.args[0]
            if not (isinstance(module_arg, fx.Node) and module_arg.op == "get_attr"):
                raise JaggGraphError(f"node {node.name}: a DiT call must take its module from get_attr, "
                                     f"got {module_arg!r}; this is a jaggc frontend bug")
        if node.op == "call_module" and ctx.dit is not None:
            if gm.get_submodule(node.target) is ctx.dit:
                raise JaggGraphError(f"node {node.name}: the DiT is still a call_module node; the frontend "
                                     f"did not canonicalise it (a jaggc bug)")
    return gm
