"""The condensed picture of a compiled loss: one column per trained DiT call, windows as boxes.

``Report.to_dot()`` draws every fx node: hundreds of boxes for an 8-step loss. This view keeps
what the rewrite is about: which DiT calls share one joint backward (the knots and interiors of a
JAGG window) and which run exactly, the no-grad reference calls beside them, each step's glue
(its log-prob and PPO math) as one node, and the reduction to the loss as one node.
``condensed_view`` gathers the facts (plain dataclasses); ``render_images`` draws them with
matplotlib (PNG and SVG, no Graphviz), ``to_text`` and ``to_condensed_dot`` print them, and
``write_condensed`` falls back to the text when matplotlib is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from .graph_ops import dit_call, is_runtime_target, jagg_lowmem_window, jagg_trajectory, jagg_window
from .node_meta import CALL, WINDOW

ROLE_LETTER = {"knot": "K", "interior": "i", "exact": "E"}
_JAGG_MODES = ("jagg", "jagg:σ-exact", "routed", "routed:jagg")     # the modes WindowRow.roles() draws as K/i
# colours: knots carry the backward (strong blue), interiors borrow it (pale blue), exact steps
# pay their own (amber); everything that is not a DiT call stays grey
_FILL = {"knot": "#1d4ed8", "interior": "#dbeafe", "exact": "#fde68a"}
_EDGE = {"knot": "#1e3a8a", "interior": "#1d4ed8", "exact": "#b45309"}
_INK = {"knot": "white", "interior": "#1e3a8a", "exact": "#78350f"}
_GREY, _DARK = "#6b7280", "#111827"


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
        jagg = row.mode in _JAGG_MODES
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
def _heading(view: CondensedView, arrow: str = "->") -> str:
    head = f"{view.name}: " if view.name else ""
    return f"{head}DiT backward passes {view.backward_before} {arrow} {view.backward_after}"


def _details(view: CondensedView) -> str:
    return (f"{len(view.steps)} trained DiT calls in {len(view.windows)} windows, capture {view.path}, "
            f"{view.reference_calls} no-grad reference calls")


def to_text(view: CondensedView) -> str:
    lines = [f"{_heading(view)} ({_details(view)})", "", view.table, "", view.strip()]
    if view.steps and view.steps[0].glue_ops is not None:
        lines.append("glue ops per step: " + " ".join(str(c.glue_ops) for c in view.steps)
                     + f"; reduction to the loss: {view.reduction_ops} ops; shared input ops: {view.shared_ops}")
    lines.append("K knot (grad forward, one joint backward per window), i interior (forward only, its gradient "
                 "carried by the knots), E exact (own backward), +Nr N no-grad DiT calls, || window boundary")
    return "\n".join(lines) + "\n"


def to_condensed_dot(view: CondensedView) -> str:
    lines = ["digraph jagg_condensed {", '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
             f'  labelloc=t; label="{_heading(view)}\\n{_details(view)}";']
    for w in view.windows:
        basis = f" {w.basis}" if w.basis else ""
        lines.append(f'  subgraph cluster_w{w.window} {{ label="window {w.window} · {w.mode}{basis} '
                     f'· bwd {w.backward_before}->{w.backward_after}"; style=rounded;')
        for col in (c for c in view.steps if c.window == w.window):
            font = ', fontcolor=white' if col.role == "knot" else ""
            t = f"\\nt={col.timestep:.4g}" if col.timestep is not None else ""
            lines.append(f'    s{col.step} [label="step {col.step}{t}\\n{col.role}", '
                         f'fillcolor="{_FILL[col.role]}"{font}];')
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


# --- the picture (matplotlib) -------------------------------------------------------------------


def matplotlib_missing() -> str | None:
    """Why matplotlib cannot be imported (None when it can)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def render_images(view: CondensedView, stem: str, dpi: int = 110) -> list[str]:
    """Draw ``view`` to ``stem.png`` and ``stem.svg``. Raises ImportError without matplotlib."""
    import matplotlib  # first, explicitly: a blocked matplotlib must fail here, not half-way

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch, Patch

    n = max(len(view.steps), 1)
    cw = max(0.42, min(1.12, 16.0 / n))           # column width (inches): narrower for long losses
    gap, label_w = 0.22, 0.95                      # between windows; the row labels on the left
    block_w = n * cw + gap * max(len(view.windows) - 1, 0)
    fig_w = max(8.0, label_w + block_w + 0.4)
    x0 = label_w + (fig_w - label_w - 0.4 - block_w) / 2
    refs = any(c.reference_calls for c in view.steps)
    counted = bool(view.steps) and view.steps[0].glue_ops is not None
    # rows, in inches from the top
    win_top, head_y, t_y, call_top, call_h = 0.82, 1.2, 1.4, 1.55, 0.68
    win_bottom = call_top + call_h + 0.14
    ref_top, ref_h = win_bottom + 0.16, 0.42
    glue_top = (ref_top + ref_h if refs else win_bottom) + 0.32
    glue_h, red_h = 0.5, 0.46
    red_top = glue_top + glue_h + 0.42
    legend_y = red_top + red_h + 0.22
    legend_rows = -(-(len({c.role for c in view.steps}) + refs) // 2)    # two entries a row
    fig_h = legend_y + 0.2 + 0.22 * legend_rows

    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, fig_w)
    ax.set_ylim(fig_h, 0)                          # one data unit = one inch, y downwards
    ax.axis("off")

    def text(x, y, options, width, size=9.0, min_size=6.0, **kw):
        """The first of ``options`` that fits in ``width`` inches, shrinking the font down to
        ``min_size``: labels never spill into the next column, whatever the step count."""
        kw = {"ha": "center", "va": "center", "color": _DARK, **kw}
        for option in options:
            t = ax.text(x, y, option, fontsize=size, **kw)
            for s in (size, size * 0.9, size * 0.8, min_size):
                t.set_fontsize(max(s, min_size))
                if t.get_window_extent(renderer).width / dpi <= width:
                    return t
            t.remove()
        return None

    def box(x, y, w, h, face, edge, style="-", lw=1.0, pad=0.06, z=2):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={pad}", fc=face,
                                    ec=edge, lw=lw, ls=style, zorder=z))

    def arrow(x, y0, y1):
        ax.annotate("", (x, y1), (x, y0), arrowprops=dict(arrowstyle="-|>", color=_GREY, lw=0.8,
                                                          shrinkA=0, shrinkB=0, mutation_scale=8), zorder=1)

    text(0.3, 0.3, [_heading(view, "→")], fig_w - 0.6, size=13, ha="left", weight="bold")
    text(0.3, 0.56, [_details(view)], fig_w - 0.6, size=9, ha="left", color=_GREY)

    # columns: x of each step, windows a small gap apart
    order = {w.window: i for i, w in enumerate(view.windows)}
    xs = {c.step: x0 + i * cw + gap * order.get(c.window, 0) for i, c in enumerate(view.steps)}
    for w in view.windows:
        left, right = xs[w.steps[0]] + 0.03, xs[w.steps[-1]] + cw - 0.03
        jagg = w.mode in _JAGG_MODES
        box(left, win_top, right - left, win_bottom - win_top, "#eff6ff" if jagg else "#fffbeb",
            "#1d4ed8" if jagg else "#b45309", lw=1.3, pad=0.1, z=0)
        bwd = f"bwd {w.backward_before}→{w.backward_after}"
        basis = f" · {w.basis}" if w.basis else ""
        text((left + right) / 2, win_top + 0.16,
             [f"window {w.window} · {w.mode}{basis} · DiT {bwd}", f"window {w.window} · {w.mode} · {bwd}",
              f"w{w.window} · {w.mode}", f"w{w.window}"], right - left - 0.1, size=9,
             color="#1e3a8a" if jagg else "#78350f", weight="bold")

    inner = cw - 0.14
    for c in view.steps:
        cx, left = xs[c.step] + cw / 2, xs[c.step] + 0.07
        text(cx, head_y, [f"step {c.step}", str(c.step)], inner, size=9, weight="bold")
        if c.timestep is not None:
            text(cx, t_y, [f"t = {c.timestep:.4g}", f"{c.timestep:.4g}"], inner, size=8, color=_GREY)
        box(left, call_top, inner, call_h, _FILL[c.role], _EDGE[c.role])
        lines = [f"{v:.2f} · s{k}" for k, v in c.weights.items()]
        if len(lines) > 3:
            lines = [" ".join(f"{v:.2f}" for v in c.weights.values())]
        spacing = 0.17 if len(lines) < 3 else 0.135
        label_y = call_top + call_h / 2 - spacing * len(lines) / 2
        text(cx, label_y, [c.role, ROLE_LETTER[c.role]], inner - 0.06, size=9.5, color=_INK[c.role],
             weight="bold")
        # an interior step's weights: the share of its gradient each knot's joint backward carries
        for i, line in enumerate(lines):
            text(cx, label_y + 0.04 + spacing * (i + 1), [line, line.split(" · ")[0]], inner - 0.06,
                 size=8 if len(lines) < 3 else 7.5, min_size=6, color=_INK[c.role])
        dit_x = cx
        if c.reference_calls:
            # beside the column, below the window: the reference calls are left out of it
            ref_left = cx - 0.02
            box(ref_left, ref_top, left + inner - ref_left, ref_h, "white", _GREY, style="--")
            count = f" ×{c.reference_calls}" if c.reference_calls > 1 else ""
            text(ref_left + (left + inner - ref_left) / 2, ref_top + ref_h / 2, [f"no grad{count}", "ref"],
                 left + inner - ref_left - 0.06, size=7.5, color=_GREY)
            arrow((left + inner + ref_left) / 2, ref_top + ref_h, glue_top)
            dit_x = left + 0.2
        arrow(dit_x, call_top + call_h, glue_top)
        box(left, glue_top, inner, glue_h, "#f3f4f6", "#9ca3af")
        ops = [f"glue · {c.glue_ops} ops", f"{c.glue_ops} ops", str(c.glue_ops)] if counted else ["glue"]
        text(cx, glue_top + glue_h / 2, ops, inner - 0.06, size=8.5)
        arrow(cx, glue_top + glue_h, red_top)

    if view.steps:
        red_left, red_right = xs[view.steps[0].step] + 0.07, xs[view.steps[-1].step] + cw - 0.07
        box(red_left, red_top, red_right - red_left, red_h, "#e5e7eb", _GREY)
        ops = f" · {view.reduction_ops} ops" if view.reduction_ops is not None else ""
        text((red_left + red_right) / 2, red_top + red_h / 2, [f"reduction to the loss{ops}", "loss"],
             red_right - red_left - 0.1, size=9.5, weight="bold")

    rows = [(head_y, "step, t"), (call_top + call_h / 2, "DiT call"), (glue_top + glue_h / 2, "step glue"),
            (red_top + red_h / 2, "loss")] + ([(ref_top + ref_h / 2, "reference")] if refs else [])
    for y, label in rows:
        text(0.2, y, [label], label_w - 0.25, size=8.5, ha="left", color=_GREY, style="italic")

    # a key for what this picture shows, nothing else
    key = {"knot": "knot: grad forward; one joint backward per window",
           "interior": "interior: forward only; its gradient rides on the knots (a · s0: share carried by knot s0)",
           "exact": "exact: its own backward"}
    present = {c.role for c in view.steps}
    handles = [Patch(fc=_FILL[r], ec=_EDGE[r], label=key[r]) for r in key if r in present]
    if refs:
        handles.append(Patch(fc="white", ec=_GREY, ls="--", label="no-grad DiT call (a reference, a CFG uncond half)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.3 / fig_w, 1 - legend_y / fig_h),
              ncol=2, frameon=False, fontsize=8.5, handlelength=1.4, columnspacing=1.6, labelcolor=_DARK)

    stem = str(stem)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "jaggc"}):
        fig.savefig(stem + ".png", dpi=dpi, facecolor="white")
        fig.savefig(stem + ".svg", facecolor="white", metadata={"Date": None})
    return [stem + ".png", stem + ".svg"]


def write_condensed(view: CondensedView, stem: str) -> list[str]:
    """``stem.png`` and ``stem.svg``, or ``stem.txt`` (the text view) when matplotlib is missing."""
    try:
        return render_images(view, stem)
    except ImportError:
        with open(str(stem) + ".txt", "w") as f:
            f.write(to_text(view))
        return [str(stem) + ".txt"]
