"""``jaggc.stepwise``: JAGG across a trainer's own per-step ``backward()`` calls.

Flow-GRPO, DanceGRPO and MixGRPO call the DiT once per timestep and ``backward()`` right after, in
their own loop (accelerate's ``accumulate``, DDP, FSDP, GradScaler, clipping and the optimizer step
as they are). ``stepwise(transformer)`` installs itself on the module the loop calls; the loop
declares each trajectory's trained timesteps (``trajectory`` or ``steps``) and is otherwise left as
written. Every call's values are the unchanged loop's; the DiT backward passes of each window of
``window`` steps become one joint backward of its knots (``run.py``), done before the backward of
the window's last step returns.

The module keeps its identity: ``transformer.module.disable_adapter()``, ``accelerator.accumulate
(transformer)``, ``transformer.clip_grad_norm_`` and ``transformer.parameters()`` reach the same
object. The call path is patched by an instance ``forward`` slot of the outermost module (the one
the loop calls: after ``accelerator.prepare``, DDP or FSDP wrapping), so DDP's and FSDP's forward
logic and the module's hooks run for every call, also for the no-grad interior forwards.

Backward forms (``backward=``): ``"joint"`` keeps each knot's graph from its own forward until the
window's backward ((W + 4) F per window; in σ order two steps' activations at a time, in a random
order up to every open window's knots); ``"lowmem"`` keeps them only while the steps come in σ
order, one after another (Flow-GRPO, MixGRPO: the joint form's speed at two steps' activations),
and from the first step out of order re-runs the knots in the window's backward; ``"per_window"``
always re-runs them ((W + 6) F per window, two steps' activations).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from .._compat import fsdp_version, in_backward, is_deepspeed_engine, reshard_fully_sharded
from ..backward_modes import BackwardMode, backward_mode, modes_where
from ..errors import JaggError, JaggInputError, JaggUnsupportedError
from ..options import Options
from ..runtime.guard import Guard
from ..runtime.guard_ranks import agree_on_probe
from ..runtime.guard_stats import range_label
from ..runtime.calls import DitCall, batch_size
from ..runtime.engines import Engine, engine_of, refuse_bare_zero_module, refuse_zero3
from ..runtime.module_state import module_chain, unwrap
from ..runtime.optimizer_hook import register_before_optimizer_step, unregister_before_optimizer_step
from ..runtime.rollout_cache import RolloutCache
from ..runtime.weights import DEFAULT_WEIGHTS, resolve_basis
from ..runtime.window import check_window_size
from ..source import frame_location, user_frame
from .ledger import Ledger
from .plan import TrajectoryPlan
from .ranks import agree_on_plan, agree_on_slice, distributed
from .run import TrajectoryRun
from .probe import TrajectoryProbe
from .safety import Safety
from .slicing import SliceLearner

#: the backward= forms of a stepwise loop (backward_modes.SUPPORT, its ``stepwise`` column)
STEPWISE_MODES: tuple[BackwardMode, ...] = modes_where("stepwise")
_UNSET = object()


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
        if self.guard is not None:
            lines.append(f"  guard: {self.guard}; probe forwards {c.probe_forwards}, probe backwards {c.probe_backwards}")
        for w in self.windows:
            lines.append(f"  window {w['index']}: steps {w['steps']} {w['mode']}" + (f" ({w['reason']})" if w['reason'] else ""))
        lines += [f"  note: {n}" for n in self.notes[-5:]]
        return "\n".join(lines)


def _bound(max_bytes: int | None) -> str:
    return "no bound" if max_bytes is None else f"at most {max_bytes / 2**20:.0f} MiB"


class Stepwise:
    """JAGG for a loop that calls ``module`` once per step and backward() after each (module docstring)."""

    def __init__(self, module: nn.Module, *, window: int = 4, weights=DEFAULT_WEIGHTS, backward: str = "joint",
                 options: Options | None = None, cfg_slice: bool = False, rollout_cache: bool | int = False,
                 guard=None):
        check_window_size(window)
        if backward not in STEPWISE_MODES:
            raise JaggInputError(f"stepwise(backward={backward!r}): use one of {tuple(m.value for m in STEPWISE_MODES)}")
        backward = backward_mode(backward)
        self.basis = resolve_basis(weights)
        if self.basis.kind in ("randomized", "control"):
            raise JaggUnsupportedError(
                f"stepwise(weights=Basis({self.basis.kind!r})) draws a window's knots when the window runs, but a "
                f"per-step loop must know them at the window's first step; use a deterministic basis (weights='t', "
                f"the default) or jagg_compile on a whole-trajectory loss")
        self.options = _checked_options(options)
        self.engine = _supported_engine(module)
        self.ddp = next((m for m in module_chain(module) if isinstance(m, nn.parallel.DistributedDataParallel)), None)
        self.distributed = distributed(module)
        self.fsdp = fsdp_version(module) is not None
        self.fsdp1 = fsdp_version(module) == 1
        module = self.engine.install_target(module)    # DeepSpeed: engine.module (runtime/engines.py)
        self.module, self.window, self.backward = module, window, backward
        self.counts = StepwiseCounts()
        self.notes: list[str] = []
        self.cfg_slice, self.rollout_cache = bool(cfg_slice), rollout_cache
        if guard is not None and not isinstance(guard, Guard):
            raise JaggInputError(f"stepwise(guard={type(guard).__name__}): pass a jaggc.Guard(every=..., on_drift=...)")
        self.guard = guard
        self.slicer = SliceLearner() if cfg_slice else None
        self.cache = _rollout_cache(module, rollout_cache, self.options)
        self.ledger = Ledger(module, watch_grads=self.engine.grad_in_dot_grad)
        self.safety = Safety(self)
        self._run: TrajectoryRun | None = None
        self._last: TrajectoryRun | None = None
        self._local = threading.local()
        self._warned: set[str] = set()
        self._deferred: JaggError | None = None     # a refusal made where Python could not raise it
        self._install()

    # --- the call path ---------------------------------------------------------------------------
    def _install(self) -> None:
        if _installed(self.module) is not None:
            raise JaggInputError(f"{type(self.module).__name__} already has a jaggc.stepwise installed; reuse it "
                                 f"(jaggc.stepwise returns it) or close() it first")
        previous = self.module.__dict__.get("forward", _UNSET)
        self.module.__dict__["forward"] = InstalledForward(self, self.module, previous)
        self._recording = None
        if self.cache is not None:
            # the rollout may call the wrapped module itself (Flow-GRPO samples through
            # pipeline.transformer, inside the DDP wrapper the loop trains): its calls are recorded
            # where every path reaches, the innermost module, unless they came through this one
            self._recording = unwrap(self.module).register_forward_hook(_InnerRecorder(self), with_kwargs=True)
        register_before_optimizer_step(self)
        # ZeRO's zero_grad leaves no trace on .grad for the ledger: the call itself is watched
        self._unwatch_zero_grad = self.engine.watch_zero_grad(self.before_engine_zero_grad)

    # --- the rollout cache's recording ----------------------------------------------------------
    def records(self) -> bool:
        """Whether a no-grad call made now is a rollout's, to record: outside any trajectory and
        any call jaggc makes itself."""
        return (self.cache is not None and not torch.is_grad_enabled() and (self._run is None or self._run.over())
                and not getattr(self._local, "through", 0) and not getattr(self._local, "outer", 0))

    def record(self, call: DitCall, output) -> None:
        if not self.cache.record_call(call, output) and self.cache.max_bytes is not None \
                and self.cache.stats.skipped_rows:
            self._warn_once("cache-full", (
                f"the rollout cache is full ({self.cache.nbytes / 2**20:.0f} MiB, max_bytes="
                f"{self.cache.max_bytes}): later rollout calls are not recorded, and their steps run their "
                f"forwards; raise rollout_cache=<bytes> to serve them"))


    @contextlib.contextmanager
    def passing_through(self):
        """Calls jaggc makes itself (re-runs) go straight to the module."""
        self._local.through = getattr(self._local, "through", 0) + 1
        try:
            yield
        finally:
            self._local.through -= 1

    def close(self) -> None:
        """End the current trajectory (its open windows run exactly, with a warning) and give the
        module its own call path back."""
        try:
            self.raise_deferred()
            self._end("at close()")
        finally:
            installed = self.module.__dict__.get("forward")
            if isinstance(installed, InstalledForward) and installed.owner is self:
                if installed.previous is _UNSET:
                    del self.module.__dict__["forward"]
                else:
                    self.module.__dict__["forward"] = installed.previous
            if self._recording is not None:
                self._recording.remove()
                self._recording = None
            unregister_before_optimizer_step(self)
            self._unwatch_zero_grad()

    # --- trajectories ------------------------------------------------------------------------------
    def trajectory(self, timesteps) -> "Trajectory":
        """Declare the next trajectory: the timesteps of the steps the loop will train (in any order;
        shape (steps,) or the trainers' (batch, steps), in the units the DiT is called with or in
        the other of 0..1000 and 0..1). A trajectory still open is ended first."""
        self._end("when the next trajectory was declared")
        plan = TrajectoryPlan(timesteps, window=self.window, basis=self.basis, time_arg=self.options.time_arg,
                              guard=self.guard)
        if self.slicer is not None:
            self.slicer.begin(plan.times.shape[1])
        if self.distributed:
            agree_on_plan(plan)
            if self.slicer is not None:
                agree_on_slice(self.slicer)
        run = TrajectoryRun(self, plan)
        self._run = self._last = run
        self.counts.trajectories += 1
        if self.guard is not None:
            probed, index = self.guard.start()
            if probed and any(not w.exact for w in plan.windows):
                run.probe = TrajectoryProbe(self, self.guard, index, run)
            if self.distributed:
                agree_on_probe(run.probe is not None, index, next(self.module.parameters()).device,
                               what=f"jaggc.stepwise's guard, trajectory {self.counts.trajectories}")
        if self.fsdp:
            # FSDP2 leaves the root unsharded after a forward that no backward followed (the rollout's,
            # an evaluation), its module holding the unsharded parameters in place of the sharded
            # ones: the ledger reads the parameters at rest (FSDPModule.reshard frees the gathered copies)
            reshard_fully_sharded(self.module)
        # its parameters as they are now (an adapter added since)
        self.ledger = Ledger(self.module, watch_grads=self.engine.grad_in_dot_grad)
        if not any(not w.exact for w in plan.windows):
            self._warn_once("all-exact", (
                f"no window of the declared trajectory runs JAGG (" + "; ".join(sorted({w.reason for w in plan.windows}))
                + f"): every step runs exactly, at the unchanged loop's cost"))
        return Trajectory(self, run)

    def steps(self, iterable: Iterable, timesteps) -> Iterator:
        """Declare a trajectory and iterate ``iterable`` (the loop's own steps, yielded unchanged);
        the trajectory ends with the loop: by exhaustion, or left early (``break``, an exception in
        the loop's body), which Python tells a generator only by closing it."""
        handle = self.trajectory(timesteps)
        try:
            yield from iterable
        except GeneratorExit:
            # Python closes a generator its loop left from its finalizer, which swallows what it
            # raises: a refusal is kept and raised at the next optimizer step or trajectory
            try:
                handle.end("when its loop was left early (break or an exception)", raised=True)
            except JaggError as refusal:
                self._deferred = refusal
                warnings.warn(f"jaggc: {refusal} [raised at the next optimizer step, trajectory or close()]",
                              stacklevel=2)
            raise
        except BaseException:
            handle.end("by an exception of the steps' iterable", raised=True)
            raise
        handle.end("when its loop ended")

    def before_optimizer_step(self, optimizer) -> None:
        """Before an optimizer step of this module's parameters (runtime/optimizer_hook.py): a
        refusal kept from a loop left early is raised; an open window refuses the step before any
        parameter moves. Another model's optimizer steps freely."""
        if not self.engine.steps(optimizer, self.module):
            return
        self.raise_deferred()
        if self._run is not None:
            self.safety.optimizer_step(self._run)
            if self._run.probe is not None and self._run.over():
                # the guard's FSDP probe re-runs its windows' calls: before the parameters move
                self._run.probe.finish()

    def before_engine_zero_grad(self, call: str) -> None:
        """Before a ``zero_grad`` of the engine's own gradient store (``call``; runtime/engines.py,
        ``watch_zero_grad``): refused while a step's gradient is held back."""
        if self._run is not None:
            self.safety.engine_zero_grad(self._run, call)

    def raise_deferred(self) -> None:
        """Raise a refusal made when the last trajectory's loop was left (``steps``)."""
        refusal, self._deferred = self._deferred, None
        if refusal is not None:
            raise refusal

    def _end(self, reason: str, *, raised: bool = False) -> None:
        run = self._run
        if run is None:
            return
        self._run = None
        self.safety.close(run, reason, raised=raised)
        self.ledger.withholding(False)     # every window ran: the marks nothing wrote into go
        if self.slicer is not None:
            self.slicer.end()
        if run.probe is not None:
            run.probe.finish()

    def drop(self, run: TrajectoryRun) -> None:
        """Forget ``run`` (after a refusal): its held graphs and gradients are freed."""
        if self._run is run:
            self._run = None
        if self.slicer is not None:
            self.slicer.discard()
        for win in run.windows:
            for v in win.visits.values():
                v.held = v.grads = v.probe_graph = None
        if run.probe is not None:
            run.probe.after = None          # a refused trajectory gives no probe (finish() notes it)
            run.probe.finish()
        run.dropped = True
        self.ledger.withholding(False)
        self.ledger.snapshot()

    def holds_graphs(self, run: TrajectoryRun) -> bool:
        if self.ddp is not None and run.deferred:
            # a DDP forward with grad is collective (its first rebuilds the buckets, later ones may
            # broadcast buffers): on the deferred schedule every rank's steps run without grad alike
            return False
        if self.cache is not None and run.deferred:
            # with a rollout cache every step's call is a no-grad lookup the ranks agree on (run.py's
            # _cached): held knots, forwarded with grad at steps other ranks serve from their caches,
            # would keep the ranks from serving any; the knots re-run in the windows' backward
            return False
        if self.backward is BackwardMode.LOWMEM and self.distributed:
            # every rank must make the same forwards (FSDP gathers in each): by the agreed plan
            return not run.deferred
        return self.backward is BackwardMode.JOINT or (self.backward is BackwardMode.LOWMEM and run.in_order)

    def left_order(self, run: TrajectoryRun) -> None:
        """The steps came out of σ order: ``lowmem`` frees the knot graphs it holds (their knots
        re-run in their windows' backward) so that one window's activations at a time stay alive."""
        if self.backward is not BackwardMode.LOWMEM or self.distributed:
            return
        for win in run.open_windows():
            for v in win.pending():
                v.held = None
        self._warn_once("order", (
            "the steps come out of σ order, so backward='lowmem' re-runs each window's knot forwards in its backward "
            "((W + 6) F per window instead of (W + 4) F) to keep one window's activations at a time; "
            "backward='joint' keeps them at the memory of every open window's knots"))

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        self.notes.append(message)
        warnings.warn(f"jaggc: {message}", stacklevel=4)

    def note_once(self, key: str, message: str) -> None:
        """A warning given once per ``key`` (a slower path taken, with its reason)."""
        self._warn_once(key, message)

    @property
    def report(self) -> StepwiseReport:
        run = self._last
        windows = []
        if run is not None:
            for w in run.windows:
                mode = "exact" if w.exact else "jagg"
                windows.append(dict(index=w.planned.index, steps=list(w.planned.steps), mode=mode,
                                    reason=w.planned.reason, knots=[w.planned.steps[k] for k in w.planned.knots]))
        slices = None if self.slicer is None else [r.describe() for r in self.slicer.rules.values()]
        return StepwiseReport(self.window, self.basis.label(), self.backward, self.counts, windows, list(self.notes),
                              cfg_slice=slices, cache=self._cache_figures(run), guard=self._guard_line())

    def _guard_line(self) -> str | None:
        g = self.guard
        if g is None:
            return None
        f = g.last_figures
        exact = ", ".join(range_label(g.ranges[r]) for r in sorted(g.exact_ranges)) or "none"
        running = (f"; running block of {f['probes']}: cosine {f['cosine_mean']:.4f}, bias/floor "
                   f"{f['bias_over_floor']:.2f}" if f else "")
        return (f"every={g.every} on_drift={g.on_drift!r}, {g.calls} trajectories, {g.probed} probes{running}; "
                f"exact σ ranges (adapted): {exact}" + ("; JAGG off" if g.jagg_off else ""))

    def _cache_figures(self, run: TrajectoryRun | None) -> dict | None:
        cache = self.cache
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
                    bytes_per_sample_step=st.bytes_per_row * per_sample, skipped_rows=st.skipped_rows)


class Trajectory:
    """A declared trajectory; as a context manager it ends when the block exits."""

    def __init__(self, owner: Stepwise, run: TrajectoryRun):
        self.owner, self.run = owner, run

    def end(self, reason: str = "at end()", *, raised: bool = False) -> None:
        if self.owner._run is self.run:
            self.owner._end(reason, raised=raised)

    def __enter__(self) -> "Trajectory":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.end("by an exception" if exc_type else "when its block ended", raised=exc_type is not None)
        return False


def stepwise(module: nn.Module, *, window: int | None = None, weights=None, backward: str | None = None,
             options: Options | None = None, cfg_slice: bool | None = None,
             rollout_cache: bool | int | None = None, guard: Guard | None = None) -> Stepwise:
    """Install JAGG on ``module`` (the one the loop calls: after ``accelerator.prepare`` or FSDP
    wrapping) for a loop that backpropagates once per step; returns the ``Stepwise`` whose
    ``steps(iterable, timesteps)`` / ``trajectory(timesteps)`` declare each trajectory.

    ``window`` (default 4), ``weights`` (default: plain JAGG with σ-aware placement, as
    ``jagg_compile``), ``backward`` ("joint", "lowmem" or "per_window"; module docstring),
    ``options`` (``jaggc.Options``: ``time_arg``, ``check_inputs``, ``batch_knots``, ``unbatched``).
    ``cfg_slice=True``: a call whose batch tiles the declared batch (classifier-free guidance's
    ``[uncond; cond]``) runs the row blocks whose gradient was exactly zero in the last trajectory
    without grad (slicing.py). ``rollout_cache=True`` (or a bound in bytes; True: 2 GiB): the
    module's no-grad calls outside a trajectory (the rollout) are recorded, and a no-grad forward
    of a step is served from them while the parameters, the inputs and the module's state are the
    rollout's (runtime/rollout_cache.py). ``guard=jaggc.Guard(every=8, ...)``: one trajectory in
    ``every`` measures its JAGG windows' error against the exact gradient, without changing ``.grad``
    (steps/probe.py), with the whole-loss guard's statistics and policy. On a module that has one installed, ``stepwise(module)``
    returns it (so the loop can reach it where it only has the module), and so does a call with the
    same settings; other settings are refused."""
    existing = _installed(module)
    given = dict(window=window, weights=weights, backward=backward, options=options, cfg_slice=cfg_slice,
                 rollout_cache=rollout_cache, guard=guard)
    settings = dict(window=4 if window is None else window, weights=DEFAULT_WEIGHTS if weights is None else weights,
                    backward="joint" if backward is None else backward, options=options,
                    cfg_slice=bool(cfg_slice), rollout_cache=False if rollout_cache is None else rollout_cache,
                    guard=guard)
    if existing is None:
        return Stepwise(module, **settings)
    if all(v is None for v in given.values()):
        return existing
    mine = dict(window=existing.window, weights=existing.basis, backward=existing.backward, options=existing.options,
                cfg_slice=existing.cfg_slice, rollout_cache=existing.rollout_cache, guard=existing.guard)
    asked = dict(settings, weights=resolve_basis(settings["weights"]), options=_checked_options(options))
    if mine != asked:
        differ = sorted(k for k in mine if mine[k] != asked[k])
        raise JaggInputError(f"{type(module).__name__} already has a jaggc.stepwise with other settings ({differ}: "
                             f"{', '.join(f'{k}={mine[k]!r}' for k in differ)}); call jaggc.stepwise(module) to get it, "
                             f"or close() it first")
    return existing


#: the rollout cache's bound with ``rollout_cache=True``
DEFAULT_CACHE_BYTES = 2 * 2**30


def _rollout_cache(module: nn.Module, setting, options: Options) -> RolloutCache | None:
    if setting is False or setting is None:
        return None
    if setting is True:
        max_bytes = DEFAULT_CACHE_BYTES
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting > 0:
        max_bytes = setting
    else:
        raise JaggInputError(f"stepwise(rollout_cache={setting!r}): pass True (a {DEFAULT_CACHE_BYTES // 2**30} GiB "
                             f"bound) or the bound in bytes, a positive int")
    return RolloutCache(module, time_arg=options.time_arg, unbatched=tuple(options.unbatched), max_bytes=max_bytes)


def _installed(module: nn.Module) -> Stepwise | None:
    if is_deepspeed_engine(module):
        module = module.module             # where stepwise installs on a DeepSpeed engine
    installed = module.__dict__.get("forward")
    return installed.owner if isinstance(installed, InstalledForward) else None


class InstalledForward:
    """The module's instance ``forward`` slot while a ``Stepwise`` is installed: every call of the
    module during a declared trajectory, with grad, goes to the trajectory; any other call to the
    forward the module had. A copy of the module (``copy.deepcopy``: a trainer's reference model,
    an EMA copy) or a pickle of it gets the module's own forward back, not a path into this one."""

    def __init__(self, owner: Stepwise, module: nn.Module, previous):
        self.owner, self.module, self.previous = owner, module, previous
        self.original = module.forward if previous is _UNSET else previous

    def __call__(self, *args, **kwargs):
        owner = self.owner
        if owner.records() and not in_backward():
            # a rollout's call: recorded as the loop makes it (the innermost module's hook skips it)
            owner._local.outer = 1
            try:
                out = self.original(*args, **kwargs)
            finally:
                owner._local.outer = 0
            owner.record(DitCall(tuple(args), dict(kwargs)), out)
            return out
        if (owner._run is None or not torch.is_grad_enabled() or getattr(owner._local, "through", 0)
                or in_backward()):
            # a call inside a backward is a recomputation (activation checkpointing written around
            # the call), which must repeat the original forward's ops, not be a step of its own
            if owner.fsdp1 and owner._run is not None and not torch.is_grad_enabled() \
                    and not getattr(owner._local, "through", 0) and not in_backward():
                # the loop's own no-grad call between steps (a KL reference): FSDP1's forward hands
                # the original parameters new gradient views (run.py's outside_step)
                return owner._run.outside_step(lambda: self.original(*args, **kwargs), frame_location(user_frame()))
            return self.original(*args, **kwargs)
        return owner._run.call(DitCall(tuple(args), dict(kwargs)), self.original, frame_location(user_frame()))

    def __deepcopy__(self, memo):
        copied = memo.get(id(self.module))
        if self.previous is not _UNSET:
            return copy.deepcopy(self.previous, memo)
        return type(copied).forward.__get__(copied) if copied is not None else self.original

    def __reduce__(self):
        return (_class_forward, (self.module,))


class _InnerRecorder:
    """The innermost module's forward hook that records the rollout's calls made around this
    Stepwise's module (``Stepwise._install``). A copy or pickle of the module (a reference model, an
    EMA copy) gets a hook that records nothing, not a path into this Stepwise."""

    _jaggc_observer = True          # module_state ignores it: it changes no output

    def __init__(self, owner: Stepwise):
        self.owner = weakref.ref(owner)

    def __call__(self, module, args, kwargs, output) -> None:
        owner = self.owner()
        if owner is not None and owner.records():
            owner.record(DitCall(tuple(args), dict(kwargs)), output)

    def __deepcopy__(self, memo):
        return _records_nothing

    def __reduce__(self):
        return (_records_nothing_hook, ())


def _records_nothing(module, args, kwargs, output) -> None:
    return None


_records_nothing._jaggc_observer = True


def _records_nothing_hook():
    return _records_nothing


def _class_forward(module: nn.Module):
    return type(module).forward.__get__(module)


def _supported_engine(module: nn.Module) -> Engine:
    refuse_zero3(module, "jaggc.stepwise")
    refuse_bare_zero_module(module, "jaggc.stepwise")
    return engine_of(module)


def _checked_options(options: Options | None) -> Options:
    options = Options() if options is None else options
    unused = [name for name, default in (("rollout_cache", None), ("split_batches", True), ("backend", None),
                                         ("on_unsupported", "raise"), ("interior_chunk", None))
              if getattr(options, name) != default]
    if unused:
        instead = {"rollout_cache": "stepwise(rollout_cache=True) records the rollout itself",
                   "split_batches": "stepwise(cfg_slice=True) is the per-step form of the CFG split"}
        hints = "".join(f"; {instead[n]}" for n in unused if n in instead)
        raise JaggInputError(f"stepwise(options=...): {unused} do not apply to a per-step loop (each step is its "
                             f"own call); leave them at their defaults{hints}")
    return options


__all__ = ["DEFAULT_CACHE_BYTES", "STEPWISE_MODES", "Stepwise", "StepwiseCounts", "StepwiseReport", "Trajectory", "stepwise"]
