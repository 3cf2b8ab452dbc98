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

This file holds the ``Stepwise`` itself (its trajectories, the optimizer and ``zero_grad`` hooks, the
refusal's drop); beside it: its settings and the engine it serves (``stepwise_settings.py``), how it
sits on the module (``stepwise_install.py``) and its report (``stepwise_report.py``). The engine is one
record, ``self.engine`` (runtime/engines.py's ``Engine``, chosen by its ``EngineKind``): ``ddp``,
``fsdp``, ``fsdp1`` and ``distributed`` read it.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterable, Iterator

import torch
from torch import nn

from .._compat import reshard_fully_sharded
from ..backward_modes import BackwardMode
from ..errors import JaggError, JaggInputError
from ..options import Options
from ..runtime.calls import DitCall
from ..runtime.engines import EngineKind
from ..runtime.guard import Guard
from ..runtime.guard_ranks import agree_on_probe
from ..runtime.optimizer_hook import register_before_optimizer_step, unregister_before_optimizer_step
from ..runtime.weights import DEFAULT_WEIGHTS
from .ledger import Ledger
from .plan import TrajectoryPlan
from .probe import TrajectoryProbe
from .ranks import agree_on_plan, agree_on_slice
from .run import TrajectoryRun
from .safety import Safety
from .slicing import SliceLearner
from .stepwise_install import install_forward, installed, remove_forward
from .stepwise_report import StepwiseCounts, StepwiseReport, build_report
from .stepwise_settings import (DEFAULT_CACHE_BYTES, STEPWISE_MODES, build_rollout_cache, checked_options, checked_settings,
                                same_settings, supported_engine, with_defaults)


class Stepwise:
    """JAGG for a loop that calls ``module`` once per step and backward() after each (module docstring)."""

    def __init__(self, module: nn.Module, *, window: int = 4, weights=DEFAULT_WEIGHTS, backward: str = "joint",
                 options: Options | None = None, cfg_slice: bool = False, rollout_cache: bool | int = False,
                 guard=None):
        self.basis, backward = checked_settings(window, weights, backward, guard)
        self.options = checked_options(options)
        # the one record of the engine (runtime/engines.py): ddp, fsdp, fsdp1 and distributed read it
        self.engine = supported_engine(module)
        module = self.engine.install_target(module)    # DeepSpeed: engine.module (runtime/engines.py)
        self.module, self.window, self.backward = module, window, backward
        self.counts = StepwiseCounts()
        self.notes: list[str] = []
        self.cfg_slice, self.rollout_cache = bool(cfg_slice), rollout_cache
        self.guard = guard
        self.slicer = SliceLearner() if cfg_slice else None
        self.cache = build_rollout_cache(module, rollout_cache, self.options, self.engine)
        self.served_figures: list = []               # the guard's measures of serving (served_probe.py)
        self.first_order_stopped: str | None = None  # why the guard stopped off-policy serving
        self.ledger = Ledger(self.engine.watched_parameters(module), watch_grads=self.engine.grad_in_dot_grad)
        self.safety = Safety(self)
        self._run: TrajectoryRun | None = None
        self._last: TrajectoryRun | None = None
        self._local = threading.local()
        self._warned: set[str] = set()
        self._deferred: JaggError | None = None     # a refusal made where Python could not raise it
        self._install()

    # --- the engine (runtime/engines.py) -----------------------------------------------------------
    @property
    def ddp(self) -> nn.Module | None:
        """The DistributedDataParallel wrapper the loop calls, None under any other engine."""
        return self.engine.ddp

    @property
    def fsdp(self) -> bool:
        """The gradient is FSDP's, in sharded storages (the engine's row: ``Engine.sharded``)."""
        return self.engine.sharded

    @property
    def fsdp1(self) -> bool:
        return self.engine.kind is EngineKind.FSDP1

    @property
    def distributed(self) -> bool:
        """Whether the module's backward passes are collective (steps/ranks.py): the ranks agree on plans."""
        return self.engine.collective_backward

    # --- the call path ---------------------------------------------------------------------------
    def _install(self) -> None:
        if installed(self.module) is not None:
            raise JaggInputError(f"{type(self.module).__name__} already has a jaggc.stepwise installed; reuse it "
                                 f"(jaggc.stepwise returns it) or close() it first")
        # the call path (stepwise_install.py) and, with a rollout cache, the rollout's recording
        self._recording = install_forward(self, self.module)
        register_before_optimizer_step(self)
        # ZeRO's zero_grad leaves no trace on .grad for the ledger: the call itself is watched
        self._unwatch_zero_grad = self.engine.watch_zero_grad(self.before_engine_zero_grad)

    # --- the rollout cache's recording ----------------------------------------------------------
    def records(self) -> bool:
        """Whether a no-grad call made now is a rollout's, to record: outside any trajectory, or in one
        declared without grad (a pass of the loop itself), and no call jaggc makes itself."""
        return (self.cache is not None and not torch.is_grad_enabled()
                and (self._run is None or self._run.over() or self._run.no_grad_pass)
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
            remove_forward(self, self.module)
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
        # with the rollout cache in one process, the declaration's read waits for the first call's
        # lookup, whose one read carries it (plan.py, run.py)
        plan = TrajectoryPlan(timesteps, window=self.window, basis=self.basis, time_arg=self.options.time_arg,
                              guard=self.guard, lazy=self.cache is not None and not self.distributed
                              and self.guard is None)
        plan.after_planned = lambda: self._warn_all_exact(plan)
        if self.slicer is not None:
            self.slicer.begin(plan.batch)
        if self.distributed:
            agree_on_plan(plan, group=self.engine.process_group())
            if self.slicer is not None:
                agree_on_slice(self.slicer, group=self.engine.process_group())
        run = TrajectoryRun(self, plan)
        # a trajectory declared without grad is a pass of the loop itself at the current parameters
        # (verl-omni's old-log-prob pass): its calls record like a rollout's
        run.no_grad_pass = not torch.is_grad_enabled()
        self._run = self._last = run
        self.counts.trajectories += 1
        if self.guard is not None:
            probed, index = self.guard.start()
            if probed and any(not w.exact for w in plan.windows):
                run.probe = TrajectoryProbe(self, self.guard, index, run)
            if self.distributed:
                agree_on_probe(run.probe is not None, index, group=self.engine.process_group(),
                               what=f"jaggc.stepwise's guard, trajectory {self.counts.trajectories}")
        if self.fsdp:
            # FSDP2 leaves the root unsharded after a forward that no backward followed (the rollout's,
            # an evaluation), its module holding the unsharded parameters in place of the sharded
            # ones: the ledger reads the parameters at rest (FSDPModule.reshard frees the gathered copies)
            reshard_fully_sharded(self.module)
        # its parameters as they are now (an adapter added since)
        watched = self.engine.watched_parameters(self.module)
        self.ledger = Ledger(watched, watch_grads=self.engine.grad_in_dot_grad,
                             tree=run.tree if watched is self.module and not self.fsdp else None)   # (resharded above)
        return Trajectory(self, run)

    def _warn_all_exact(self, plan: TrajectoryPlan) -> None:
        if not any(not w.exact for w in plan.windows):
            self._warn_once("all-exact", (
                f"no window of the declared trajectory runs JAGG (" + "; ".join(sorted({w.reason for w in plan.windows}))
                + f"): every step runs exactly, at the unchanged loop's cost"))

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
            self._run.settle()
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
        run.settle()                       # its device flags read (run.py): a wrong match never goes unseen
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
        for win in run._windows or ():          # none made: refused when its declaration was read
            for v in win.visits.values():
                v.held = v.grads = v.probe_graph = None
        if run.probe is not None:
            # a refused trajectory gives no probe; dropped without a collective: the refusal may be this
            # rank's alone, and it must raise, not wait for peers that never join (probe.finish)
            run.probe.finish(refused=True)
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

    def judge_serving(self, figures) -> None:
        """A probe's measure of off-policy serving (served_probe.py; the same on every rank): kept for the
        report; above ``FirstOrder(max_served_error)`` the guard's policy acts on it."""
        if not figures.steps:
            return
        self.served_figures.append(figures)
        bound = self.cache.max_served_error
        if figures.rel_error <= bound:
            return
        what = (f"the guard's probe of trajectory {figures.trajectory} measured the served outputs' relative error "
                f"{figures.rel_error:.3g} > max_served_error = {bound:g} ({figures.change_error:.2f} of the change "
                f"since the recording mispredicted, over {figures.steps} interior steps)")
        if self.guard.on_drift in ("adapt", "exact"):
            self.first_order_stopped = what
            self._warn_once("first-order-stopped", f"{what}: off-policy serving stopped, the interior steps run "
                                                   f"their forwards from now on (Guard(on_drift={self.guard.on_drift!r}))")
        else:
            self._warn_once("first-order-drift", f"{what}; serving goes on (Guard(on_drift='warn'); 'adapt' stops it)")

    def note_once(self, key: str, message: str) -> None:
        """A warning given once per ``key`` (a slower path taken, with its reason)."""
        self._warn_once(key, message)

    @property
    def report(self) -> StepwiseReport:
        """The settings, the counts, the last trajectory's windows and the warnings (stepwise_report.py)."""
        return build_report(self, self._last)


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
    module's no-grad calls outside a trajectory (the rollout) or in one declared under ``no_grad`` (a
    pass of the loop itself) are recorded, and a no-grad forward of a step is served from them while
    the parameters, the inputs and the module's state are the rollout's (runtime/rollout_cache.py).
    ``rollout_cache="first_order"`` (or ``jaggc.FirstOrder(max_optimizer_steps=8)``): also after
    optimizer steps since the recording, an interior step's output is the recorded one plus its
    window's knots' change (runtime/first_order.py; docs/stepwise.md). ``guard=jaggc.Guard(every=8, ...)``: one trajectory in
    ``every`` measures its JAGG windows' error against the exact gradient, without changing ``.grad``
    (steps/probe.py), with the whole-loss guard's statistics and policy. On a module that has one installed, ``stepwise(module)``
    returns it (so the loop can reach it where it only has the module), and so does a call with the
    same settings; other settings are refused."""
    existing = installed(module)
    given = dict(window=window, weights=weights, backward=backward, options=options, cfg_slice=cfg_slice,
                 rollout_cache=rollout_cache, guard=guard)
    if existing is None:
        return Stepwise(module, **with_defaults(given))
    if all(v is None for v in given.values()):
        return existing
    same_settings(existing, module, given)
    return existing


__all__ = ["DEFAULT_CACHE_BYTES", "STEPWISE_MODES", "Stepwise", "StepwiseCounts", "StepwiseReport", "Trajectory", "stepwise"]
