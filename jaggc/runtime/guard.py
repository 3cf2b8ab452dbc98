"""``jaggc.Guard``: a compiled loss that measures its own fidelity while it trains.

    loss_fn = jagg_compile(grpo_loss, window=4, weights="t", guard=jaggc.Guard(every=8, on_drift="adapt"))

On one call in ``every`` (the first, then every ``every``-th), the loss's backward also computes the
exact gradient of the same batch, window by window, into a buffer (guard_probe.py: one backward of
each JAGG window's W steps; ``.grad`` gets JAGG's gradient as on any other call). Each probe updates
running statistics (guard_stats.py, ``jaggc.calibrate``'s definitions): cosine and relative error to
exact; per σ range of the windows (by their lowest σ) and per window position, the relative error;
per σ range and for the whole gradient, the bias (|mean error| over the block's probes) against its
noise floor. Every ``probes`` probes (a block: 64, the bias study's N) the guard decides:

  * drift = the whole gradient's or a σ range's bias above ``bias_limit`` floors (1.5, the bias
    study's rule), or the block's mean cosine below ``target_cosine`` (0.95, calibrate's default);
  * ``on_drift="warn"``: a warning naming the σ range(s) and the figure; nothing changes;
  * ``on_drift="adapt"``: the drifted σ ranges (those above the limit; for a whole-gradient or a
    cosine drift without one, the range with the largest relative error) run exactly from the next
    call on (every step of such a window a knot, as σ-aware placement runs it), with a warning
    saying so; the statistics restart, since the estimator changed;
  * ``on_drift="exact"``: JAGG is switched off: the undecorated loss runs from the next call on.

``guard.summary()`` prints the figures; ``guard.log()`` is a flat dict of floats for a logger
(tensorboard, wandb), ``guard.history`` the decided blocks. Cost: per probe one backward of every JAGG
window's steps; memory: one snapshot of the gradient, one error buffer per σ range that has JAGG
windows (during a probe and in the block's running sums) and the block's exact-gradient sum, all
flat copies of the trainable parameters (tiny for LoRA; under FSDP this rank's shards). Under DDP
the errors are all-reduced once per probe; under FSDP each window is measured through FSDP's own
backward after the call's (guard_probe.py). A per-step loop's guard is ``jaggc.stepwise(...,
guard=...)`` (steps/probe.py): the same statistics and policy, one probed trajectory in ``every``.
``state_dict()`` / ``load_state_dict()`` carry it across a checkpoint. The probe call's loss must be backpropagated on its own (one backward
per call, as the trainers do): the JAGG figure is what that backward adds to ``.grad``. A probed call
backpropagated with ``torch.autograd.grad`` or ``backward(inputs=...)`` (no ``.grad``, or only the
inputs') gives no probe: the loss's own backward node sees the form first and switches the probe off
for that backward (no window measures), so the gradient is the unguarded one bit for bit; a warning
says so once, ``guard.skipped`` counts such calls.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import JaggInputError
from .flat_buffers import FlatBuffers
from .guard_probe import CallProbe
from .engines import engine_of
from .guard_ranks import agree_on_probe
from .guard_stats import Block, ProbeResult, range_label, range_of, sigma_ranges
from .weights import noise_levels

POLICIES = ("warn", "adapt", "exact")


@dataclass
class Guard:
    """Online fidelity guard for ``jagg_compile(..., guard=Guard(...))`` (module docstring).

    every: probe one call in this many. probes: block size N (the bias is judged over N probes).
    on_drift: "warn" | "adapt" | "exact". target_cosine, bias_limit: the drift thresholds.
    sigma_edges: interior edges of the σ ranges. on_probe: called with each ProbeResult (tests,
    custom logging; the result holds two flat gradients, so keep it only if you need it)."""

    every: int = 8
    on_drift: str = "warn"
    probes: int = 64
    target_cosine: float = 0.95
    bias_limit: float = 1.5
    sigma_edges: tuple[float, ...] = (0.25, 0.5, 0.75)
    on_probe: Callable[[ProbeResult], None] | None = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise JaggInputError(f"Guard(every={self.every!r}): probe one call in `every`, an int >= 1")
        if self.on_drift not in POLICIES:
            raise JaggInputError(f"Guard(on_drift={self.on_drift!r}): use one of {POLICIES}")
        if not isinstance(self.probes, int) or self.probes < 2:
            raise JaggInputError(f"Guard(probes={self.probes!r}): the bias needs a block of at least 2 probes")
        edges = tuple(float(e) for e in self.sigma_edges)
        if any(not 0 < e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise JaggInputError(f"Guard(sigma_edges={self.sigma_edges!r}): increasing σ values in (0, 1)")
        self.sigma_edges = edges
        self.ranges = sigma_ranges(edges)
        self.calls = 0                    # guarded calls with grad
        self.probed = 0                   # probes finished
        self.exact_ranges: set[int] = set()
        self.jagg_off = False
        # the probes' flat vectors, reused from one probe to the next (runtime/flat_buffers.py)
        self.buffers = FlatBuffers()
        self.block = Block(edges, self.probes, buffers=self.buffers)
        self.history: list[dict] = []     # one entry per decided block
        self.last: ProbeResult | None = None
        self.last_figures: dict = {}
        self.active: CallProbe | None = None      # the probe of the call running now
        self._pending: CallProbe | None = None
        self._unfinished = 0
        self.skipped = 0                  # probed calls backpropagated in a form that gives no probe
        self._skip_warned = False

    # --- the compiled loss calls these ---------------------------------------------------------
    def call(self, run: Callable, exact_fn: Callable, args, kwargs, dit=None):
        """Run one call of the compiled loss (``run``) or, once JAGG is off, the undecorated one.
        ``dit``: the loss's module where ``jagg_compile(dit=...)`` names it; a DDP or FSDP one makes
        the ranks agree on every call whether it is probed (``agree_on_probe``: a rank probing alone
        is an error, not a hang)."""
        if self.jagg_off:
            return exact_fn(*args, **kwargs)
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        probed, index = self.start()
        if dit is not None and _collective(dit):
            agree_on_probe(probed, index, group=engine_of(dit).process_group(), what=f"jaggc guard, call {index}")
        if not probed:
            return run(*args, **kwargs)
        if self._pending is not None and not self._pending.finished:
            self._unfinished += 1
            warnings.warn(f"jaggc guard: the probe of call {self._pending.index} never saw its backward finish "
                          f"(the loss was not backpropagated, or not on its own); it is dropped", stacklevel=3)
        probe = CallProbe(index, sigma_edges=self.sigma_edges, num_ranges=len(self.ranges),
                          on_finished=self._finished, on_skipped=self._skipped, buffers=self.buffers)
        self.active = probe
        try:
            out = run(*args, **kwargs)
        finally:
            self.active = None
        self._pending = probe
        return probe.attach(out)

    def start(self) -> tuple[bool, int]:
        """Count one guarded unit (a compiled loss's call, a stepwise trajectory): (whether it is
        probed, its index)."""
        index = self.calls
        self.calls += 1
        return index % self.every == 0, index

    def runs_exact(self, times: torch.Tensor) -> bool:
        """Whether a window call with these (S, B) timesteps runs exactly because its σ range drifted."""
        return bool(self.exact_ranges) and range_of(float(noise_levels(times).min()), self.sigma_edges) in self.exact_ranges

    def _skipped(self, probe: CallProbe) -> None:
        """A probed call whose backward cannot be measured (guard_probe.SKIPPED_BACKWARD): counted,
        said once per guard; its gradient is the unguarded loss's."""
        self.skipped += 1
        if not self._skip_warned:
            self._skip_warned = True
            warnings.warn(f"jaggc guard: no probe of call {probe.index} (nor of later calls backpropagated the "
                          f"same way; guard.skipped counts them): {probe.skipped}", stacklevel=2)

    def _finished(self, probe: CallProbe) -> None:
        result = probe.finish()
        if result is not None:
            self.record(result)

    def record(self, result: ProbeResult) -> None:
        """One probe's result (a compiled loss's call, or a stepwise trajectory: steps/probe.py):
        the statistics, ``on_probe``, and the policy's decision when a block is full."""
        self.probed += 1
        self.last = result
        self.block.add(result)
        self.last_figures = self.block.figures()
        if self.on_probe is not None:
            self.on_probe(result)
        if self.block.full:
            self._decide()

    # --- the policy -----------------------------------------------------------------------------
    def drift(self, figures: dict) -> tuple[list[int], list[str]]:
        """(σ ranges to act on, what drifted) of a block's figures; ([], []) when none drifted."""
        reasons, ranges = [], []
        flagged = {r: f for r, f in figures["ranges"].items() if f["bias_over_floor"] > self.bias_limit}
        for r, f in flagged.items():
            reasons.append(f"{f['label']}: bias {f['bias_over_floor']:.2f}x its noise floor")
            ranges.append(r)
        if figures["bias_over_floor"] > self.bias_limit:
            reasons.append(f"whole gradient: bias {figures['bias_over_floor']:.2f}x its noise floor")
        if figures["cosine_mean"] < self.target_cosine:
            reasons.append(f"whole gradient: mean cosine {figures['cosine_mean']:.3f} < {self.target_cosine}")
        if reasons and not ranges and figures["ranges"]:
            ranges.append(max(figures["ranges"], key=lambda r: figures["ranges"][r]["rel_error_mean"]))
        return ranges, reasons

    def _decide(self) -> None:
        figures = self.block.figures()
        ranges, reasons = self.drift(figures)
        entry = dict(probes=self.probed, calls=self.calls, figures=figures, drifted=bool(reasons),
                     reasons=reasons, action=None)
        if reasons:
            where = ", ".join(range_label(self.ranges[r]) for r in ranges) or "the whole trajectory"
            head = (f"jaggc guard: JAGG drifted over the last {figures['probes']} probes (calls up to {self.calls}): "
                    + "; ".join(reasons) + f" (limits: {self.bias_limit} floors, cosine {self.target_cosine})")
            if self.on_drift == "adapt":
                new = [r for r in ranges if r not in self.exact_ranges]
                self.exact_ranges.update(ranges)
                entry["action"] = f"exact windows in {where}"
                warnings.warn(head + f"; adapt: windows whose lowest σ lies in {where} run exactly from now on"
                              + ("" if new else " (already exact: the rest of the error is elsewhere)"), stacklevel=2)
            elif self.on_drift == "exact":
                self.jagg_off = True
                entry["action"] = "JAGG off"
                warnings.warn(head + "; exact: JAGG is off, the undecorated loss runs from now on", stacklevel=2)
            else:
                entry["action"] = "warned"
                warnings.warn(head + f"; drifted σ range(s): {where} (on_drift='warn': nothing changed)", stacklevel=2)
        self.history.append(entry)
        self.block = Block(self.sigma_edges, self.probes, buffers=self.buffers)

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The guard's state (counters, the running block, the decided blocks, the σ ranges it made
        exact, whether JAGG is off), for ``torch.save`` beside the model and optimizer; accelerate:
        ``accelerator.register_for_checkpointing(guard)`` saves it with ``save_state`` and
        ``load_state`` restores it. Under FSDP the block's sums are this rank's shards: save one per
        rank. A probe running when the state is taken is not in it."""
        return dict(version=1, every=self.every, probes=self.probes, sigma_edges=self.sigma_edges,
                    calls=self.calls, probed=self.probed, exact_ranges=sorted(self.exact_ranges),
                    jagg_off=self.jagg_off, history=list(self.history), block=self.block.state_dict(),
                    unfinished=self._unfinished, skipped=self.skipped)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``: the next probe adds to the saved block, the adapted ranges
        stay exact. Refused if the σ edges or the block size differ (the statistics would not
        compare); ``every``, ``on_drift`` and the limits may change."""
        if tuple(state["sigma_edges"]) != self.sigma_edges or state["probes"] != self.probes:
            raise JaggInputError(
                f"Guard.load_state_dict: the saved guard has sigma_edges={tuple(state['sigma_edges'])}, "
                f"probes={state['probes']}; this one {self.sigma_edges}, {self.probes}. Build the Guard with the "
                f"saved settings to continue its statistics")
        self.calls, self.probed, self._unfinished = state["calls"], state["probed"], state.get("unfinished", 0)
        self.skipped = state.get("skipped", 0)
        self.exact_ranges = set(state["exact_ranges"])
        self.jagg_off = bool(state["jagg_off"])
        self.history = list(state["history"])
        self.block = Block(self.sigma_edges, self.probes, buffers=self.buffers)
        self.block.load_state_dict(state["block"])
        self.last_figures = self.block.figures() if self.block.n else {}
        self.active = self._pending = None

    # --- reading it -----------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        """Bytes the guard holds between probes: the block's running error sums (the whole gradient's
        and one per σ range seen), its exact-gradient sum, and the flat vectors it keeps for the next
        probe (``buffers``: up to 16, on the CPU only; the block's sums are among them)."""
        held = [self.block.exact_sum] + [m.sum for m in self.block.ranges] + [self.block.whole.sum]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in held + self.buffers.held if t is not None}
        return sum(storages.values())

    def log(self) -> dict[str, float]:
        """Flat figures for a logger: the latest probe and the running block."""
        out: dict[str, float] = {"guard/calls": float(self.calls), "guard/probes": float(self.probed),
                                 "guard/exact_ranges": float(len(self.exact_ranges)),
                                 "guard/jagg_on": float(not self.jagg_off)}
        if self.last is not None:
            out["guard/cosine"] = self.last.cosine
            out["guard/rel_error"] = self.last.rel_error
        f = self.last_figures
        if f:
            out.update({"guard/cosine_mean": f["cosine_mean"], "guard/bias_over_floor": f["bias_over_floor"],
                        "guard/block_probes": float(f["probes"])})
            for r in f["ranges"].values():
                out[f"guard/bias_over_floor/{r['label']}"] = r["bias_over_floor"]
                out[f"guard/rel_error/{r['label']}"] = r["rel_error_mean"]
        return out

    def summary(self) -> str:
        lines = [f"jaggc guard: every={self.every}, on_drift={self.on_drift!r}, {self.calls} calls, {self.probed} "
                 f"probes (blocks of {self.probes}; limits {self.bias_limit} floors, cosine {self.target_cosine}); "
                 f"buffers {self.buffer_bytes / 2**20:.1f} MiB"]
        if self.jagg_off:
            lines.append("JAGG is off (on_drift='exact'): the undecorated loss runs")
        if self.exact_ranges:
            lines.append("exact windows (adapted): " + ", ".join(range_label(self.ranges[r]) for r in sorted(self.exact_ranges)))
        for entry in self.history:
            f = entry["figures"]
            lines.append(f"block to probe {entry['probes']}: cosine {f['cosine_mean']:.4f}, bias/floor "
                         f"{_fmt(f['bias_over_floor'])}" + (f"; DRIFT: {'; '.join(entry['reasons'])} -> {entry['action']}"
                                                           if entry["drifted"] else ""))
        f = self.last_figures
        if f and self.block.n:
            lines.append(_table(f, "running block"))
        elif self.history:
            lines.append(_table(self.history[-1]["figures"], "last block"))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _table(f: dict, title: str) -> str:
    rows = [f"{title}: {f['probes']} probes, cosine mean {f['cosine_mean']:.4f} (min {f['cosine_min']:.4f}), "
            f"rel. error {f['rel_error_mean']:.4f}, bias {f['bias']:.4f} / floor {f['floor']:.4f} = "
            f"{_fmt(f['bias_over_floor'])}"]
    for r in f["ranges"].values():
        rows.append(f"  {r['label']:14s} rel. error {r['rel_error_mean']:.4f}  bias/floor {_fmt(r['bias_over_floor'])}")
    for position, w in f["windows"].items():
        rows.append(f"  window {position:<3d} (σ ≥ {w['sigma_min']:.3f})  rel. error {w['rel_error_mean']:.4f}")
    return "\n".join(rows)


def _collective(dit) -> bool:
    """Whether ``dit``'s backward passes are collective (DDP or FSDP in an initialized group)."""
    from .engines import engine_of

    return engine_of(dit).collective_backward


def active_probe(options: Any) -> CallProbe | None:
    """The probe of the running call, if ``options`` (WindowOptions) carries a guard that probes now."""
    guard = getattr(options, "guard", None)
    return None if guard is None else guard.active
