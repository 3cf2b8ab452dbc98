"""The condensed picture of a compiled loss: one column per trained DiT call, windows as boxes.

``Report.to_dot()`` draws every fx node: hundreds of boxes for an 8-step loss. This view keeps
what the rewrite is about: which DiT calls share one joint backward (the knots and interiors of a
JAGG window) and which run exactly, the no-grad reference calls beside them, each step's glue
(its log-prob and PPO math) as one node, and the reduction to the loss as one node.
This module is the view's model: ``condensed_view`` gathers the facts (plain dataclasses),
``to_text`` and ``to_condensed_dot`` print them. Drawing them is ``report_drawing.py``'s
(``render_images``: matplotlib, PNG and SVG, no Graphviz; ``write_condensed`` falls back to the text
when matplotlib is missing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from .graph_ops import dit_call, is_runtime_target, jagg_lowmem_window, jagg_trajectory, jagg_window
from .node_meta import CALL, WINDOW

ROLE_LETTER = {"knot": "K", "interior": "i", "exact": "E"}
JAGG_MODES = ("jagg", "jagg:σ-exact", "routed", "routed:jagg")     # the modes WindowRow.roles() draws as K/i
# the colour of each role, in the DOT text and the picture (report_drawing.py): knots carry the
# backward (strong blue), interiors borrow it (pale blue), exact steps pay their own (amber)
ROLE_FILL = {"knot": "#1d4ed8", "interior": "#dbeafe", "exact": "#fde68a"}


@dataclass
class StepColumn:
    step: int                        # order among the trained (grad-enabled) DiT calls
    window: int
    role: str                        # "knot", "interior" or "exact"
    timestep: float | None           # the first sample's timestep (None before the loss ran)
    weights: dict[int, float] = field(default_factory=dict)   # interior: knot step -> its weight
    glue_ops: int | None = None      # ops that belong to this step alone (None: no graph captured)
    reference_calls: int = 0         # no-grad DiT calls that feed this step alone


@dataclass
class WindowBox:
    window: int
    steps: list[int]
    mode: str
    basis: str
    knot_steps: list[int]
    timesteps: list[float]
    backward_before: int
    backward_after: int


@dataclass
class CondensedView:
    name: str
    path: str                        # capture path of the report
    steps: list[StepColumn]
    windows: list[WindowBox]
    backward_before: int
    backward_after: int
    reference_calls: int             # every no-grad DiT call of the graph
    unattributed_references: int = 0     # no-grad calls feeding several steps (or none)
    reduction_ops: int | None = None     # ops that combine several steps' terms into the loss
    shared_ops: int | None = None        # input ops read by several steps (a concatenated embedding)
    table: str = ""                  # Report.table(), for the text view

    def strip(self) -> str:
        """``step 0 K | step 1 i | ... || step 4 K | ...`` (``||`` between windows, ``+r`` a reference)."""
        parts = []
        for i, col in enumerate(self.steps):
            if i:
                parts.append("||" if col.window != self.steps[i - 1].window else "|")
            ref = f"+{col.reference_calls}r" if col.reference_calls else ""
            parts.append(f"step {col.step} {ROLE_LETTER[col.role]}{ref}")
        return " ".join(parts)


# --- the data model ---------------------------------------------------------------------------
def condensed_view(report, name: str = "") -> CondensedView:
    """The condensed view of ``report`` (a ``jaggc.report.Report``)."""
    steps, windows = [], []
    for row in report.windows:
        jagg = row.mode in JAGG_MODES
        knot_steps = [row.steps[p] for p in row.knots] if jagg else []
        windows.append(WindowBox(row.window, list(row.steps), row.mode, row.basis, knot_steps,
                                 list(row.timesteps), row.backward_before, row.backward_after))
        weights = _interior_weights(row) if jagg else {}
        for pos, step in enumerate(row.steps):
            role = ("knot" if step in knot_steps else "interior") if jagg else "exact"
            t = row.timesteps[pos] if len(row.timesteps) == len(row.steps) else None
            steps.append(StepColumn(step, row.window, role, t, weights.get(step, {}) if role == "interior" else {}))
    steps.sort(key=lambda c: c.step)
    view = CondensedView(name, report.path, steps, windows, report.backward_before, report.backward_after,
                         report.reference_calls, table=report.table() if report.windows else "")
    if report.graph_module is not None:
        _count_ops(report.graph_module, view)
    return view


def _interior_weights(row) -> dict[int, dict[int, float]]:
    """Each interior step's weights over the window's knots (the first sample's timesteps): the
    share of its upstream gradient each knot's joint backward carries. Empty when the basis draws
    its knots per call (randomized, control) or the loss has not run yet."""
    if len(row.timesteps) != len(row.steps) or "/" not in row.basis:
        return {}
    from .runtime.weights import Basis

    kind, by = row.basis.split("/")[:2]
    try:
        phi = Basis(kind=kind, by=by, knots=tuple(row.knots)).matrix(
            torch.tensor(row.timesteps, dtype=torch.float64)[:, None])[:, :, 0]
    except Exception:  # a basis without a fixed matrix: the picture shows its name only
        return {}
    knots = [row.steps[p] for p in row.knots]
    return {step: {k: float(phi[pos, j]) for j, k in enumerate(knots)} for pos, step in enumerate(row.steps)}


def _count_ops(gm: fx.GraphModule, view: CondensedView) -> None:
    """Attribute every op of the graph to one step, the reduction, or the shared inputs.

    ``down[n]``: the trained steps whose DiT output flows into n. One step: n is that step's glue
    (log-prob, PPO clip); several: n combines steps (the running sum, the mean: the reduction).
    Ops that read no DiT output (indexing the batch, a no-grad reference call and its math) go
    to the steps that consume them (``consumers``), computed backwards; a window node reads every
    step's inputs, so its inputs are credited per call, not through the window node."""
    nodes = list(gm.graph.nodes)
    down: dict[fx.Node, frozenset] = {}
    for n in nodes:
        site = CALL.get(n)
        if site is not None and site.step is not None:
            down[n] = frozenset({site.step})
        else:
            down[n] = frozenset().union(*(down[i] for i in n.all_input_nodes))
    call_inputs = {n: _call_inputs(gm, n) for n in nodes}
    consumers: dict[fx.Node, frozenset] = {}
    to_reduction: set[fx.Node] = set()
    for n in reversed(nodes):
        found: set[int] = set()
        for user in n.users:
            if call_inputs[user] is not None:
                found |= call_inputs[user].get(n, set())
            elif len(down[user]) == 1:
                found |= down[user]
            elif down[user]:
                to_reduction.add(n)
            else:
                found |= consumers[user]
                if user in to_reduction:
                    to_reduction.add(n)
        consumers[n] = frozenset(found)
    glue = {c.step: 0 for c in view.steps}
    refs = {c.step: 0 for c in view.steps}
    view.reduction_ops = view.shared_ops = view.unattributed_references = 0
    for n in nodes:
        role = getattr(CALL.get(n), "role", None)
        if role == "reference":
            if len(consumers[n]) == 1:
                refs[next(iter(consumers[n]))] += 1
            else:
                view.unattributed_references += 1
            continue
        if not _is_glue_op(n, role):
            continue
        owners = down[n] or consumers[n]
        if len(owners) == 1 and next(iter(owners)) in glue:
            glue[next(iter(owners))] += 1
        elif len(down[n]) > 1 or (not owners and n in to_reduction):
            view.reduction_ops += 1
        elif owners:
            view.shared_ops += 1
    for col in view.steps:
        col.glue_ops, col.reference_calls = glue[col.step], refs[col.step]


def _is_glue_op(n: fx.Node, role: str | None) -> bool:
    """An op the user's loss computes: not a DiT call, window node or jaggc bookkeeping (a
    non-DiT module called through ``dit_call``, role "other", is the user's)."""
    if n.op not in ("call_function", "call_method", "call_module") or WINDOW.on(n):
        return False
    if role is not None:
        return role == "other"
    return not is_runtime_target(n)


def _call_inputs(gm: fx.GraphModule, n: fx.Node) -> dict[fx.Node, set[int]] | None:
    """For a node that runs trained DiT calls: each input node -> the steps whose call reads it."""
    site = CALL.get(n)
    if n.op != "call_function":
        return None
    if n.target is dit_call and site is not None and site.step is not None:
        calls, steps = [(n.args[1], n.args[2])], [site.step]
    elif n.target in (jagg_window, jagg_lowmem_window, jagg_trajectory):
        plan = getattr(gm, n.args[2].target)
        if n.target is jagg_trajectory:
            calls, steps = [c for w in n.args[1] for c in w], [s for w in plan.windows for s in w]
        else:
            calls, steps = list(n.args[1]), list(plan.steps)
    else:
        return None
    inputs: dict[fx.Node, set[int]] = {}
    for call, step in zip(calls, steps):
        fx.node.map_arg(call, lambda x: inputs.setdefault(x, set()).add(step))
    return inputs


# --- text and DOT -----------------------------------------------------------------------------
def heading(view: CondensedView, arrow: str = "->") -> str:
    head = f"{view.name}: " if view.name else ""
    return f"{head}DiT backward passes {view.backward_before} {arrow} {view.backward_after}"


def details(view: CondensedView) -> str:
    return (f"{len(view.steps)} trained DiT calls in {len(view.windows)} windows, capture {view.path}, "
            f"{view.reference_calls} no-grad reference calls")


def to_text(view: CondensedView) -> str:
    lines = [f"{heading(view)} ({details(view)})", "", view.table, "", view.strip()]
    if view.steps and view.steps[0].glue_ops is not None:
        lines.append("glue ops per step: " + " ".join(str(c.glue_ops) for c in view.steps)
                     + f"; reduction to the loss: {view.reduction_ops} ops; shared input ops: {view.shared_ops}")
    lines.append("K knot (grad forward, one joint backward per window), i interior (forward only, its gradient "
                 "carried by the knots), E exact (own backward), +Nr N no-grad DiT calls, || window boundary")
    return "\n".join(lines) + "\n"


def to_condensed_dot(view: CondensedView) -> str:
    lines = ["digraph jagg_condensed {", '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
             f'  labelloc=t; label="{heading(view)}\\n{details(view)}";']
    for w in view.windows:
        basis = f" {w.basis}" if w.basis else ""
        lines.append(f'  subgraph cluster_w{w.window} {{ label="window {w.window} · {w.mode}{basis} '
                     f'· bwd {w.backward_before}->{w.backward_after}"; style=rounded;')
        for col in (c for c in view.steps if c.window == w.window):
            font = ', fontcolor=white' if col.role == "knot" else ""
            t = f"\\nt={col.timestep:.4g}" if col.timestep is not None else ""
            lines.append(f'    s{col.step} [label="step {col.step}{t}\\n{col.role}", '
                         f'fillcolor="{ROLE_FILL[col.role]}"{font}];')
        lines.append("  }")
    for col in view.steps:
        ops = f"\\n{col.glue_ops} ops" if col.glue_ops is not None else ""
        lines.append(f'  g{col.step} [label="glue{ops}", fillcolor="#f3f4f6"]; s{col.step} -> g{col.step}; '
                     f'g{col.step} -> loss;')
        if col.reference_calls:
            lines.append(f'  r{col.step} [label="no-grad DiT x{col.reference_calls}", style="dashed"]; '
                         f'r{col.step} -> g{col.step};')
    ops = f"\\n{view.reduction_ops} ops" if view.reduction_ops is not None else ""
    lines += [f'  loss [label="reduction to the loss{ops}", fillcolor="#e5e7eb"];', "}"]
    return "\n".join(lines) + "\n"
