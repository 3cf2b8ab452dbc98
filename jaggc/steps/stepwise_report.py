"""``Stepwise.report``: what a stepwise loop ran (``StepwiseCounts``) and its report in lines
(``StepwiseReport``): the settings, the counts, the last trajectory's windows, the CFG slice, the
rollout cache's figures, the guard's state and the warnings (``build_report``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime.calls import batch_size
from ..runtime.guard_stats import range_label


@dataclass
class StepwiseCounts:
    """What jaggc ran, summed over trajectories (the loop's own no-grad calls are not counted)."""

    trajectories: int = 0
    grad_forwards: int = 0        # knot forwards, exact steps' forwards and re-runs
    nograd_forwards: int = 0      # interior steps (and knots whose graph is not held)
    reruns: int = 0               # knot or flushed steps re-run with grad in a window's backward
    backwards: int = 0            # DiT backward passes: one per JAGG window, one per exact step
    exact_steps: int = 0          # steps run as written (exact windows)
    jagg_windows: int = 0         # windows whose joint backward ran
    fallbacks: int = 0            # windows run exactly after a warning (safety.py)
    cached_forwards: int = 0      # no-grad forwards served from the rollout cache instead
    probe_forwards: int = 0       # the guard's: interior steps with grad, FSDP's re-runs (steps/probe.py)
    probe_backwards: int = 0      # the guard's: one per probed JAGG window
    sliced_steps: int = 0         # forwards (or re-runs) with grad on the CFG slice's rows only (slicing.py)
    recoveries: int = 0           # sliced rows re-run with grad: their cotangent was not zero
    first_order_served: int = 0   # interior steps served off-policy: recorded output + the knots' change
    prefetched_knots: int = 0     # knots forwarded before their step, for first-order serving
    batched_knot_forwards: int = 0  # first-order serving: forwards running a window's knots together (serving.py)
    batched_interior_forwards: int = 0  # off-policy windows below min_sigma: forwards running their interior steps together
    first_order_missed: int = 0   # interior steps off-policy that ran their forward (a row not linked)


@dataclass
class StepwiseReport:
    """``Stepwise.report``: the settings, the counts, the last trajectory's windows and the warnings."""

    window: int
    weights: str
    backward: str
    counts: StepwiseCounts
    windows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cfg_slice: list[str] | None = None        # the slices learned (None: cfg_slice off)
    cache: dict | None = None                 # the rollout cache's figures (None: off)
    guard: str | None = None                  # the guard's state in a line (None: no guard)

    def __str__(self) -> str:
        c = self.counts
        lines = [f"jaggc.stepwise window={self.window} weights={self.weights} backward={self.backward}: "
                 f"{c.trajectories} trajectories, {c.jagg_windows} JAGG windows, {c.exact_steps} exact steps, "
                 f"DiT forwards {c.grad_forwards} with grad + {c.nograd_forwards} without ({c.reruns} re-runs), "
                 f"{c.backwards} DiT backward passes, {c.fallbacks} fallbacks"]
        if self.cfg_slice is not None:
            lines.append(f"  CFG slice: {c.sliced_steps} sliced forwards, {c.recoveries} recoveries; "
                         + ("; ".join(self.cfg_slice) or "nothing learned yet (every row carried gradient, or no "
                                                         "call of a multiple of the declared batch)"))
        if self.cache is not None:
            k = self.cache
            lines.append(f"  rollout cache: {c.cached_forwards} forwards served ({k['hits']} hits, {k['misses']} misses, "
                         f"{k['invalidations']} invalidations); holds {k['rows']} rows, {k['bytes'] / 2**20:.1f} MiB "
                         f"({_bound(k['max_bytes'])}; {k['bytes_per_row'] / 2**10:.1f} KiB per row, "
                         f"{k['bytes_per_sample_step'] / 2**10:.1f} KiB per sample-step)"
                         + (f"; {k['skipped_rows']} rows not recorded (max_bytes)" if k["skipped_rows"] else ""))
            if k.get("first_order"):
                lines.append(f"  off-policy serving (first_order, at most {k['max_optimizer_steps']} optimizer steps "
                             f"since the recording): {c.first_order_served} interior steps served first-order, "
                             f"{c.prefetched_knots} knots forwarded before their step ({c.batched_knot_forwards} forwards running a "
                             f"window's knots together, {c.batched_interior_forwards} running a window's interior steps together), "
                             f"{c.first_order_missed} missed "
                             f"(forward run); {k['optimizer_steps']} optimizer steps since the recording")
            if k.get("served_figures"):
                f = k["served_figures"]
                lines.append(f"  serving measured by the guard on {len(f)} probes: served outputs' rel. error last "
                             f"{f[-1].rel_error:.3g}, max {max(x.rel_error for x in f):.3g} (bound {k['max_served_error']:g}); "
                             f"share of the change mispredicted last {f[-1].change_error:.2f}"
                             + (f"; STOPPED: {k['stopped']}" if k.get("stopped") else ""))
        if self.guard is not None:
            lines.append(f"  guard: {self.guard}; probe forwards {c.probe_forwards}, probe backwards {c.probe_backwards}")
        for w in self.windows:
            lines.append(f"  window {w['index']}: steps {w['steps']} {w['mode']}" + (f" ({w['reason']})" if w['reason'] else ""))
        lines += [f"  note: {n}" for n in self.notes[-5:]]
        return "\n".join(lines)


def _bound(max_bytes: int | None) -> str:
    return "no bound" if max_bytes is None else f"at most {max_bytes / 2**20:.0f} MiB"


def build_report(owner, run) -> StepwiseReport:
    """The report of ``owner`` (a ``Stepwise``), ``run`` its last trajectory (None: none yet)."""
    windows = []
    if run is not None:
        for w in run.windows:
            mode = "exact" if w.exact else "jagg"
            windows.append(dict(index=w.planned.index, steps=list(w.planned.steps), mode=mode,
                                reason=w.planned.reason, knots=[w.planned.steps[k] for k in w.planned.knots]))
    slices = None if owner.slicer is None else [r.describe() for r in owner.slicer.rules.values()]
    cache = cache_figures(owner.cache, run)
    if cache is not None and cache["first_order"]:
        cache.update(served_figures=list(owner.served_figures), max_served_error=owner.cache.max_served_error,
                     stopped=owner.first_order_stopped)
    return StepwiseReport(owner.window, owner.basis.label(), owner.backward, owner.counts, windows, list(owner.notes),
                          cfg_slice=slices, cache=cache, guard=guard_line(owner.guard))


def guard_line(g) -> str | None:
    """The guard's state in a line (None: no guard)."""
    if g is None:
        return None
    f = g.last_figures
    exact = ", ".join(range_label(g.ranges[r]) for r in sorted(g.exact_ranges)) or "none"
    running = (f"; running block of {f['probes']}: cosine {f['cosine_mean']:.4f}, bias/floor "
               f"{f['bias_over_floor']:.2f}" if f else "")
    return (f"every={g.every} on_drift={g.on_drift!r}, {g.calls} trajectories, {g.probed} probes{running}; "
            f"exact σ ranges (adapted): {exact}" + ("; JAGG off" if g.jagg_off else ""))


def cache_figures(cache, run) -> dict | None:
    """The rollout cache's figures (None: no cache); per sample-step from ``run``'s calls."""
    if cache is None:
        return None
    # a sample-step is one declared sample at one step: its rows are the call's batch over the
    # declared batch (classifier-free guidance's [uncond; cond]: two)
    per_sample = 1
    if run is not None and run.windows and any(w.visits for w in run.windows):
        visit = next(v for w in run.windows for v in w.visits.values())
        per_sample = max(batch_size(visit.call) // max(run.plan.times.shape[1], 1), 1)
    st = cache.stats
    return dict(hits=st.hits, misses=st.misses, invalidations=st.invalidations, rows=len(cache),
                bytes=cache.nbytes, max_bytes=cache.max_bytes, bytes_per_row=st.bytes_per_row,
                bytes_per_sample_step=st.bytes_per_row * per_sample, skipped_rows=st.skipped_rows,
                first_order=cache.first_order, max_optimizer_steps=cache.max_optimizer_steps,
                optimizer_steps=cache.optimizer_steps)


__all__ = ["StepwiseCounts", "StepwiseReport", "build_report", "cache_figures", "guard_line"]
