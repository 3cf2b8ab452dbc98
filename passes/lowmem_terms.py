"""place_lowmem_terms: prove the loss is a sum of per-step terms, and mark each term.

``backward="lowmem"`` (runtime/lowmem.py) runs each window's backward during the forward, which
needs each trained step's upstream gradient g_k = dL/dv_k as soon as the window's terms are
computed. That is possible when the loss is

    L = sum_i c_i * T_i,   each T_i a scalar that depends on ONE trained step's DiT output,
                           each c_i a Python number,

i.e. reached from the output through ``+``, ``-``, unary minus, and ``*`` or ``/`` by Python numbers
(``total = total + loss``, ``total / num_steps``, ``beta * kl``). Then g_k = sum of c_i dT_i/dv_k
over the terms of step k, and each dT_i/dv_k is autograd on T_i's own glue. Flow-GRPO (policy loss
plus beta times its KL term per step, divided by the step count) and DanceGRPO (each step's loss
divided by the step count) are of this form. A node that mixes two steps' outputs (a
``torch.stack(losses).mean()``), a tensor coefficient, or a term that also depends on another
trainable input is refused, naming the node; nothing is computed wrong.

Invariant after: each term root T_i feeds the loss only through a ``jagg_lowmem_term`` node right
after it; the output is ``jagg_lowmem_output(L)``; each window plan knows its term count and whether
it runs last; each window node runs after the previous window's term nodes.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from jaggc.backward_modes import mode_names, modes_where
from jaggc.errors import JaggGraphError
from jaggc.graph_ops import jagg_lowmem_output, jagg_lowmem_term, jagg_lowmem_window, user_source
from jaggc.node_meta import AUTOCAST, GRAD, REQUIRES_GRAD

from .context import PassContext
from .infra import Fact, ensure, graph_pass
from .effects import effect_order
from .rewrite import restore_topological_order

_ADD = {operator.add, operator.iadd, torch.add}
_SUB = {operator.sub, operator.isub, torch.sub}
_MUL = {operator.mul, operator.imul, torch.mul}
_DIV = {operator.truediv, operator.itruediv, torch.div}
_NEG = {operator.neg, torch.neg}
_METHODS = {"add": _ADD, "__add__": _ADD, "__radd__": _ADD, "sub": _SUB, "__sub__": _SUB, "mul": _MUL,
            "__mul__": _MUL, "__rmul__": _MUL, "div": _DIV, "__truediv__": _DIV, "neg": _NEG, "__neg__": _NEG}


def _kind(node: fx.Node):
    if node.kwargs:            # torch.add(a, b, alpha=...) and friends: not a plain sum
        return None
    if node.op == "call_function":
        for kind in (_ADD, _SUB, _MUL, _DIV, _NEG):
            if node.target in kind:
                return kind
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _where(node: fx.Node) -> str:
    source = user_source(node)
    return f"node {node.name}" + (f" ({source})" if source else "")


def step_masks(gm: fx.GraphModule) -> tuple[dict[fx.Node, int], dict[int, tuple[int, int]]]:
    """Per node, the trained steps (bits) whose DiT output it depends on; bit -> (window, position)."""
    masks: dict[fx.Node, int] = {}
    where: dict[int, tuple[int, int]] = {}
    bit = 0
    for node in gm.graph.nodes:
        mask = 0
        for inp in node.all_input_nodes:
            mask |= masks.get(inp, 0)
        if (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
                and node.args[0].target is jagg_lowmem_window):
            plan = getattr(gm, node.args[0].args[2].target)
            where[bit] = (plan.index, node.args[1])
            mask = 1 << bit
            bit += 1
        elif node.op == "call_function" and node.target is jagg_lowmem_window:
            mask = 0       # its inputs are stored states (check_independence proved it)
        masks[node] = mask
    return masks, where


def additive_terms(root: fx.Node, masks: dict[fx.Node, int]) -> dict[fx.Node, float]:
    """The term roots of ``root`` with their coefficients (module docstring), or a refusal."""
    terms: dict[fx.Node, float] = {}
    stack = [(root, 1.0)]
    while stack:
        node, coef = stack.pop()
        if not isinstance(node, fx.Node) or masks.get(node, 0) == 0:
            continue           # a constant of the parameters: no gradient
        kind = _kind(node)
        operands = list(node.args)
        if kind is _ADD and len(operands) == 2:
            stack += [(operands[0], coef), (operands[1], coef)]
        elif kind is _SUB and len(operands) == 2:
            stack += [(operands[0], coef), (operands[1], -coef)]
        elif kind is _NEG and len(operands) == 1:
            stack.append((operands[0], -coef))
        elif kind is _MUL and len(operands) == 2 and any(_is_number(x) for x in operands):
            number = next(x for x in operands if _is_number(x))
            other = operands[1] if operands[0] is number else operands[0]
            stack.append((other, coef * number))
        elif kind is _DIV and len(operands) == 2 and _is_number(operands[1]):
            stack.append((operands[0], coef / operands[1]))
        elif kind in (_MUL, _DIV) and any(isinstance(x, fx.Node) and masks.get(x, 0) == 0 for x in operands):
            raise JaggGraphError(
                f"backward='lowmem' needs the loss to be a sum of per-step terms with Python-number "
                f"coefficients; this {node.target if isinstance(node.target, str) else node.target.__name__} "
                f"scales them by a tensor. Scale by a number, or use {_any_loss_modes()}", where=_where(node))
        else:
            if bin(masks[node]).count("1") > 1:
                raise JaggGraphError(
                    f"backward='lowmem' needs the loss to be a sum of per-step terms, each "
                    f"depending on one step's DiT output; this node combines {bin(masks[node]).count('1')} steps' "
                    f"outputs otherwise than by +, - or a number factor (e.g. torch.stack(losses).mean()). "
                    f"Accumulate the per-step losses with `total = total + loss`, or use "
                    f"{_any_loss_modes()}", where=_where(node))
            terms[node] = terms.get(node, 0.0) + coef
    return terms


def _parameter_modes() -> str:
    """The modes a term with another trainable input can use (backward_modes.SUPPORT)."""
    return mode_names(modes_where("parameter_terms"))


def _any_loss_modes() -> str:
    """The modes a loss that is not a sum of per-step terms can use (backward_modes.SUPPORT)."""
    return mode_names(modes_where("any_loss"))


def _check_other_gradients(node: fx.Node, gm: fx.GraphModule) -> None:
    """A term whose glue also reaches a trainable input other than the DiT's outputs would lose that
    gradient when the term is detached: refuse it."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        example = n.meta.get("example_value", n.meta.get("val"))
        if n.op == "placeholder" and (REQUIRES_GRAD.get(n) or getattr(example, "requires_grad", False)):
            raise JaggGraphError(
                f"this term of the loss also depends on the input {n.name}, which requires grad; "
                f"backward='lowmem' only carries gradients through the DiT's outputs. Use {_parameter_modes()}",
                where=_where(node))
        if n.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(n.target).parameters()):
            raise JaggGraphError(
                f"this term of the loss calls the trainable module {n.target!r}; backward='lowmem' "
                f"only carries gradients through the DiT's outputs. Use {_parameter_modes()}", where=_where(node))
        if n.op == "call_function" and n.target is jagg_lowmem_window:
            continue
        stack.extend(n.all_input_nodes)


def _ensure_terms(gm: fx.GraphModule, ctx: PassContext) -> None:
    if not ctx.windows:
        return
    graph = gm.graph
    out = graph.output_node().args[0]
    out = out[0] if isinstance(out, (list, tuple)) else out
    ensure(isinstance(out, fx.Node) and out.target is jagg_lowmem_output, "place_lowmem_terms",
           "the output is jagg_lowmem_output(loss)")
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    for term in (n for n in order if n.op == "call_function" and n.target is jagg_lowmem_term):
        root = term.args[0]
        ensure(set(root.users) == {term}, "place_lowmem_terms", f"{root.name} feeds the loss only through {term.name}")
    windows = [n for n in order if n.op == "call_function" and n.target is jagg_lowmem_window]
    plans = [getattr(gm, n.args[2].target) for n in windows]
    ensure(all(p.terms is not None and sum(p.terms.values()) > 0 for p in plans), "place_lowmem_terms",
           "each window plan knows its per-step term counts")
    ensure([p.last for p in plans] == [False] * (len(plans) - 1) + [True], "place_lowmem_terms",
           "only the last window runs last")
    for previous, node in zip(windows, windows[1:]):
        ensure(all(position[t] < position[node] for t in node.args[3]), "place_lowmem_terms",
               f"{node.name} runs after {previous.name}'s term nodes")


@graph_pass(requires={Fact.REWRITTEN}, provides={Fact.LOWMEM_TERMS}, ensures=_ensure_terms,
            applies=lambda ctx: ctx.config.options.backward.support.backward_in_forward)
def place_lowmem_terms(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Prove the loss a sum of per-step terms and route each term to its window (``backward='lowmem'``)."""
    if not ctx.windows:
        return gm           # no trained DiT call: nothing to run early
    graph = gm.graph
    output = graph.output_node()
    loss = output.args[0]
    # FX's pytree codegen returns the flat list of output leaves
    flat = isinstance(loss, (list, tuple)) and len(loss) == 1
    loss = loss[0] if flat else loss
    if not isinstance(loss, fx.Node):
        raise JaggGraphError(
            f"backward='lowmem' needs the loss function to return one tensor (the scalar loss), got "
            f"{type(loss).__name__}; return the loss alone, or use {_any_loss_modes()}")
    masks, where = step_masks(gm)
    terms = additive_terms(loss, masks)
    plans = {w.index: w.plan for w in ctx.windows}
    by_window: dict[int, list[fx.Node]] = {i: [] for i in plans}
    with_term_nodes = {}
    for node, coef in terms.items():
        if not ctx.config.options.backward.support.parameter_terms:    # backward_modes.SUPPORT
            _check_other_gradients(node, gm)
        window, position = where[masks[node].bit_length() - 1]
        with graph.inserting_after(node):
            term = graph.call_function(jagg_lowmem_term, (node, _plan_attr(graph, node), window, position, coef,
                                                          node.name))
        GRAD.set(term, GRAD.get(node, True))
        AUTOCAST.set(term, AUTOCAST.of(node))
        with_term_nodes[node] = term
        by_window[window].append(term)
    for node, term in with_term_nodes.items():
        node.replace_all_uses_with(term, delete_user_cb=lambda user, term=term: user is not term)
    for index, plan in plans.items():
        plan.terms = {p: 0 for p in range(len(plan.steps))}
    for node, term in with_term_nodes.items():
        plans[term.args[2]].terms[term.args[3]] += 1
    order = [n for n in graph.nodes if n.op == "call_function" and n.target is jagg_lowmem_window]
    for previous, node in zip(order, order[1:]):
        node.args = node.args[:3] + (tuple(by_window[getattr(gm, previous.args[2].target).index]),)
    getattr(gm, order[-1].args[2].target).last = True
    with graph.inserting_before(output):
        wrapped = graph.call_function(jagg_lowmem_output, (loss, _plan_attr(graph, output)))
    GRAD.set(wrapped, True)
    AUTOCAST.set(wrapped, ctx.entry_autocast)
    output.args = ([wrapped] if flat else wrapped,)
    restore_topological_order(graph, effect_order(ctx))
    ctx.notes.append(f"backward='lowmem': {len(terms)} per-step terms; each window's joint backward runs as soon as "
                     f"its terms are known (peak activations: one window)")
    return gm


def _plan_attr(graph: fx.Graph, before: fx.Node) -> fx.Node:
    import warnings

    with graph.inserting_after(before) if before.op != "output" else graph.inserting_before(before), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # get_attr of a plain object
        return graph.get_attr("jagg_lowmem_plan")
