"""The condensed picture of a compiled loss drawn with matplotlib (PNG and SVG, no Graphviz): the
drawing of ``report_view.py``'s model (one column per trained DiT call, windows as boxes), and the
text fallback when matplotlib is missing (``write_condensed``)."""

from __future__ import annotations

from .report_view import JAGG_MODES, ROLE_FILL, ROLE_LETTER, CondensedView, details, heading, to_text

# knots carry the backward, interiors borrow it, exact steps pay their own (ROLE_FILL); their edges
# and ink; everything that is not a DiT call stays grey
_EDGE = {"knot": "#1e3a8a", "interior": "#1d4ed8", "exact": "#b45309"}
_INK = {"knot": "white", "interior": "#1e3a8a", "exact": "#78350f"}
_GREY, _DARK = "#6b7280", "#111827"



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

    text(0.3, 0.3, [heading(view, "→")], fig_w - 0.6, size=13, ha="left", weight="bold")
    text(0.3, 0.56, [details(view)], fig_w - 0.6, size=9, ha="left", color=_GREY)

    # columns: x of each step, windows a small gap apart
    order = {w.window: i for i, w in enumerate(view.windows)}
    xs = {c.step: x0 + i * cw + gap * order.get(c.window, 0) for i, c in enumerate(view.steps)}
    for w in view.windows:
        left, right = xs[w.steps[0]] + 0.03, xs[w.steps[-1]] + cw - 0.03
        jagg = w.mode in JAGG_MODES
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
        box(left, call_top, inner, call_h, ROLE_FILL[c.role], _EDGE[c.role])
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
    handles = [Patch(fc=ROLE_FILL[r], ec=_EDGE[r], label=key[r]) for r in key if r in present]
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


__all__ = ["matplotlib_missing", "render_images", "write_condensed"]
