"""Filling a ``Report`` from what compiling a loss produced: the passes' windows (graph paths), the
intercept path's recorded windows, and after each run the timesteps and routing decisions the
window nodes observed."""

from __future__ import annotations

import torch
from torch import fx

from .frontends.intercept import InterceptedLoss
from .graph_ops import LowMemWindowPlan, TrajectoryPlan, observed_times
from .report import Report, WindowRow
from .node_meta import CALL


def build_report(frontend: str, gm: fx.GraphModule, stages, ctx, traces: int) -> Report:
    """The report of a captured graph after the passes (``ctx``: their PassContext)."""
    rows = []
    for w in ctx.windows:
        rows.append(WindowRow(window=w.index, steps=list(w.steps), mode=w.mode, knots=list(w.knots),
                              basis=w.basis, timesteps=[], backward_before=len(w.steps),
                              backward_after=1 if w.mode == "jagg" else len(w.steps), autocast=w.autocast.describe()))
    report = Report(path=frontend, stages=stages, windows=rows, graph_module=gm, traces=traces,
                    notes=list(ctx.notes), call_autocast=_call_autocast(ctx.dit_calls(gm)),
                    trained_calls=len(ctx.trained_calls(gm)))
    report.reference_calls = sum(1 for n in gm.graph.nodes
                                 if getattr(CALL.get(n), "role", None) == "reference")
    report._plans = [w.plan for w in ctx.windows]
    report._basis = ctx.config.options.basis
    report.splits = [f"{s.source or 'a DiT call'}: chunks {list(s.no_grad)} of {s.chunks} run without grad ({s.reason})"
                     for s in ctx.splits]
    refresh_times(report)
    return report


def _call_autocast(calls) -> list[str]:
    """One "step k: <autocast>" / "reference (file:line): <autocast>" entry per DiT call."""
    out = []
    for node in calls:
        site = CALL.of(node)
        who = f"step {site.step}" if site.step is not None else f"{site.role} ({site.source or node.name})"
        out.append(f"{who}: {site.autocast.describe()}")
    return out


def intercept_report(loss: InterceptedLoss, cfg, traces: int) -> Report:
    """The report of the intercept path: its recorded windows, no graph."""
    basis = cfg.options.basis
    rows = []
    for i, steps in enumerate(loss.windows):
        jagg = len(steps) > 2 and (cfg.routing.jagg_frac != 0.0 or cfg.routing.active)
        if jagg and loss.decision is not None:
            jagg = loss.decision.modes[i] == "jagg"
        rows.append(WindowRow(window=i, steps=list(steps), mode="jagg" if jagg else "exact",
                              knots=list(basis.knot_positions(len(steps))) if jagg else [],
                              basis=basis.label() if jagg else "",
                              timesteps=observed_times([loss.recorded[k] for k in steps], cfg.options.time_arg),
                              backward_before=len(steps), backward_after=1 if jagg else len(steps),
                              autocast=loss.states[steps[0]].autocast.describe()))
    return Report(path="intercept", windows=rows, traces=traces, notes=[
        "no graph was captured: the loss ran twice with the DiT argument replaced by a recording proxy "
        "(one extra forward per step compared with a captured graph)", *loss.notes],
        call_autocast=[f"step {k}: {s.autocast.describe()}" for k, s in enumerate(loss.states)],
        trained_calls=len(loss.recorded))


def refresh_times(report: Report | None) -> None:
    """Timesteps and routing decisions of the latest run, copied into the report's rows."""
    if report is None:
        return
    lowmem = [p.shared for p in getattr(report, "_plans", []) if isinstance(p, LowMemWindowPlan)]
    if lowmem:
        report.lowmem_buffer_bytes = lowmem[0].buffer_bytes
    for row, plan in zip(report.windows, getattr(report, "_plans", [])):
        if isinstance(plan, TrajectoryPlan):
            i = plan.window_indices.index(row.window)
            if len(plan.observed_times) > i:
                row.timesteps = list(plan.observed_times[i])
            if plan.decision is not None and plan.decision.modes:
                row.mode = "routed:" + plan.decision.modes[i]
                row.score = plan.decision.scores[i]
                row.backward_after = 1 if plan.decision.modes[i] == "jagg" else len(row.steps)
        elif plan is not None and plan.observed_times:
            row.timesteps = list(plan.observed_times)
            basis = getattr(report, "_basis", None)
            if row.mode.startswith("jagg") and basis is not None and basis.exact_below is not None:
                exact = basis.runs_exact(torch.tensor(row.timesteps, dtype=torch.float64)[:, None])
                row.mode = "jagg:σ-exact" if exact else "jagg"
                row.knots = list(range(len(row.steps))) if exact else list(basis.knot_positions(len(row.steps)))
