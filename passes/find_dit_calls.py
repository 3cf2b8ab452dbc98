"""find_dit_calls: tag every DiT call with a CallSite and every node with its grad mode.

Invariant after: each ``dit_call`` node has ``meta["jagg_call"]``; calls of the trained DiT made
with grad enabled carry consecutive ``step`` numbers in graph order; every node has
``meta["jagg_grad"]`` (the grad mode it runs under, from Dynamo's ``_set_grad_enabled`` nodes).
"""

from __future__ import annotations

from collections import Counter

from torch import fx

from jaggc._compat import tree_flatten, tree_unflatten
from jaggc.errors import JaggGraphError
from jaggc.graph_ops import dit_call, user_source
from jaggc.runtime.calls import DitCall
from jaggc.runtime.checks import check_placement
from jaggc.runtime.module_state import unwrap

from .context import CallSite, PassContext
from .grad_modes import is_grad_switch


def source_of(node: fx.Node) -> str:
    """``file:line`` of the user code that made this node (from the Dynamo/FX stack trace)."""
    return user_source(node)


def tag_grad_mode(gm: fx.GraphModule, entry: bool = True) -> None:
    enabled = entry
    for node in gm.graph.nodes:
        if is_grad_switch(node):
            enabled = bool(node.args[0])
        node.meta["jagg_grad"] = enabled


def find_dit_calls(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    tag_grad_mode(gm, ctx.entry_grad)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is dit_call]
    if not calls:
        seen = sorted({type(m).__name__ for name, m in gm.named_children()})
        watched = ", ".join(ctx.watched) or "none"
        raise JaggGraphError(
            f"no DiT call found in the loss: it never calls the module(s) jaggc watched ({watched}); "
            f"other modules called as graph units: {seen or 'none'}. If the batch holds no trained step (an "
            f"empty trajectory), there is nothing to train: check its step count. Otherwise call the DiT as a "
            f"module, `dit(...)`, and pass it as an argument or with jagg_compile(dit=model)")

    def module_of(node):
        return unwrap(gm.get_submodule(node.args[0].target))

    if ctx.dit is None:
        counts = Counter(id(module_of(n)) for n in calls if n.meta["jagg_grad"])
        if not counts:
            raise JaggGraphError("the loss calls its modules only without grad; there is no DiT backward to rewrite")
        if len(counts) > 1:
            # guessing (e.g. the most-called one) could rewrite a reward model's calls as DiT windows
            names = sorted({f"{type(module_of(n)).__name__} ({n.args[0].target}, {counts[id(module_of(n))]} calls)"
                            for n in calls if n.meta["jagg_grad"]})
            raise JaggGraphError(
                f"the loss calls {len(counts)} module arguments with grad ({', '.join(names)}), so jaggc cannot "
                f"tell which is the DiT; pass it: jagg_compile(fn, dit=model)")
        target_id = counts.most_common(1)[0][0]
        ctx.dit = next(module_of(n) for n in calls if id(module_of(n)) == target_id)
    dit = unwrap(ctx.dit)
    step = 0
    for index, node in enumerate(calls):
        is_dit = module_of(node) is dit
        grad = node.meta["jagg_grad"]
        site = CallSite(index=index, module=node.args[0].target, grad_enabled=grad, source=source_of(node))
        if is_dit and grad:
            site.step = step
            step += 1
        elif is_dit:
            site.role = "reference"
        else:
            site.role = "other"
        node.meta["jagg_call"] = site
    check_recorded_placement(gm, calls, dit)
    if step == 0:
        raise JaggGraphError(
            f"the DiT ({type(dit).__name__}) is only called without grad; there is nothing to train")
    return gm


def _uses_autocast(gm: fx.GraphModule) -> bool:
    return any("autocast" in getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
               if n.op == "call_function")


def check_recorded_placement(gm: fx.GraphModule, calls: list[fx.Node], dit) -> None:
    """Device and dtype of each DiT call's inputs, from the example values Dynamo recorded.

    The Dynamo frontend lets a mis-placed call trace (see ``frontends.dynamo._for_fake_run``) so
    that the refusal can name the step and source line here. Graphs without example values (the
    FX frontend) are checked at run time by the window runtime instead. Under autocast only the
    device is checked (the traced autocast state is not the state of this pass).
    """
    dtypes = not _uses_autocast(gm)
    for node in calls:
        site = node.meta["jagg_call"]
        if site.role == "other":
            continue
        leaves, spec = tree_flatten((node.args[1], node.args[2]))
        values = [x.meta.get("example_value") if isinstance(x, fx.Node) else x for x in leaves]
        if any(isinstance(x, fx.Node) and v is None for x, v in zip(leaves, values)):
            continue
        args, kwargs = tree_unflatten(values, spec)
        where = f"step {site.step}" if site.step is not None else f"DiT call {site.index} (no-grad reference)"
        where += f" ({site.source})" if site.source else ""
        check_placement(dit, DitCall(tuple(args), dict(kwargs)), where, dtypes=dtypes)
