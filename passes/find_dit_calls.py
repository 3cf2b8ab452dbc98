"""find_dit_calls: tag every DiT call with a CallSite and every node with its modes.

Invariant after: each ``dit_call`` node has ``meta["jagg_call"]``; calls of the trained DiT made
with grad enabled carry consecutive ``step`` numbers in graph order; every node has
``meta["jagg_grad"]`` and ``meta["jagg_autocast"]`` (the grad mode and autocast state it runs
under, from the capture's switches: ``modes.tag_modes``), and each call's CallSite its autocast
state. A loss with no trained DiT call (an empty trajectory, a loss called for its value) keeps its
calls as they are: nothing is rewritten, and the report says so.
"""

from __future__ import annotations

from collections import Counter

from torch import fx

from jaggc._compat import tree_flatten, tree_unflatten
from jaggc.errors import JaggGraphError
from jaggc.graph_ops import dit_call, user_source
from jaggc.node_meta import AUTOCAST, CALL, GRAD
from jaggc.runtime.calls import DitCall
from jaggc.runtime.checks import check_placement
from jaggc.runtime.module_state import unwrap

from .context import CallSite, PassContext
from .infra import Fact, ensure, graph_pass


def _ensure_calls_found(gm: fx.GraphModule, ctx: PassContext) -> None:
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is dit_call]
    ensure(all(CALL.on(n) for n in calls), "find_dit_calls", "every dit_call node has its CallSite")
    steps = [CALL.of(n).step for n in calls if CALL.of(n).step is not None]
    ensure(steps == list(range(len(steps))), "find_dit_calls", f"trained steps number 0..n-1 in graph order: {steps}")
    for n in calls:
        site = CALL.of(n)
        ensure((site.step is not None) == (site.grad_enabled and site.role is None), "find_dit_calls",
               f"{n.name}: a step number exactly on the trained DiT's grad-enabled calls")
        ensure(site.autocast == AUTOCAST.of(n), "find_dit_calls", f"{n.name}: the CallSite's autocast is the node's")
    ensure(not calls or ctx.dit is not None, "find_dit_calls", "ctx.dit names the trained DiT")


@graph_pass(requires={Fact.CANONICAL, Fact.MODES, Fact.SPLITS}, provides={Fact.DIT_CALLS}, analysis=True, ensures=_ensure_calls_found)
def find_dit_calls(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Tag every DiT call with its CallSite (step, source line, autocast state)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is dit_call]
    if not calls:
        _note_no_dit_call(gm, ctx)
        return gm

    def module_of(node):
        return unwrap(gm.get_submodule(node.args[0].target))

    if ctx.dit is None:
        counts = Counter(id(module_of(n)) for n in calls if GRAD.of(n))
        if len(counts) > 1:
            # guessing (e.g. the most-called one) could rewrite a reward model's calls as DiT windows
            names = sorted({f"{type(module_of(n)).__name__} ({n.args[0].target}, {counts[id(module_of(n))]} calls)"
                            for n in calls if GRAD.of(n)})
            raise JaggGraphError(
                f"the loss calls {len(counts)} module arguments with grad ({', '.join(names)}), so jaggc cannot "
                f"tell which is the DiT; pass it: jagg_compile(fn, dit=model)")
        # no grad-enabled call at all: every call is a reference call of the module called first
        target_id = counts.most_common(1)[0][0] if counts else id(module_of(calls[0]))
        ctx.dit = next(module_of(n) for n in calls if id(module_of(n)) == target_id)
    dit = unwrap(ctx.dit)
    step = 0
    for index, node in enumerate(calls):
        is_dit = module_of(node) is dit
        grad = GRAD.of(node)
        site = CallSite(index=index, module=node.args[0].target, grad_enabled=grad, source=user_source(node),
                        autocast=AUTOCAST.of(node))
        if is_dit and grad:
            site.step = step
            step += 1
        elif is_dit:
            site.role = "reference"
        else:
            site.role = "other"
        CALL.set(node, site)
    check_recorded_placement(gm, calls, dit)
    if step == 0:
        ctx.notes.append(f"the DiT ({type(dit).__name__}) is only called without grad: no window, the loss runs "
                         f"as written (its value is the undecorated loss's)")
    return gm


def _note_no_dit_call(gm: fx.GraphModule, ctx: PassContext) -> None:
    """A loss that makes no DiT call (an empty trajectory: a window that moved past the trained
    steps) runs as written. (If it still trains something, the compiled loss warns when it runs:
    the DiT may be called where jaggc does not watch it.)"""
    watched = ", ".join(ctx.watched) or "none"
    ctx.notes.append(f"no DiT call (watched: {watched}): nothing to rewrite, the loss runs as written")


def check_recorded_placement(gm: fx.GraphModule, calls: list[fx.Node], dit) -> None:
    """Device and dtype of each DiT call's inputs, from the example values Dynamo recorded.

    The Dynamo frontend lets a mis-placed call trace (see ``frontends.dynamo._for_fake_run``) so
    that the refusal can name the step and source line here. Graphs without example values (the
    FX frontend) are checked at run time by the window runtime instead. A call under autocast has
    only its device checked (autocast casts what the DiT computes with).
    """
    for node in calls:
        site = CALL.of(node)
        if site.role == "other":
            continue
        dtypes = not site.autocast
        leaves, spec = tree_flatten((node.args[1], node.args[2]))
        values = [x.meta.get("example_value") if isinstance(x, fx.Node) else x for x in leaves]
        if any(isinstance(x, fx.Node) and v is None for x, v in zip(leaves, values)):
            continue
        args, kwargs = tree_unflatten(values, spec)
        where = f"step {site.step}" if site.step is not None else f"DiT call {site.index} (no-grad reference)"
        where += f" ({site.source})" if site.source else ""
        check_placement(dit, DitCall(tuple(args), dict(kwargs)), where, dtypes=dtypes)
