"""Off-policy serving in a per-step trajectory: an interior step's output as its recorded one plus the
knots' change since the recording (runtime/first_order.py), instead of a forward.

``FirstOrderServing`` is the part of ``TrajectoryRun`` (run.py) that decides, per interior call, whether
its window can be served (the rollout cache's rows at optimizer steps it accounts for, the window above
``min_sigma``, its knots' rows linked in the recording), and gets the knots' outputs now: the loop's
own calls of them where it made them, else forwards made early on the recording's inputs of the same
samples, kept for the loop's own calls (``Prefetched``).

A window's knots that need a forward run as ONE forward with grad on their batch-concatenated inputs
where they batch (no live dropout, compatible calls; under the CFG slice one forward of their rows
without grad and one of their rows with grad), as the on-policy path
re-runs them in the window's backward (rerun.py): the loop's call of the first knot it reaches takes
the window's other knot along (in a window below ``min_sigma`` too, whose interior steps run their
forwards), and an interior step served before either knot is reached fetches both. On a
latency-bound device a forward and backward of 2B cost far less than two of B (this CPU: 1.3-1.5x
less at the 10m Flux study size), which is what off-policy windows lacked against on-policy ones.

A window below ``min_sigma`` off-policy runs its interior steps' forwards; those run together too, one
forward without grad at the loop's first call of an interior step (the others on the recording's inputs of
the same samples), each kept for the loop's own call, which takes it where its rows are the ones it ran on.

Under DDP/FSDP/DeepSpeed a forward is collective: every decision that changes which forwards run is
agreed (one all-reduce of a flag), so the ranks run the same forwards in the same order.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._compat import rng_drawn, rng_states, tree_map
from ..backward_modes import BackwardMode
from ..errors import JaggInputError
from ..runtime.calls import DitCall, batch_size, concat_calls, resolve_time_arg, split_output
from ..runtime.first_order import serve_output
from ..runtime.rollout_cache import canonical_call
from ..runtime.rollout_passes import shifted_call
from ..runtime.weights import noise_levels
from .ranks import agree_on_hit
from .roles import StepVisit, WindowRun, detached, input_versions
from .slicing import assemble, call_rows


class FirstOrderServing:
    """``TrajectoryRun``'s off-policy serving (module docstring); a mixin over the run's state."""

    def _first_order_window(self, win: WindowRun) -> bool:
        """Whether ``win`` could be served first-order, from what every rank shares (the settings, the
        agreed plan, the window's demotions, the guard's agreed figures: served_probe.py)."""
        cache = self.owner.cache
        return (cache is not None and cache.first_order and not win.exact and not win.planned.exact
                and self.owner.backward is BackwardMode.JOINT and not self.deferred
                and self.owner.first_order_stopped is None)

    def _first_order_candidate(self, win: WindowRun) -> bool:
        """Whether ``win``'s interior steps are asked whether they can be served first-order: a window
        that could be, outside a probed trajectory (agreed). Under DDP/FSDP/DeepSpeed each such call
        takes part in one agreement (``_serve_first_order``)."""
        return self.probe is None and self._first_order_window(win)

    def _serves_first_order(self, win: WindowRun) -> bool:
        """Whether this rank's cache may serve ``win``'s interior steps first-order now: its rows are the
        recording's before optimizer steps it accounts for, and the window stays above ``min_sigma``."""
        cache = self.owner.cache
        if not cache.serves_stale():
            return False
        lowest = self._lowest_sigma(win)
        if lowest < cache.min_sigma:
            self.owner.note_once(f"first-order-sigma-{win.planned.index}", (
                f"rollout_cache='first_order': window {win.planned.index} reaches σ = {lowest:.3g} < "
                f"min_sigma = {cache.min_sigma:g}, so its off-policy interior steps run their forwards (served "
                f"there, the PPO loss's upstream gradients measured cosine 0.6-0.99 to the true ones after 1-2 "
                f"optimizer steps on the digits base; above it >= 0.9999 after 8: docs/stepwise.md)"))
            return False
        return True

    def _stale_rows(self, call: DitCall, cache) -> tuple[Any, list[int]] | None:
        pending = cache.stale_prepare(call)
        if pending is None:
            return None
        rows = self._read(pending.rows)           # one host read, with the run's pending flags
        return (pending.table, rows) if all(r >= 0 for r in rows) else None

    def _serve_first_order(self, win: WindowRun, visit: StepVisit, call: DitCall, forward: Callable) -> Any | None:
        """``visit``'s output as its recorded one plus the knots' change since (first_order.py), its
        knots forwarded first where the loop has not reached them; None (the forward runs) where a row
        or a knot's row is not linked, or the window's knots are not the planned ones. Under DDP/FSDP/
        DeepSpeed a forward is collective, so every rank serves, and forwards its knots early, only if
        every rank can (one all-reduce per interior call)."""
        counts = self.owner.counts
        serves = self._serves_first_order(win)
        terms = self._first_order_terms(win, visit, call) if serves else None
        if self.owner.distributed and not agree_on_hit(terms is not None, group=self.owner.engine.process_group()):
            terms = None
        if terms is None:
            if serves:                 # this rank could serve the window: a row not linked, or a rank that cannot
                counts.first_order_missed += 1
            return None
        table, rows, knots, weights = terms
        self._fetch_knots_together(win, [k for k in knots if k[0] not in win.visits and k[0] not in win.prefetched],
                                   forward)
        now = [self._knot_now(win, step, knot_rows, forward, knot_call) for step, knot_call, knot_rows in knots]
        then = [table.output(knot_rows) for _, _, knot_rows in knots]
        counts.first_order_served += 1
        return serve_output(table.output(rows), then, now, weights, len(rows))

    def _first_order_terms(self, win: WindowRun, visit: StepVisit, call: DitCall):
        """(the recording's table, ``call``'s recorded rows, each knot's (step, call on the recorded rows
        or None, recorded rows), the interpolation weights), or None where a row or a knot's row is not
        linked, the knots are not the planned ones, or a knot's output now could not be had: no forward
        runs here, so that the ranks agree before any does."""
        found = self._stale_rows(call, self.owner.cache)
        steps = list(win.planned.steps)
        positions, phi = self.owner.basis.sample(self.plan.times[steps])       # (S, K, Bd), declared times
        if found is None or tuple(positions) != win.planned.knots:
            return None
        table, rows = found
        knots = []
        for s in (steps[p] for p in positions):
            linked = self._knot_rows(win, visit, call, table, rows, s)
            if linked is None or not self._knot_available(win, s, linked[1], linked[0]):
                return None
            knots.append((s, linked[0], linked[1]))
        weights = phi[steps.index(visit.step)].repeat(1, len(rows) // phi.shape[-1])    # (K, call batch)
        return table, rows, knots, weights

    def _knot_rows(self, win: WindowRun, visit: StepVisit, call: DitCall, table, rows: list[int], knot: int):
        """(the knot's call on the recorded rows, or None where the knot's visit has one; the recorded
        rows of the same samples at ``knot``), or None where they cannot be linked. Through the
        rollout's passes (rollout_passes.py); else, where the loop calls the DiT on views of its stored
        steps (``latents[:, j]``, the timestep a column of the declared tensor), on the same views moved
        to the knot's index, looked up in the recording (one host read, once per window)."""
        linked = win.linked.get(knot)
        if linked is not None:
            return linked
        tile, rest = divmod(len(rows), self.plan.times.shape[1])
        knot_rows = None
        # the declared timesteps in the units the DiT is called with, or as noise levels (0..1000 vs σ)
        for times in (self.plan.times[knot], noise_levels(self.plan.times[knot])) if not rest else ():
            knot_rows = knot_rows or table.passes.knot_rows(rows, times.repeat(tile).tolist())
        knot_call = None
        if knot_rows is not None:
            knot_call = table.passes.call_of_rows(knot_rows, tuple(self.owner.options.unbatched))
        elif self.plan.match_view(call) == visit.step:
            knot_call = shifted_call(call, knot - visit.step)
            found = None if knot_call is None else self._stale_rows(knot_call, self.owner.cache)
            knot_rows = None if found is None or found[0] is not table else found[1]
        if knot_rows is None or knot_call is None:
            return None
        win.linked[knot] = (knot_call, knot_rows)
        return win.linked[knot]

    def knot_output_known(self, win: WindowRun, step: int, knot_rows: list[int]) -> bool:
        """Whether the loop computed knot ``step``'s output now on ``knot_rows`` (served_probe.py)."""
        return self._knot_available(win, step, knot_rows, None)

    def _knot_available(self, win: WindowRun, step: int, knot_rows: list[int], call: DitCall | None) -> bool:
        """Whether ``_knot_now`` has knot ``step``'s output on ``knot_rows``: its visit's or an early
        forward's on those rows, or ``call`` to make one (a host read where the visit's rows are unread)."""
        visited = win.visits.get(step)
        if visited is not None:
            if visited.recorded_rows is None:
                found = self._stale_rows(visited.call, self.owner.cache)
                visited.recorded_rows = [] if found is None else found[1]
            return visited.now is not None and visited.recorded_rows == knot_rows
        ahead = win.prefetched.get(step)
        if ahead is not None:
            return ahead.rows == knot_rows
        return call is not None

    # --- a window's knots forwarded together (module docstring) ----------------------------------
    def forward_knot_with_others(self, win: WindowRun, visit: StepVisit, call: DitCall, forward: Callable) -> Any | None:
        """The loop's call of a knot of a window off-policy, run with the window's knots the loop has not
        reached (on the recording's inputs of the same samples) as ONE forward with grad (and one without,
        on the rows the CFG slice runs without grad); the others' outputs are kept for the loop's own calls
        of them. Whether or not the window's interior steps are served (a window below ``min_sigma`` runs
        their forwards, and its knots batch all the same). None where the rows are not the recording's at
        accounted optimizer steps, a knot's rows are not linked or the calls do not batch: the knot then
        runs alone. Under DDP/FSDP/DeepSpeed every rank batches only if every rank can."""
        steps = list(win.planned.steps)
        knots = [steps[p] for p in win.planned.knots]
        if all(s in win.visits or s in win.prefetched for s in knots if s != visit.step):
            return None                 # (the same on every rank: the ranks visit their steps in one order)
        rows, others = self._knots_to_fetch(win, visit, call, knots)
        batch = None if others is None else self._knot_batch([(visit.step, call)] + [k[:2] for k in others])
        if self.owner.distributed and not agree_on_hit(batch is not None, group=self.owner.engine.process_group()):
            batch = None
        if batch is None:
            return None
        (held, visible), *rest = self._forward_knot_batch(batch, forward)
        visit.held = held
        visit.recorded_rows = rows
        for (step, knot_call, knot_rows), (held_k, visible_k) in zip(others, rest):
            self._keep_early(win, step, knot_call, knot_rows, held_k, visible_k, batch.rows, visit.rng)
        return visible

    def _knots_to_fetch(self, win: WindowRun, visit: StepVisit, call: DitCall, knots: list[int]):
        """(``call``'s recorded rows, [(step, call on the recorded rows, recorded rows)] of ``win``'s knots
        other than ``visit``'s that the loop has not reached, linked through the recording of those rows);
        (None, None) where the rows may not be served now (``serves_stale``) or a knot's cannot be linked."""
        if not self.owner.cache.serves_stale():
            return None, None
        found = self._stale_rows(call, self.owner.cache)
        steps = list(win.planned.steps)
        positions, _ = self.owner.basis.sample(self.plan.times[steps])
        if found is None or tuple(positions) != win.planned.knots:
            return None, None
        table, rows = found
        others = []
        for s in knots:
            if s == visit.step or s in win.visits or s in win.prefetched:
                continue
            linked = self._knot_rows(win, visit, call, table, rows, s)
            if linked is None:
                return None, None
            others.append((s, linked[0], linked[1]))
        return (rows, others) if others else (None, None)

    def _fetch_knots_together(self, win: WindowRun, knots: list, forward: Callable) -> None:
        """Two or more of ``win``'s knots ((step, call on the recorded rows, recorded rows)) not reached by
        the loop, forwarded now together where they batch (``_knot_now`` then finds them); else left to
        ``_knot_now``, one by one. Agreed under DDP/FSDP/DeepSpeed (``knots`` is alike on every rank)."""
        if len(knots) < 2:
            return
        batch = self._knot_batch([(s, c) for s, c, _ in knots])
        if self.owner.distributed and not agree_on_hit(batch is not None, group=self.owner.engine.process_group()):
            batch = None
        if batch is None:
            return
        rng = rng_states(batch.calls[-1].args, batch.calls[-1].kwargs, devices=self.devices)
        for (step, knot_call, knot_rows), (held, visible) in zip(knots, self._forward_knot_batch(batch, forward)):
            self._keep_early(win, step, knot_call, knot_rows, held, visible, batch.rows, rng)

    # --- a window's interior steps forwarded together, below min_sigma (module docstring) ----------------
    def forward_interior_together(self, win: WindowRun, visit: StepVisit, call: DitCall, forward: Callable) -> Any | None:
        """The loop's call of an interior step of an off-policy window whose interior steps run their forwards
        (below ``min_sigma``): its output forwarded before, together with it, if the call's rows are the
        recorded ones that forward ran on; else, at the window's first such call, one forward without grad of
        it and the window's interior steps the loop has not reached (on the recording's inputs of the same
        samples), theirs kept. None: the forward runs alone (rows not the recording's, a step not linked, calls
        that do not batch). Under DDP/FSDP/DeepSpeed every decision is agreed."""
        cache, distributed = self.owner.cache, self.owner.distributed
        ahead = win.interior_ahead.pop(visit.step, None)
        if ahead is not None:                 # (alike on every rank: the batching was agreed)
            found = self._stale_rows(call, cache) if cache.serves_stale() else None
            same = found is not None and found[1] == ahead[0]
            if distributed:
                same = agree_on_hit(same, group=self.owner.engine.process_group())
            if not same:
                self.owner.note_once(f"interior-ahead-{win.planned.index}", (
                    f"step {visit.step} (an interior step of window {win.planned.index}) was forwarded with the "
                    f"window's other interior steps on the rollout's inputs of its samples; the loop's call of it "
                    f"has other inputs, so its own forward ran too"))
            return ahead[1] if same else None
        if win.interior_ahead:
            return None                       # a batch ran at an earlier interior call, without this step
        others = self._interior_to_fetch(win, visit, call) if self._interior_forwards_run(win) else None
        batch = None if others is None else self._batch_calls([(visit.step, call)] + [(s, c) for s, c, _ in others])
        if distributed and not agree_on_hit(batch is not None, group=self.owner.engine.process_group()):
            batch = None
        if batch is None:
            return None
        with torch.no_grad():
            out = forward(*batch.args, **batch.kwargs)
        counts = self.owner.counts
        counts.nograd_forwards += 1
        counts.batched_interior_forwards += 1
        outs = split_output(out, len(others) + 1, batch_size(call))
        for (step, _, rows), out_k in zip(others, outs[1:]):
            win.interior_ahead[step] = (rows, out_k)
        return outs[0]

    def _interior_forwards_run(self, win: WindowRun) -> bool:
        """Whether ``win`` is off-policy at optimizer steps the cache accounts for, with its interior steps run
        as forwards because it reaches below ``min_sigma`` (``_serves_first_order`` said so)."""
        cache = self.owner.cache
        return (cache.serves_stale()
                and self._lowest_sigma(win) < cache.min_sigma)

    def _lowest_sigma(self, win: WindowRun) -> float:
        """The lowest noise level ``win``'s declared steps reach (``min_sigma`` is compared with it)."""
        return float(noise_levels(self.plan.times[list(win.planned.steps)]).min())

    def _interior_to_fetch(self, win: WindowRun, visit: StepVisit, call: DitCall) -> list | None:
        """[(step, call on the recorded rows, recorded rows)] of ``win``'s interior steps other than ``visit``'s
        that the loop has not reached, linked through the recording of ``call``'s rows; None where there are
        none, the call's rows are not recorded or a step's cannot be linked."""
        found = self._stale_rows(call, self.owner.cache)
        if found is None:
            return None
        table, rows = found
        knots = {win.planned.steps[p] for p in win.planned.knots}
        others = []
        for s in win.planned.steps:
            if s == visit.step or s in knots or s in win.visits:
                continue
            linked = self._knot_rows(win, visit, call, table, rows, s)
            if linked is None:
                return None
            others.append((s, linked[0], linked[1]))
        return others or None

    def _batch_calls(self, calls: list[tuple[int, DitCall]]) -> DitCall | None:
        """``calls``' ((step, call)) batch-concatenated inputs as one call, None where they must run one by
        one (``_batchable``; announced)."""
        if not self._batchable(calls, "interior steps"):
            return None
        batch = self._concat(calls)
        if batch is None:
            self._not_batched("interior steps", calls, "their inputs do not concatenate along the batch")
        return batch

    def _batchable(self, calls: list[tuple[int, DitCall]], what: str) -> bool:
        """Whether ``calls`` may run as one forward: batching on (``Options(batch_knots=True)``), no live
        dropout (a batch draws other masks), one batch size. Where they may not, other than by the option,
        the slower path is announced once (``_not_batched``)."""
        if not self.owner.options.batch_knots:
            return False
        if self.draws or any(m.training for m in self.dropouts):
            return self._not_batched(what, calls, "the DiT draws random numbers (live dropout): a batch would "
                                                   "draw other masks than the calls one by one")
        if len({batch_size(c) for _, c in calls}) != 1:
            return self._not_batched(what, calls, "their calls have different batch sizes")
        return True

    def _not_batched(self, what: str, calls: list[tuple[int, DitCall]], why: str) -> bool:
        """Announce once per reason that a window's ``what`` (steps ``calls``) run one by one, slower."""
        self.owner.note_once(f"not-batched-{what}-{why}", (
            f"rollout_cache='first_order': the off-policy {what} {[s for s, _ in calls]} run one forward each, not "
            f"one together, because {why}"))
        return False

    def _knot_batch(self, calls: list[tuple[int, DitCall]]) -> "_KnotBatch | None":
        """``calls``' ((step, call)) batch-concatenated inputs: one call, or under the CFG slice one of the
        rows without grad and one of the rows with; None where they must run one by one: batching off
        (``Options(batch_knots=False)``), live dropout (a batch draws other masks), other batch sizes or
        slices, or inputs that do not concatenate."""
        options = self.owner.options
        if not self._batchable(calls, "knots"):
            return None
        slices = {self._slice(c) for _, c in calls}
        if len(slices) != 1:
            self._not_batched("knots", calls, "the CFG slice takes other rows of them")
            return None
        rows = slices.pop()
        parts = ([calls] if rows is None else
                 [[(s, call_rows(c, rows.runs(grad), options.unbatched)) for s, c in calls] for grad in (False, True)])
        concatenated = [self._concat(part) for part in parts]
        if any(c is None for c in concatenated):
            self._not_batched("knots", calls, "their inputs do not concatenate along the batch")
            return None
        return _KnotBatch(rows, concatenated, len(calls))

    def _concat(self, calls: list[tuple[int, DitCall]]) -> DitCall | None:
        options = self.owner.options
        steps = [s for s, _ in calls]
        # the recording's calls are bound as the DiT's forward binds them (rollout_cache.canonical_call): the
        # loop's call so bound too is the same call, where its own form does not concatenate with theirs
        for form in ([c for _, c in calls], [canonical_call(self.owner.module, c) for _, c in calls]):
            try:
                return concat_calls(form, resolve_time_arg(form[0], options.time_arg), steps=steps,
                                    unbatched=options.unbatched)
            except JaggInputError:
                continue
        return None

    def _forward_knot_batch(self, batch: "_KnotBatch", forward: Callable) -> list[tuple[Any, Any]]:
        """Per call of ``batch``: (its output with grad, to hold; what the loop sees). Under the CFG slice the
        rows without grad run first (the module's latest forward is then the one with grad, as in
        ``_forward_held``), and each call's two parts are put back in row order."""
        counts, n = self.owner.counts, batch.count
        counts.batched_knot_forwards += 1
        if batch.rows is None:
            outs = split_output(self._forward_with_grad(batch.calls[0], forward), n, batch_size(batch.calls[0]) // n)
            return [(out, out) for out in outs]
        free_call, trained_call = batch.calls
        with torch.no_grad():
            free = split_output(forward(*free_call.args, **free_call.kwargs), n, batch_size(free_call) // n)
        counts.nograd_forwards += 1
        trained = split_output(self._forward_with_grad(trained_call, forward), n, batch_size(trained_call) // n)
        counts.sliced_steps += n
        runs_free, runs_trained = batch.rows.runs(False), batch.rows.runs(True)
        return [(t, assemble([(runs_free, f), (runs_trained, tree_map(detached, t))])) for f, t in zip(free, trained)]

    def _keep_early(self, win: WindowRun, step: int, call: DitCall, knot_rows: list[int], held: Any, visible: Any,
                    rows, rng) -> None:
        """Knot ``step``'s output (``held``: with grad, a part of a batched forward; ``visible``: what the loop
        will see) kept for the loop's call; ``rows``: its CFG slice, or None."""
        visit = StepVisit(step, call, self._state(), rng, input_versions(call), "(a knot forwarded before its step)",
                          rows=rows)
        visit.held, visit.drew = held, rng_drawn(rng)
        visit.now, visit.recorded_rows = tree_map(detached, visible), knot_rows
        win.prefetched[step] = Prefetched(visit, knot_rows, visible)
        self.owner.counts.prefetched_knots += 1

    def _knot_now(self, win: WindowRun, step: int, knot_rows: list[int], forward: Callable,
                  call: DitCall | None = None) -> Any:
        """The visible output now of knot ``step`` on the recorded rows ``knot_rows`` (``_knot_available``
        said there is one): its visit's, or an early forward's, else a forward made now of ``call`` (the
        recording's inputs of those rows), kept for the loop's own call of the knot (``_take_prefetched``)."""
        visited = win.visits.get(step)
        if visited is not None:
            return visited.now
        ahead = win.prefetched.get(step)
        if ahead is not None:
            return ahead.now
        rows = self._slice(call)
        visit = StepVisit(step, call, self._state(), rng_states(call.args, call.kwargs, devices=self.devices),
                          input_versions(call), "(a knot forwarded before its step)", rows=rows)
        out = self._forward_held(visit, forward)
        visit.drew = rng_drawn(visit.rng)
        visit.now, visit.recorded_rows = tree_map(detached, out), knot_rows
        win.prefetched[step] = Prefetched(visit, knot_rows, out)
        self.owner.counts.prefetched_knots += 1
        return visit.now

    def _take_prefetched(self, win: WindowRun, visit: StepVisit, ahead: "Prefetched", call: DitCall):
        """The loop's own call of a knot forwarded before its step: its visit and visible output are the
        early forward's if the call's rows are the recorded ones it ran on (one host read); else the window
        runs exactly (its interior steps re-run with grad in its backward), announced; under DDP/FSDP/
        DeepSpeed on every rank if on any (one all-reduce)."""
        found = self._stale_rows(call, self.owner.cache) if self.owner.cache.serves_stale() else None
        same = found is not None and found[1] == ahead.rows
        if self.owner.distributed:          # every rank takes its early forward, or every rank runs exactly
            same = agree_on_hit(same, group=self.owner.engine.process_group())
        if same:
            early = ahead.visit
            early.where, early.inputs, early.state = visit.where, visit.inputs, visit.state
            win.visits[visit.step] = self.latest = early
            return early, ahead.out
        self.owner.safety.warn(
            f"step {visit.step} (a knot of window {win.planned.index}) was forwarded before the loop reached it, on "
            f"the rollout's inputs of its samples, to serve the window's interior steps first-order; the loop's call "
            f"of it has other inputs: window {win.planned.index} runs exactly")
        self.owner.safety.demote(self, win)
        return visit, None


class _KnotBatch:
    """Knot calls run together (``FirstOrderServing._knot_batch``): their CFG slice (None: whole calls),
    the concatenated call(s) (one; or the rows without grad, then those with), how many calls."""

    def __init__(self, rows, calls: list[DitCall], count: int):
        self.rows, self.calls, self.count = rows, calls, count


class Prefetched:
    """A knot forwarded before the loop's call of it (``TrajectoryRun._knot_now``): its visit (graph
    held), the recorded rows it ran on, and its visible output."""

    def __init__(self, visit: StepVisit, rows: list[int], out: Any):
        self.visit, self.rows, self.out = visit, rows, out
        self.now = visit.now


__all__ = ["FirstOrderServing", "Prefetched"]
