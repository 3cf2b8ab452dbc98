"""One declared trajectory at run time: each DiT call of the loop a step, each window's backward once.

The loop calls the DiT once per step and ``backward()`` after each. Per step (``TrajectoryRun.call``):

* a step of an exact window (σ-aware placement, <= 2 steps, or a window jaggc had to run exactly)
  runs as written: its own forward with grad, its own DiT backward;
* a JAGG knot runs its forward with grad and keeps the graph (``hold``); an interior step runs
  without grad. Either hands the loop its values through a ``StepTap`` (tap.py), whose backward
  brings the step's upstream gradient g_k here (``on_grads``) and enters no DiT graph;
* once every step of a window has its g_k (the window's last step's ``backward()``, in any order
  of the steps) the window's composites Γ_j = Σ_s Φ[s, j] g_s go through its knot graphs in ONE
  nested ``torch.autograd.backward`` (``complete``), so ``.grad`` gets J_aᵀΓ_a + J_bᵀΓ_b before
  that ``backward()`` returns: when the trajectory's last step's backward returns, ``.grad`` is the
  whole-loss ``jagg_compile``'s for the same windows and weights.

A knot whose graph is not held (``backward="per_window"``, or ``"lowmem"`` once the steps come out
of σ order) is re-run with grad in the window's backward, in the module and autocast state and with
the RNG state of its own call (rerun.py). Anything that would make the result silently wrong (a
parameter or ``.grad`` written between two steps of a window, a step visited twice, a trajectory
that ends early) runs the affected window exactly, with one warning, or raises (``safety.py``
decides which, with the ledger's help).

Host reads. Each read of a device value on the host stops the CPU until the GPU has caught up, so
the next step's kernels cannot be queued meanwhile. Per call none is needed in the common case:

* which declared step a call is: by the place of its timestep in the declared tensor's memory
  (``plan.match_view``), or, for a loop whose last trajectory visited its steps in σ order, the next
  step in σ order, checked on the device (``plan.expect``); else read on the host (``plan.match``);
* the inputs' finiteness (``Options.check_inputs``): device flags.

Such device flags wait in ``pending`` and are read together with the next read the run makes anyway
(a rollout-cache lookup, the CFG slice's recovery flags) or before a JAGG window's joint backward:
at most one read per window. A false finiteness flag refuses then, before any gradient of its window
lands; a predicted step that was not the call's (the loop left σ order, or called a timestep it did
not declare) is re-read on the host: the visits are put under their own steps and the windows they
touched run exactly (one warning), or the undeclared call is refused as before.
"""

from __future__ import annotations

import functools
from itertools import chain
from typing import Any, Callable, Sequence

import torch

from .._compat import (accelerator_devices_of, backward_accumulates_everywhere, backward_task_id, in_backward, rng_drawn,
                       rng_states, run_after_backward, tree_flatten, tree_map)
from ..backward_modes import BackwardMode
from ..errors import JaggInputError
from ..runtime.aggregate import knot_composites
from ..runtime.calls import DitCall, batch_size, check_output_requires_grad, per_sample_time, resolve_time_arg
from ..runtime.autocast import current_autocast
from ..runtime.checks import check_placement, nonfinite_input, step_value_flags
from ..runtime.collectives import agree
from ..runtime.module_state import CallState, StateReader
from ..runtime.module_tree import module_tree
from .plan import TrajectoryPlan
from .ranks import agree_on_hit
from .rerun import live_dropouts, rerun_calls
from .roles import StepVisit, StepwiseOwner, WindowRun, detached, input_versions
from .serving import FirstOrderServing
from .slicing import RowSlice, assemble, call_rows, take_rows
from .tap import float_leaves, parameters_anchor, tap_output

class TrajectoryRun(FirstOrderServing):
    def __init__(self, owner: StepwiseOwner, plan: TrajectoryPlan):
        self.owner = owner
        self.plan = plan
        self._windows: list[WindowRun] | None = None  # made when the plan is read (plan.py: lazy)
        self._first_lookup = None                    # the first call's cache lookup, read with the declaration
        self.visited: list[int] = []                 # declared steps in visit order
        self.in_order = True                         # visits so far follow σ order, one step after another
        # DDP/FSDP with steps out of σ order on some rank: every backward in the last step's (ranks.py)
        self.deferred = owner.distributed and not plan.in_sigma_order
        self.latest: StepVisit | None = None         # the visit that made the module's latest forward
        tree = module_tree(owner.module)              # listed once while unchanged (module_tree.py)
        self.tree = tree                              # (the ledger's too, stepwise.py: one check per trajectory)
        self.states = StateReader.of(owner.module, tree)   # the module's state at each call, for its re-run
        self.dropouts = live_dropouts(self.states.modules)
        # the accelerator devices of the module's parameters and buffers, whose generators a call may
        # draw from besides its inputs' (each call's RNG states: rng_states)
        self.devices = accelerator_devices_of(chain(tree.parameters, tree.buffers))
        self.draws = False                           # a call of this trajectory drew random numbers (no CFG slice)
        self.checked_placement = False               # device/dtype of the calls' inputs: checked once
        self.checked_inputs: dict = {}               # inputs flagged for finiteness (checks.step_value_flags)
        self.probe = None                            # the guard's probe of this trajectory (steps/probe.py)
        self.backward_steps = 0                      # steps whose backward began
        self.dropped = False                         # refused: the owner forgot it (Stepwise.drop)
        self.no_grad_pass = False                    # declared without grad: its calls record (stepwise.py)
        # the tap's parameter inputs (tap.py), where no DDP/FSDP hooks their gradient accumulators
        self._tap_params = [] if owner.distributed or owner.engine.hooks_accumulators else tree.trainable()
        self._tap_anchor = None
        self._after_task = None                      # the backward pass an after_backward is queued in
        self._exact_task = None                      # the backward pass an exact step's DiT backward ran in
        self._completion_queued = False              # the deferred schedule's end is queued (on_grads)
        # device flags not read yet (module docstring): ("step", visit, flag) for a predicted step,
        # ("finite", (step, input), flag); read ones waiting to be judged; the predicted step's flag of
        # the call being made, for its visit
        self.pending: list[tuple[str, Any, torch.Tensor]] = []
        self._verdicts: list[tuple[str, Any, bool]] = []
        self._expecting: torch.Tensor | None = None
        self.mispredicted = False                    # a predicted step was not the call's
        previous = owner._last
        # predict the steps (module docstring) where the loop's last trajectory visited every declared
        # step in σ order; not where ranks must agree on every decision (DDP/FSDP)
        self.predicts = (isinstance(previous, TrajectoryRun) and previous.in_order and not previous.mispredicted
                         and not previous.dropped and len(previous.visited) == len(previous.plan)
                         and not owner.distributed and not self.deferred)

    @property
    def windows(self) -> list[WindowRun]:
        if self._windows is None:
            self._windows = [WindowRun(w) for w in self.plan.windows]
        return self._windows

    def window(self, step: int) -> WindowRun:
        return self.windows[self.plan.window_of[step].index]

    def _read_declaration_with_lookup(self, call: DitCall) -> None:
        """The trajectory's first call, its declaration not read yet (plan.py: lazy, with the rollout
        cache): the call's cache lookup and the declared timesteps in one host read (float64 bits carried
        as int64), the lookup kept for ``_cached``. A declaration refused then drops the run."""
        plan, cache = self.plan, self.owner.cache
        pending = cache.prepare(call) if cache is not None else None
        self._first_lookup = (call, pending, None)   # a miss the host knows: counted once
        declared = plan.declared.contiguous()
        if pending is not None and pending.rows.device == declared.device:
            values = self._read(torch.cat([declared.flatten().view(torch.int64), pending.rows.to(torch.int64)]))
            n = declared.numel()
            self._first_lookup = (call, pending, values[n:])
            host = torch.tensor(values[:n], dtype=torch.int64).view(torch.float64).reshape(declared.shape)
        else:
            host = declared.to("cpu")
        try:
            plan.settle_times(host)
        except JaggInputError:
            self.owner.drop(self)                    # refused at its first call: nothing of it is kept
            raise

    # --- a DiT call of the loop --------------------------------------------------------------
    def call(self, call: DitCall, forward: Callable, where: str) -> Any:
        if self.plan.needs_read:
            self._read_declaration_with_lookup(call)
        step = self._step_of(call)
        if step is None:
            raise JaggInputError(
                f"a grad-enabled call of the DiT at {self.plan.describe_call(call)} is none of this "
                f"trajectory's declared steps (timesteps {self.plan.describe_steps()}). Declare the timesteps the "
                f"DiT is called with, one per trained step (sample['timesteps'][:, steps]), or make calls that are "
                f"not trained steps under torch.no_grad()", where=where)
        self.owner.safety.before_step(self, step, where)
        win = self.window(step)
        if step in win.visits or step in win.dropped:
            self.owner.safety.visited_twice(self, win, step, where)
        self._note_order(step)
        self.visited.append(step)
        rows = self._slice(call)
        exact_now = win.exact and not self.deferred
        if exact_now and rows is None:
            out = self._exact_call(win, step, call, forward, where)
            self._judge()
            return out
        # "exact": a step of an exact window that is sliced (its backward runs when its gradient
        # arrives) or on the deferred schedule
        role = "exact" if exact_now else win.planned.role(step)
        hold = role != "interior" and (exact_now or self.owner.holds_graphs(self))
        if self.owner.options.check_inputs:
            self._check_inputs(call, step)
        visit = StepVisit(step, call, self._state(), rng_states(call.args, call.kwargs, devices=self.devices),
                          input_versions(call), where, rows=rows if role != "interior" else None)
        self._expected(visit)
        win.visits[step] = visit
        self.latest = visit
        out = None
        prefetched = win.prefetched.pop(step, None)
        if prefetched is not None:
            visit, out = self._take_prefetched(win, visit, prefetched, call)
        if out is None and hold and role == "knot" and self.owner.cache is not None and not self.owner.distributed:
            # a knot the rollout made whole needs no forward now: its window's backward re-runs it
            # (its rows with grad), batched with the other knot, as backward="per_window" does
            out = self._cached(call)
        if out is None and role == "interior" and self.probe is not None and self.probe.in_window:
            # a probed trajectory: the interior step's graph for the guard's error (steps/probe.py);
            # the loop sees the values it would see unguarded (the rollout cache's where it serves)
            visit.probe_graph = self.probe.interior_forward(call)
            out = self._cached(call)
            if out is None:
                out = tree_map(detached, visit.probe_graph)
        if out is None and role == "interior" and self._first_order_candidate(win):
            out = self._serve_first_order(win, visit, call, forward)
            if out is None:
                out = self.forward_interior_together(win, visit, call, forward)
        if out is None and role == "knot" and hold and self._first_order_candidate(win):
            out = self.forward_knot_with_others(win, visit, call, forward)
        if out is None:
            out = self._forward_held(visit, forward) if hold else self._forward_without_grad(call, forward)
        if self.probe is not None and role == "interior" and self._first_order_window(win) and self._serves_first_order(win):
            # a probed trajectory is not served: the probe measures what serving would have given (served_probe.py)
            terms = self._first_order_terms(win, visit, call)
            if terms is not None:
                self.probe.served.note(win, visit, terms, tree_map(detached, out))
        if role == "knot" and visit.now is None and self._first_order_window(win) and self._serves_first_order(win):
            visit.now = tree_map(detached, out)
        # whether the call drew random numbers, whichever API drew (a dropout module, F.dropout, attention's
        # dropout_p): then its re-run runs alone from its RNG states (rerun.py). A few microseconds a call
        visit.drew = visit.drew or rng_drawn(visit.rng)
        if visit.drew:
            self.draws = True
            if visit.rows is not None and visit.held is None:
                # its whole call ran (no grad): a re-run of its rows with grad would draw other masks
                visit.rows = None
        if exact_now:
            self.owner.counts.exact_steps += 1
        if self.probe is not None:
            self.probe.read_before()
        # before the step the ledger looked at .grad; what FSDP1's own forward did to it since (it writes
        # original parameters' gradients back into its flat gradient and hands out new views) is no write
        # of the loop's (on_grads looks again when the step's gradient arrives). No other engine's forward
        # touches .grad: there the ledger's look before the step still holds
        if self.owner.fsdp1:
            self.owner.ledger.snapshot_grads()
        if self._tap_anchor is None and self._tap_params:
            self._tap_anchor = parameters_anchor(self._tap_params)       # tap.py: one per trajectory
        tapped, visit.index = tap_output(out, lambda grads, v=visit: self.on_grads(v, grads), self._tap_anchor)
        self._judge()
        return tapped

    # --- which declared step a call is, and the device flags read later (module docstring) -------
    def _step_of(self, call: DitCall) -> int | None:
        self._expecting = None
        step = self.plan.match_view(call)
        if step is not None:
            return step
        if self.predicts and self.in_order and self.probe is None and len(self.visited) < len(self.plan):
            step = self.plan.order[len(self.visited)]
            flag = self.plan.expect(call, step)
            if flag is not None:
                self._expecting = flag
                return step
        return self.plan.match(call)

    def _expected(self, visit: StepVisit) -> None:
        """The predicted step's flag waits for the next read, with its visit."""
        if self._expecting is not None:
            self.pending.append(("step", visit, self._expecting))
            self._expecting = None

    def _read(self, extra: torch.Tensor | None = None) -> list:
        """Read the pending flags and ``extra`` (a 1-d tensor) in ONE host read; returns ``extra``'s
        values. A false finiteness flag refuses at once; the steps' flags are judged by ``_judge``,
        where the visits may be moved."""
        pending, self.pending = self.pending, []
        if not pending:
            return [] if extra is None else extra.tolist()
        flags = torch.stack([f for _, _, f in pending]).to(torch.int64)
        if extra is not None:
            flags = torch.cat([flags, extra.to(device=flags.device, dtype=torch.int64)])
        values = flags.tolist()
        for (kind, what, _), ok in zip(pending, values):
            if not ok and kind == "finite":
                self.owner.drop(self)
                raise nonfinite_input(*what)
            self._verdicts.append((kind, what, bool(ok)))
        return values[len(pending):]

    def settle(self) -> bool:
        """Read and judge every pending flag (before a JAGG window's joint backward, an optimizer step,
        the trajectory's end); True if a wrong prediction moved visits."""
        if self.dropped:
            self.pending, self._verdicts = [], []
            return False
        if self.pending:
            self._read()
        return self._judge()

    def _judge(self) -> bool:
        """A predicted step that was not the call's: every visit not yet verified is re-read on the
        host, put under its own step, and the windows it touched run exactly (module docstring).
        True if visits moved."""
        verdicts, self._verdicts = self._verdicts, []
        if all(ok for _, _, ok in verdicts):
            return False
        unverified = [what for kind, what, _ in verdicts if kind == "step"]
        unverified += [what for kind, what, _ in self.pending if kind == "step"]
        self.pending = [p for p in self.pending if p[0] != "step"]
        self.mispredicted, self.predicts = True, False
        actual = {id(v): self.plan.match(v.call) for v in unverified}
        undeclared = next((v for v in unverified if actual[id(v)] is None), None)
        if undeclared is not None:
            raise self.owner.safety.refuse(self, (
                f"a grad-enabled call of the DiT at {self.plan.describe_call(undeclared.call)} is none of this "
                f"trajectory's declared steps (timesteps {self.plan.describe_steps()}). Declare the timesteps the "
                f"DiT is called with, one per trained step (sample['timesteps'][:, steps]), or make calls that are "
                f"not trained steps under torch.no_grad()"), where=undeclared.where)
        wrong = [v for v in unverified if actual[id(v)] != v.step]
        if not wrong:
            return False
        for v in wrong:
            win = self.window(v.step)
            if win.visits.get(v.step) is v:
                del win.visits[v.step]
        rename = {v.step: actual[id(v)] for v in wrong}
        self.visited = [rename.get(s, s) for s in self.visited]
        demoted = []
        for v in wrong:
            step = actual[id(v)]
            win = self.window(step)
            if step in win.visits or step in win.dropped:
                self.owner.safety.visited_twice(self, win, step, v.where)
            elif v.exact and not win.exact:
                # its gradient landed through its own graph (it was taken for a step of an exact window)
                demoted.append(win.planned.index)
                self.owner.safety.demote(self, win)
            v.step = step
            win.visits[step] = v
        if self.in_order:
            self.in_order = False
            self.owner.left_order(self)
        if demoted:
            self.owner.safety.warn(
                f"the steps came out of σ order (the last trajectory visited them in order, so jaggc took each call "
                f"for the next step in σ order, checked on the device): window(s) {sorted(set(demoted))} ran exactly")
        # each visit now under its own step: its window's roles hold (a knot without its graph re-runs in
        # the window's backward), an exact window's visits take their gradient through their own graphs
        for win in self.windows:
            if win.exact and not win.done and any(v.grads is not None for v in win.pending()):
                self.owner.safety.demote(self, win)
        self._complete_ready()
        return True

    def outside_step(self, forward: Callable, where: str) -> Any:
        """A no-grad call of an FSDP1 module during the trajectory that is no step (a KL reference
        forward between a step's forward and its backward): what the loop did to ``.grad`` since
        the ledger's last look is judged first (a reset drops, a write refuses, as before a step),
        then what FSDP1's own forward does to it (new views of its flat gradient on the original
        parameters) is no write of the loop's."""
        if not self.dropped:
            self.owner.safety.before_outside_call(self, where)
        out = forward()
        if not self.dropped:
            self.owner.ledger.snapshot_grads()
        return out

    def _slice(self, call: DitCall) -> RowSlice | None:
        """The CFG slice this call runs with (slicing.py), None when off or not learned (yet). Live
        dropout draws one mask for the whole batch in the unchanged call, so it turns the slice off."""
        slicer = self.owner.slicer
        if slicer is None:
            return None
        rows = slicer.rule(batch_size(call))
        if rows is not None and (self.draws or any(m.training for m in self.dropouts)):
            self.owner.note_once("slice-dropout", (
                "the CFG slice is off while the DiT has live dropout (p > 0 in train mode): a sliced call would draw "
                "other dropout masks than the whole batch's call; every row runs with grad"))
            return None
        return rows

    def _forward_held(self, visit: StepVisit, forward: Callable) -> Any:
        """The visit's forward with grad, its graph held for its window's (or its own) backward: the
        whole call, or with the CFG slice a no-grad call on the rows without gradient (first: the
        module's latest forward is the one with grad) and a call with grad on the others."""
        call, rows, counts = visit.call, visit.rows, self.owner.counts
        if rows is None:
            visit.held = self._forward_with_grad(call, forward)
            return visit.held
        unbatched = self.owner.options.unbatched
        free = self._forward_without_grad(call_rows(call, rows.runs(False), unbatched), forward)
        if rng_drawn(visit.rng):
            # the call draws random numbers (dropout that no module shows: F.dropout, attention's
            # dropout_p): its rows with grad would draw from where the free rows left the generators,
            # which a re-run (or recovery) of one part cannot replay. The whole call runs with grad, from
            # the states it starts from now, as an unsliced call; the free rows' forward is wasted once
            visit.drew, visit.rows = True, None
            visit.rng = rng_states(call.args, call.kwargs, devices=self.devices)
            out = forward(*call.args, **call.kwargs)
            check_output_requires_grad(self.owner.module, out)
            visit.held = out
            counts.grad_forwards += 1
            return out
        trained = call_rows(call, rows.runs(True), unbatched)
        out = forward(*trained.args, **trained.kwargs)
        check_output_requires_grad(self.owner.module, out)
        visit.held = out
        counts.grad_forwards += 1
        counts.sliced_steps += 1
        return assemble([(rows.runs(False), free), (rows.runs(True), tree_map(detached, out))])

    def _forward_with_grad(self, call: DitCall, forward: Callable) -> Any:
        """``call``'s forward with grad, whole."""
        if self.owner.cache is not None and self.owner.distributed:
            # every step's call takes part in one agreement on the cache (_cached): on the deferred
            # schedule each rank visits its steps in its own order, and this rank's knot meets
            # another rank's interior step
            agree_on_hit(False, group=self.owner.engine.process_group())
        out = forward(*call.args, **call.kwargs)
        check_output_requires_grad(self.owner.module, out)
        self.owner.counts.grad_forwards += 1
        return out

    def _cached(self, call: DitCall) -> Any | None:
        """``call``'s output from the rollout cache (runtime/rollout_cache.py), or None. Under DDP/FSDP
        a forward is collective (FSDP gathers in each, DDP may broadcast buffers), so the ranks serve
        a call from their caches only if every rank has its own call there (one all-reduce)."""
        cache = self.owner.cache
        if cache is None:
            return None
        first, self._first_lookup = self._first_lookup, None
        if first is not None and first[0] is call and first[1] is None:
            out = None                               # the host knew it misses (_read_declaration_with_lookup)
        elif first is not None and first[0] is call:
            rows = first[2] if first[2] is not None else self._read(first[1].rows)
            out = cache.finish(first[1], rows)       # read with the declaration
        else:
            pending = cache.prepare(call)
            # its one host read carries the run's pending flags (module docstring)
            out = None if pending is None else cache.finish(pending, self._read(pending.rows))
        if self.owner.distributed and not agree_on_hit(out is not None, group=self.owner.engine.process_group()):
            out = None
        if out is not None:
            self.owner.counts.cached_forwards += 1
        return out

    def _forward_without_grad(self, call: DitCall, forward: Callable) -> Any:
        """A no-grad forward of ``call``: from the rollout cache when it has the call at these
        parameters and in this state, else run."""
        out = self._cached(call)
        if out is not None:
            return out
        with torch.no_grad():
            out = forward(*call.args, **call.kwargs)
        self.owner.counts.nograd_forwards += 1
        return out

    def _state(self) -> CallState:
        return CallState(self.states.read(), current_autocast())

    def _check_inputs(self, call: DitCall, step: int) -> None:
        """The window runtime's input refusals (inputs that require grad: computed from an earlier
        DiT output; NaN/Inf), with the device placement checked at the trajectory's first step
        (every step's call has the same structure). Not the dtypes: every call runs through the
        module's own forward, which may cast them (accelerate's mixed precision wraps it in autocast),
        so a mismatch fails here exactly as in the unchanged loop."""
        if not self.checked_placement:
            check_placement(self.owner.module, call, f"step {step}", dtypes=False)
            self.checked_placement = True
        for flag, where in step_value_flags(call, step, checked=self.checked_inputs):
            self.pending.append(("finite", where, flag))

    def _exact_call(self, win: WindowRun, step: int, call: DitCall, forward: Callable, where: str) -> Any:
        win.visits[step] = self.latest = StepVisit(step, call, None, None, [], where, exact=True)
        self._expected(self.latest)
        out = forward(*call.args, **call.kwargs)
        self.owner.counts.grad_forwards += 1
        self.owner.counts.exact_steps += 1
        if self.probe is not None:
            self.probe.read_before()
        leaves, _, index = float_leaves(out)
        grad_leaves = [leaves[i] for i in index if leaves[i].requires_grad]
        for k, leaf in enumerate(grad_leaves):
            # its backward writes .grad through the DiT's own graph: the ledger looks again when that
            # backward has finished (ledger.py); the CFG slice learns from its cotangent
            leaf.register_hook(functools.partial(self._exact_backward_hook, batch_size(call), k == 0))
        return out

    def _exact_backward_hook(self, batch: int, first: bool, grad):
        self._exact_task = backward_task_id()
        if first:
            self.owner.counts.backwards += 1
            self._step_backward_done()
            self.after_this_backward()
        if self.owner.slicer is not None:
            self.owner.slicer.observe(batch, grad)
        return grad

    def _note_order(self, step: int) -> None:
        position = self.plan.order.index(step)
        previous = self.plan.order.index(self.visited[-1]) if self.visited else -1
        if self.in_order and position != previous + 1:
            self.in_order = False
            if self.owner.distributed and not self.deferred:
                raise self.owner.safety.refuse(self, (
                    f"step {step} came out of the declared order under DDP/FSDP: the ranks agreed to run each window's "
                    f"backward at the step its last step comes in σ order, which this rank now breaks. Declare the steps "
                    f"in the order the loop visits them"))
            self.owner.left_order(self)

    # --- a step's gradient arrives ----------------------------------------------------------------
    def on_grads(self, visit: StepVisit, grads: Sequence[torch.Tensor | None]) -> None:
        win = self.window(visit.step)
        if not backward_accumulates_everywhere():
            raise self.owner.safety.refuse(self, (
                f"step {visit.step}'s loss went through torch.autograd.grad or backward(inputs=...): its gradient "
                f"reaches .grad only through its JAGG window's joint backward, which those forms do not run (they "
                f"return or accumulate a gradient of their own). Call loss.backward() once per step"), where=visit.where)
        if win.done or visit.exact:
            raise self.owner.safety.refuse(self, (
                f"step {visit.step}'s output got a second gradient after its window's joint backward "
                f"ran (a second backward() through the same step, retain_graph=True). jaggc's stepwise JAGG takes "
                f"one backward per step: sum the step's losses and call backward() once"), where=visit.where)
        if self._exact_task != backward_task_id():
            # a reset or write since the step's forward; not where this backward ran an exact step's
            # DiT backward before reaching here (its own accumulation cannot be told from a write)
            self.owner.safety.before_grads(self, visit)
        # this backward reaches no parameter unless a window completes in it (runtime/engines.py)
        self.owner.engine.ready_gradient_free_backward()
        if self.owner.slicer is not None:
            batch = batch_size(visit.call)
            for g in grads:
                self.owner.slicer.observe(batch, g)
        self.after_this_backward()
        if visit.grads is None:
            visit.grads = list(grads)
            self._step_backward_done()
        else:
            visit.grads = [a if b is None else b if a is None else a + b for a, b in zip(visit.grads, grads)]
        if self.deferred:
            # every window's backward runs once every declared step has its gradient (ranks.py), so
            # that a clip or optimizer step in the last step's body (Flow-Factory's, at sync_gradients)
            # reads the whole gradient. Where the engine takes gradients only inside the loop's own
            # backward and reduces each once per backward (ZeRO-2, runtime/engines.py): inside it, jointly;
            # elsewhere at the end of the backward that brought the last one, after DDP's and FSDP's own end
            if self.owner.engine.reduces_in_loop_backward:
                if self.ready():
                    self.complete_all()
            elif self.ready() and not self._completion_queued:
                self._completion_queued = True
                run_after_backward(self._complete_deferred)
            return
        if win.exact:
            # the window had to run exactly after this step's forward: its gradient goes through its own graph
            self.run_backward([(visit, visit.grads)])
            visit.exact = True
            self._judge()
        elif all(s in win.visits and win.visits[s].grads is not None for s in win.planned.steps):
            # every flag read before the window's gradient lands; a wrong prediction moved the visits
            # (_judge), and the windows complete as they now stand
            if any(v.rows is not None for v in win.visits.values()):
                # the CFG slice reads its flags before the window's backward: the pending ones go with them
                try:
                    self.complete(win)
                except _Moved:
                    self._judge()
                    self._complete_ready()
            elif self.settle():
                self._complete_ready()
            else:
                self.complete(win)

    def _complete_ready(self) -> None:
        for w in self.windows:
            if not (w.done or w.exact) and all(s in w.visits and w.visits[s].grads is not None
                                                for s in w.planned.steps):
                self.complete(w)

    def after_this_backward(self) -> None:
        """When the loop's backward running now has finished (after DDP's and FSDP's own end of
        backward): the ledger marks ``.grad`` while a gradient is withheld, takes the marks back when
        none is, and looks at ``.grad`` again (ledger.py). Once per backward pass."""
        task = backward_task_id()
        if task == -1 or task == self._after_task:
            return
        self._after_task = task
        run_after_backward(self._after_backward)

    def _after_backward(self) -> None:
        self._after_task = None
        if not self.dropped:
            self.owner.ledger.withholding(self.withheld())

    def withheld(self) -> bool:
        """Whether some step's backward ran and its gradient is not in ``.grad`` yet (its window's
        joint backward has not run)."""
        return any(v.grads is not None for w in self.windows if not w.done for v in w.pending())

    def withheld_steps(self) -> list[int]:
        return sorted(v.step for w in self.windows if not w.done for v in w.pending() if v.grads is not None)

    def _step_backward_done(self) -> None:
        """A step's backward began; after the trajectory's last one, a guard probe reads ``.grad``
        once that backward has finished (on the deferred schedule: after ``complete_all``)."""
        self.backward_steps += 1
        if self.probe is not None and not self.deferred and self.backward_steps == len(self.plan):
            self.probe.queue_after()

    # --- a window's joint backward -----------------------------------------------------------------
    def complete(self, win: WindowRun) -> None:
        self.run_backward(self.window_entries(win), windows=[win])
        self.finish(win)

    def window_entries(self, win: WindowRun) -> list[tuple[StepVisit, list]]:
        """What the window's backward sends through which call: each knot its composite
        Γ_j = Σ_s Φ[s, j] g_s (an exact window: each step its own g_s)."""
        win.jagg = False
        if win.planned.exact or win.exact:
            # a window demoted after a zero_grad (safety.py) lacks its dropped steps; its steps that
            # already went through their own graphs are exact
            visits = [win.visits[s] for s in win.planned.steps if s in win.visits]
            return [(v, v.grads) for v in visits if not v.exact and v.grads is not None]
        visits = [win.visits[s] for s in win.planned.steps]
        if len({tuple(v.index) for v in visits}) != 1:
            raise self.owner.safety.refuse(self, (
                f"the steps of window {win.planned.index} returned DiT outputs of different "
                f"structure; a window's steps must call the DiT alike"), where=visits[0].where)
        time_arg = resolve_time_arg(visits[0].call, self.owner.options.time_arg)
        times = torch.stack([per_sample_time(v.call, time_arg, v.step) for v in visits])
        knots, phi = self.owner.basis.sample(times)
        if tuple(knots) != win.planned.knots:
            # σ-aware placement decided otherwise on the calls' own timesteps than on the declared
            # ones (a timestep at the threshold, within roundoff): the window runs exactly
            return [(v, v.grads) for v in visits]
        batch = times.shape[1]
        win.jagg = True
        composites = [knot_composites(phi, gs) for gs in zip(*[v.grads for v in visits])]   # per tapped leaf
        return [(visits[position], [None if c is None else c[j * batch:(j + 1) * batch] for c in composites])
                for j, position in enumerate(knots)]

    def finish(self, win: WindowRun) -> None:
        win.done = True
        if not win.planned.exact:
            self.owner.counts.jagg_windows += 1
        for v in win.visits.values():
            v.held, v.grads, v.exact = None, None, True

    def ready(self) -> bool:
        """Every declared step ran and got its gradient."""
        return not self.missing() and all(v.grads is not None for w in self.windows for v in w.pending())

    def _complete_deferred(self) -> None:
        """The deferred schedule's end, at the end of the backward that brought the last declared
        step's gradient (after the ledger's look at ``.grad`` and DDP's and FSDP's own end of that
        backward): every window's backward; then ``.grad`` holds every step's gradient."""
        self._completion_queued = False
        if self.dropped or not self.ready() or not self.open_windows():
            return
        self.complete_all()
        self.owner.ledger.withholding(self.withheld())

    def complete_all(self) -> None:
        """The deferred schedule's end (ranks.py): at the end of the backward that brought the last
        declared step's gradient (``_complete_deferred``, a callback after DDP's and FSDP's own end of
        that backward), or when the trajectory ends if a step's gradient never came: every window's
        backward, in window order, the same on every rank. Held
        graphs go in ONE backward (under FSDP1 a graph whose forward was not the latest is
        backpropagated only along with a fresh one, whose hooks unshard the parameters); re-run
        calls one window (an exact window: one step) at a time, at one window's memory."""
        if self.owner.backward is BackwardMode.JOINT or self.owner.engine.reduces_in_loop_backward:
            open_windows = [w for w in self.windows if not w.done]
            self.run_backward([e for w in open_windows for e in self.window_entries(w)], windows=open_windows)
        else:
            for w in self.windows:
                if w.done:
                    continue
                entries = self.window_entries(w)
                for part in ([[e] for e in entries] if w.planned.exact else [entries]):
                    self.run_backward(part, windows=[w])
        for w in self.windows:
            if not w.done:
                self.finish(w)
        if self.probe is not None:
            self.probe.read_after()

    def run_backward(self, entries: list[tuple[StepVisit, list]], windows: Sequence[WindowRun] = ()) -> None:
        """ONE backward of ``entries`` ((visit, upstream grad per tapped leaf)) through each visit's
        held graph or a re-run of its call; with the CFG slice, through its rows with grad, and
        through a re-run of its rows without grad where their cotangent is not zero (the slice's
        recovery, slicing.py).

        A backward through DDP that synchronises (outside ``no_sync``) needs a forward that prepared
        DDP's reducer among its roots, and one through FSDP a forward whose hooks unshard the
        parameters for it: the module's latest forward. When no held root is that forward, the last
        entry re-runs; on the deferred schedule it always does (the last forward's kind depends on
        each rank's order of steps, and every rank must make the same forwards and collectives)."""
        if not entries:
            return
        if self.pending and not any(v.rows is not None for v, _ in entries):
            # the pending flags are read before any gradient lands (with the CFG slice's flags: _recovered)
            self._read()
        if self.owner.engine.backward_needs_latest_forward():
            if self.deferred or not any(v is self.latest and v.held is not None for v, _ in entries):
                entries[-1][0].held = None
            if self.owner.engine.sharded and not in_backward():
                # outside the loop's backward (an exact fallback at the trajectory's end: safety.py demote)
                # FSDP's pre-backward hooks of a held graph's forward fired already, in the loop's backward of
                # its step, and the parameters are resharded: the last step re-runs, so that FSDP gathers
                # them again (the two-rank fuzzer's fsdp2-early-end-freed-storage)
                entries[-1][0].held = None
        recovered = self._recovered(entries, before_jagg=any(w.jagg for w in windows))
        unbatched = self.owner.options.unbatched
        jobs = [(v, _trained_call(v, unbatched)) for v, _ in entries if v.held is None]
        self.owner.counts.sliced_steps += sum(v.rows is not None for v, _ in jobs)
        jobs += [(v, call_rows(v.call, v.rows.runs(False), unbatched)) for v in recovered]
        outs = rerun_calls(self, jobs)
        first = len(jobs) - len(recovered)
        fresh = {id(v): out for (v, _), out in zip(jobs[:first], outs)}
        recovery = {id(v): out for v, out in zip(recovered, outs[first:])}
        roots, root_grads, parts_of = [], [], {}
        for visit, grads in entries:
            out = visit.held if visit.held is not None else fresh[id(visit)]
            parts = [(out, None if visit.rows is None else visit.rows.runs(True))]
            if id(visit) in recovery:
                parts.append((recovery[id(visit)], visit.rows.runs(False)))
            parts_of[id(visit)] = parts
            batch = batch_size(visit.call)
            for part, runs in parts:
                leaves = tree_flatten(part)[0]
                for i, g in zip(visit.index, grads):
                    leaf = leaves[i]
                    if g is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        roots.append(leaf)
                        root_grads.append((g if runs is None else take_rows(g, runs, batch)).to(leaf.dtype))
            visit.held = None
        jagg = [w for w in windows if w.jagg]
        if self.probe is not None and jagg:
            self.probe.window_errors(jagg, parts_of, {id(v): g for v, g in entries})
        if roots:
            self.owner.safety.before_backward(self, entries)
            # the marks nothing wrote into go before jaggc's own backward writes: autograd then takes
            # its gradients as they come instead of adding them to -0.0 (ledger.py; marked again
            # after the loop's backward if a step's gradient is still held back)
            self.owner.ledger.marks.unmark()
            torch.autograd.backward(roots, root_grads)
            self.owner.counts.backwards += 1
        self.owner.ledger.snapshot_grads()

    def _recovered(self, entries: list[tuple[StepVisit, list]], before_jagg: bool = False) -> list[StepVisit]:
        """The sliced visits among ``entries`` whose rows run without grad got a nonzero cotangent
        (one host read; under DDP/FSDP the ranks agree, so that they re-run alike)."""
        sliced = [(v, grads) for v, grads in entries if v.rows is not None]
        if not sliced:
            return []
        flags = []
        for visit, grads in sliced:
            batch, runs = batch_size(visit.call), visit.rows.runs(False)
            parts = [take_rows(g, runs, batch).ne(0).any() for g in grads if g is not None]
            flags.append(torch.stack(parts).any() if parts else None)
        device = next((f.device for f in flags if f is not None), None)
        flags = [torch.zeros((), dtype=torch.bool, device=device) if f is None else f for f in flags]
        # one host read, with the run's pending flags (module docstring)
        values = self._read(torch.stack(flags)) if device is not None else [0] * len(flags)
        if before_jagg and any(kind == "step" and not ok for kind, _, ok in self._verdicts):
            raise _Moved()          # a predicted step was wrong: no JAGG backward on it (on_grads)
        if self.owner.distributed:
            import torch.distributed as dist

            values = agree(values, dist.ReduceOp.MAX, group=self.owner.engine.process_group())
        recovered = [v for (v, _), f in zip(sliced, values) if f]
        if recovered:
            self.owner.counts.recoveries += len(recovered)
            self.owner.note_once("slice-recovery", (
                f"step(s) {[v.step for v in recovered]} got a nonzero gradient on row blocks the CFG slice ran without "
                f"grad (learned from the last trajectory, where their cotangent was zero): those rows re-ran with grad, "
                f"so the gradient is exact; the slice is relearned from this trajectory"))
        return recovered

    # --- the end ----------------------------------------------------------------------------------
    def open_windows(self) -> list[WindowRun]:
        return [w for w in self.windows if w.open]

    def over(self) -> bool:
        """Every declared step ran and no window waits: a no-grad call now is no step of this
        trajectory (a trajectory declared with ``trajectory()`` ends only at the next declaration)."""
        return not self.open_windows() and not self.missing()

    def missing(self) -> list[int]:
        return [s for s in self.plan.order if s not in self.window(s).visits and s not in self.window(s).dropped]


class _Moved(Exception):
    """A JAGG window's backward met a wrong predicted step before any gradient landed (on_grads)."""


def _trained_call(visit: StepVisit, unbatched) -> DitCall:
    """The call a visit runs with grad: its rows with grad under the CFG slice, else the call."""
    return visit.call if visit.rows is None else call_rows(visit.call, visit.rows.runs(True), unbatched)


__all__ = ["StepVisit", "TrajectoryRun", "WindowRun"]
