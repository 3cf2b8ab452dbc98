"""The guard inside a per-step loop: a probed trajectory's JAGG error against the exact gradient.

``jaggc.stepwise(module, guard=jaggc.Guard(every=8, ...))`` probes one trajectory in ``every``
(``Guard.start``). A probe measures what the whole-loss guard measures (guard_probe.py), with the same
statistics and policy (``Guard.record``): J_p, the trajectory's gradient (what its backward passes put
into ``.grad``, exact steps included), X_p the exact gradient of the same steps, and per JAGG window
w its error e_w = Σ_j J_{k_j}ᵀ (Γ_j − g_{k_j}) − Σ_{s interior} J_sᵀ g_s, so X_p = J_p − Σ_w e_w.
Nothing of it changes ``.grad``: the optimizer gets, bit for bit, what an unguarded run gives it.

* J_p: the flat ``.grad`` when the trajectory's last backward has finished, minus the flat ``.grad``
  after its first forward; under DDP the ranks' average of that difference (whatever the loop synced in
  between: the average of an average is itself, so a synced and a ``no_sync`` backward both count
  right), under FSDP this rank's shard (reduce-scattered, averaged).
  Under DeepSpeed ZeRO-2, whose hooks take each gradient off ``.grad`` into ZeRO's partitions as it is
  accumulated, J_p is summed from the gradients the trajectory's backward passes hand autograd's
  accumulators (``_compat.accumulation_taps``, a pre-hook on each ``AccumulateGrad``: what ZeRO gets,
  the engine's 1/gradient_accumulation_steps and loss scale included) and averaged over ZeRO's
  data-parallel ranks as under DDP. The probe's own ``torch.autograd.grad`` runs no accumulator: ZeRO
  sees nothing of it and the taps do not count it.
* e_w where autograd sees the parameters (one process, DDP, DeepSpeed ZeRO-2): in a probed trajectory the interior
  steps run with grad, on the module inside DDP (DDP's reducer never sees them) and their values are
  the ones the loop would see (the rollout cache's where it serves them); when the window's
  backward runs, ONE ``torch.autograd.grad`` through the knots' graphs (retained: the window's own
  backward uses them next) and the interior steps' gives e_w into a flat buffer: one backward of the
  window's W steps. Held: the interior steps' activations until their window's backward.
* e_w under FSDP (autograd sees only the gathered copies): the window's calls and upstream gradients
  are kept, and when the trajectory ends (or before an optimizer step, if that comes first) the
  window's W calls re-run with grad through FSDP and one backward into a side buffer
  (runtime/sharded_grads.py: FSDP's own hooks gather and reduce-scatter, ``.grad`` is set aside and
  put back) gives this rank's shard of the ranks' average e_w. Statistics over shards sum their dot
  products over the ranks (guard_stats.ShardedSum): every rank computes the same figures and takes
  the same decision. Costs W forwards more per probed window than the in-window probe.

A trajectory the loop disturbed (a safety fallback, an early end) gives no probe; a probe is
dropped, with a note, if its trajectory's last backward never finished.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._compat import accumulation_taps, run_after_backward, tree_flatten
from ..runtime.collectives import agree, all_reduce_tensor
from ..runtime.guard_probe import _flat, sharded_backward, sharded_grads, slots_dtype
from ..runtime.guard_ranks import agree_all, agree_on_windows
from ..runtime.guard_stats import (ProbeResult, ShardedSum, exact_gradient, local_dot, local_sum, range_of,
                                    reduce_norms, total_error)
from ..runtime.param_grads import parameter_grads
from ..runtime.weights import noise_levels
from .served_probe import ServedProbe
from .slicing import take_rows


class TrajectoryProbe:
    """The probe of one stepwise trajectory (module docstring)."""

    def __init__(self, owner, guard, index: int, run):
        self.owner, self.guard, self.index, self.run = owner, guard, index, run
        engine = owner.engine
        self.sharded = engine.sharded
        # DeepSpeed (ZeRO and stage 0): J_p from the accumulators' taps (module docstring)
        self.zero = engine.grad_from_taps
        self.numel = engine.numel           # ZeRO-3: a parameter's full size (p.numel() is 0 at rest)
        self.taken: torch.Tensor | None = None
        self._untap = None
        if self.sharded:
            self.slots = engine.gradient_slots(owner.module)
            self.dtype = slots_dtype(self.slots)
        else:
            self.local = engine.local_module(owner.module)
            self.params = [p for p in self.local.parameters() if p.requires_grad]
            self.names = {id(p): n for n, p in self.local.named_parameters()}
            self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        # read at the trajectory's first forward, not now: FSDP1 with use_orig_params=True clears
        # its flat gradient (left from before the loop's zero_grad) in its forward
        self.before: torch.Tensor | None = None
        self.after: torch.Tensor | None = None
        self.errors: dict[int, torch.Tensor] = {}
        self.windows: list[tuple[int, float, float]] = []
        self.kept: list[tuple] = []         # FSDP: (window, [(visit, cotangents)]) re-run when the trajectory ends
        self.finished = False
        self.fallbacks = owner.counts.fallbacks
        self.served = ServedProbe()         # off-policy serving measured (served_probe.py)

    def _group(self):
        """The process group of the probe's agreements and reductions: the engine's."""
        return self.owner.engine.process_group()

    @property
    def in_window(self) -> bool:
        """The error is taken where the window's backward runs (autograd sees the parameters)."""
        return not self.sharded

    # --- the flat gradient ---------------------------------------------------------------------
    def _grads(self) -> torch.Tensor:
        if self.zero:
            return self.guard.buffers.clone(self.taken)
        if not self.sharded:
            return _flat([p.grad for p in self.params], self.params, self.dtype, self.guard.buffers, numel=self.numel)
        return sharded_grads(self.slots, self.dtype)

    def read_before(self) -> None:
        """The trajectory's first DiT forward has run (run.py)."""
        if self.before is None:
            if self.zero:
                self._tap()
            self.before = self._grads()

    def read_after(self) -> None:
        """The trajectory's last backward finished (run.py queues this after it)."""
        self.after = self._grads()
        self._stop_taps()

    def _tap(self) -> None:
        """ZeRO-2: from now on, sum what the loop's backward passes accumulate into each parameter."""
        sizes = [self.numel(p) for p in self.params]
        self.taken = self.guard.buffers.empty(sum(sizes), self.dtype, self.params[0].device).zero_()
        parts = self.taken.split(sizes)

        def take(i: int, grad: torch.Tensor) -> None:
            parts[i].add_(grad.detach().reshape(-1).to(self.dtype))

        self._untap = accumulation_taps(self.params, take)

    def _stop_taps(self) -> None:
        if self._untap is not None:
            self._untap()
            self._untap = None

    def queue_after(self) -> None:
        run_after_backward(self.read_after)

    # --- a probed trajectory's steps -------------------------------------------------------------
    def interior_forward(self, call) -> Any:
        """An interior step of a probed trajectory, with grad, on the module inside DDP."""
        owner = self.owner
        # ZeRO-3: the loop's call of the module ran its hooks (collective all-gathers) once; a nested
        # call of the module would run its root hooks again on this rank alone where the ranks' roles
        # differ (the deferred schedule): its forward, through jaggc (passing through), inside them
        run = self.local.forward if owner.engine.partitioned_parameters else self.local
        with owner.passing_through(), torch.enable_grad():
            out = run(*call.args, **call.kwargs)
        owner.counts.probe_forwards += 1
        return out

    def window_errors(self, windows, parts: dict[int, list], composites: dict[int, list]) -> None:
        """At the windows' backward: e_w of each JAGG window (module docstring). ``parts``: per visit
        the outputs its backward goes through, with the rows they hold (the CFG slice); ``composites``:
        per knot visit the Γ its backward sends."""
        for win in windows:
            knots = [win.visits[s] for s in win.planned.steps if win.planned.role(s) == "knot"]
            interior = [win.visits[s] for s in win.planned.steps if win.planned.role(s) == "interior"]
            outputs, cotangents = [], []
            for visit in knots:
                gamma = composites[id(visit)]
                batch = gamma[0].shape[0] if gamma and gamma[0] is not None else None
                for out, runs in parts[id(visit)]:
                    leaves = tree_flatten(out)[0]
                    for i, g_own, g_mix in zip(visit.index, visit.grads, gamma):
                        if g_mix is None or not getattr(leaves[i], "requires_grad", False):
                            continue
                        diff = g_mix - (0 if g_own is None else g_own)
                        outputs.append(leaves[i])
                        cotangents.append((diff if runs is None else take_rows(diff, runs, batch)).to(leaves[i].dtype))
            for visit in interior:
                if self.sharded:
                    continue
                leaves = tree_flatten(visit.probe_graph)[0]
                for i, g in zip(visit.index, visit.grads):
                    if g is not None and leaves[i].requires_grad:
                        outputs.append(leaves[i])
                        cotangents.append(-g.to(leaves[i].dtype))
            if self.sharded:
                kept = [(v, [None if g is None else g.detach().clone() for g in v.grads],
                         [None if g is None else g.detach().clone() for g in composites[id(v)]] if id(v) in composites
                         else None) for v in knots + interior]
                self.kept.append((win, kept))
                continue
            if outputs:
                # the graph is walked for stand-ins only when a parameter got no gradient (a stand-in
                # takes its parameter's: param_grads.py)
                grads = parameter_grads(outputs, self.params, cotangents, names=self.names, retain_graph=True,
                                        dit_outputs=False, what=f"jaggc guard: the probe of window {win.planned.index}")
                self._add(win, _flat(grads, self.params, self.dtype, self.guard.buffers, numel=self.numel))
                self.owner.counts.probe_backwards += 1
            for visit in interior:
                visit.probe_graph = None

    def sigma_min(self, win) -> float:
        """The lowest σ of this rank's steps of ``win``."""
        return float(noise_levels(self.run.plan.times[list(win.planned.steps)]).min())

    def _add(self, win, error: torch.Tensor, sigma_min: float | None = None) -> None:
        sigma_min = self.sigma_min(win) if sigma_min is None else sigma_min
        r = range_of(sigma_min, self.guard.sigma_edges)
        self.errors[r] = error if r not in self.errors else self.errors[r].add_(error)
        self.windows.append((win.planned.index, sigma_min, local_dot(error, error)))   # |e_w|², this rank's part

    # --- the end -------------------------------------------------------------------------------
    def finish(self, *, refused: bool = False) -> None:
        """Hand the probe to the guard (once), or drop it with a note. ``refused``: jaggc refused the
        trajectory on this rank (``Stepwise.drop``): the probe is dropped here alone, with no agreement
        between the ranks, since the refusal may be this rank's alone (run.py's order check) and its
        peers would never join one: the rank must raise its error, not wait for them."""
        if self.finished:
            return
        self.finished = True
        self._stop_taps()
        self.taken = None
        if refused:
            self.owner.note_once("probe-dropped", f"the guard's probe of trajectory {self.index} was dropped: jaggc "
                                                  f"refused its trajectory")
            self._let_go()
            return
        why = ("its last backward never finished" if self.after is None or self.before is None
               else "the loop disturbed a window" if self.owner.counts.fallbacks != self.fallbacks else None)
        if self.owner.distributed and not agree_all(why is None, group=self._group()) and why is None:
            # a probe's reductions need every rank: one rank's dropped probe drops every rank's
            why = "another rank dropped its probe of this trajectory"
        if why is not None:
            self.owner.note_once("probe-dropped", f"the guard's probe of trajectory {self.index} was dropped: {why}")
            self._let_go()
            return
        cache = self.owner.cache
        if cache is not None and cache.first_order and self.owner.first_order_stopped is None:
            self.owner.judge_serving(self.served.figures(self.run, self.index))     # every rank: one all-reduce
        reduce = ShardedSum() if self.sharded else local_sum
        if self.sharded:
            # every rank re-runs as many windows (collective backwards), each filed under its lowest σ
            # over the ranks: the same σ ranges on every rank whatever steps each trained
            sigmas = agree_on_windows([self.sigma_min(win) for win, _ in self.kept], group=self._group(),
                                      what=f"jaggc guard: the probe of trajectory {self.index}")
            for (win, kept), sigma in zip(self.kept, sigmas):
                self._rerun_window(win, kept, sigma)
        # in place: the snapshots are not read again (each new flat vector costs its page faults)
        jagg, self.after, self.before = self.after.sub_(self.before), None, None
        if not self.sharded and self.owner.distributed:       # DDP, DeepSpeed: the ranks' average
            jagg, self.errors = self._average(jagg)
        norms = reduce_norms(self.windows, reduce, jagg.device)
        error = total_error(self.errors, jagg, self.guard.buffers)
        result = ProbeResult(index=self.index, jagg=jagg, exact=exact_gradient(jagg, error, self.guard.buffers),
                             range_errors=dict(self.errors), windows=norms, reduce=reduce, measured_error=error)
        self._let_go()
        self.guard.record(result)

    def _let_go(self) -> None:
        """Drop the probe's vectors: the probe and its run refer to each other, so they live until
        Python's cycle collector runs, and the guard reuses a flat vector only once nothing refers to
        it (runtime/flat_buffers.py)."""
        self.errors, self.kept, self.before, self.after, self.taken = {}, [], None, None, None

    def _rerun_window(self, win, kept, sigma_min: float) -> None:
        """FSDP: the window's calls again with grad, one backward into a side buffer: this rank's
        shard of the average e_w."""
        from .rerun import rerun_calls

        outs = rerun_calls(self.run, [(v, v.call) for v, _, _ in kept], count=False)
        roots, cotangents = [], []
        for (visit, own, gamma), out in zip(kept, outs):
            leaves = tree_flatten(out)[0]
            for k, i in enumerate(visit.index):
                g = own[k]
                cot = (gamma[k] - (0 if g is None else g)) if gamma is not None else (None if g is None else -g)
                if cot is not None and isinstance(cot, torch.Tensor) and leaves[i].requires_grad:
                    roots.append(leaves[i])
                    cotangents.append(cot.to(leaves[i].dtype))
        self.owner.counts.probe_forwards += len(kept)
        if not roots:
            return
        self.owner.counts.probe_backwards += 1
        self._add(win, sharded_backward(self.owner.module, roots, cotangents, self.dtype,
                                        what=f"jaggc guard: the probe of window {win.planned.index}"), sigma_min)

    def _average(self, jagg: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """DDP, DeepSpeed: the ranks' average of J and of each σ range's error (module docstring); one all-reduce."""
        import torch.distributed as dist

        group = self._group()
        ranges = range(len(self.guard.ranges))
        zeros = torch.zeros_like(jagg)
        seen = torch.tensor([float(r in self.errors) for r in ranges], dtype=jagg.dtype, device=jagg.device)
        flat = torch.cat([jagg] + [self.errors.get(r, zeros) for r in ranges] + [seen])
        # per window of the plan (the ranks' plans agree: agree_on_plan) this rank's |e_w|² and whether
        # it measured it, in the same all-reduce, and its lowest σ over the ranks in one more: a fixed
        # table, so that the per-window figures are the same on every rank
        slots = len(self.run.plan.windows)
        table = torch.zeros(2 * slots, dtype=torch.float64, device=flat.device)
        lows = [float("inf")] * slots
        for pos, sigma, sq in self.windows:
            table[2 * pos] += sq.to(table)
            table[2 * pos + 1] = 1.0
            lows[pos] = min(lows[pos], sigma)
        flat = torch.cat([flat, table.to(flat.dtype)])
        all_reduce_tensor(flat, group=group)
        lows = agree(lows, dist.ReduceOp.MIN, group=group, dtype=torch.float64)
        world = dist.get_world_size(group=group)
        n = jagg.numel()
        table = flat[len(flat) - 2 * slots:].double()
        flat = flat[:len(flat) - 2 * slots]
        parts = flat[:-len(seen)].split(n)
        seen = flat[-len(seen):].tolist()           # one host read for the flags
        errors = {r: parts[1 + r] / world for r in ranges if seen[r] > 0}
        # per window: the ranks' mean |e_w|² (each rank's own window error), its lowest σ over the ranks
        measured = table[1::2].tolist()
        self.windows = [(pos, lows[pos], table[2 * pos] / world) for pos in range(slots) if measured[pos] > 0]
        return parts[0] / world, errors


__all__ = ["TrajectoryProbe"]
