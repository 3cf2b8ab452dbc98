"""One probe of the guard: the error of every JAGG window of one loss call against the exact gradient.

A window's JAGG gradient is J_knotsᵀ Γ, Γ_j = Σ_s Φ[s, j] g_s; its exact gradient is Σ_s J_sᵀ g_s
with the same upstream gradients g_s. Their difference

    e_w = Σ_j J_{k_j}ᵀ (Γ_j − g_{k_j})  −  Σ_{s interior} J_sᵀ g_s

is ONE backward through the window's knot outputs and its interior outputs run with grad, taken
with ``torch.autograd.grad`` into a flat buffer (``.grad`` is not touched) where the window's
runtime has all of its g_s: in the aggregation node's backward (joint mode; the knot graph is the
one the real backward then uses, so it is retained), in the deferred window's backward
(per-window mode; the knots and interiors are re-run with grad there, in the forward's module
and autocast state) or when the low-memory mode finishes the window. On a probe call the joint
and low-memory modes run the interior forwards with grad instead of without (the same forwards,
their values unchanged), so a window's probe costs one backward of its W steps: 2W F, next to the
(W+4) F of the window (per-window mode: 3W F, it re-runs the forwards).

A per-window re-run draws the dropout masks of the forwards whose values the loss used: where those
forwards drew random numbers (live dropout: deferred.py reads it from the generators), the deferred
window ran its knots and interior steps in forwards whose RNG states it recorded (``replay``), and the
probe re-runs the same batched forwards from the same states. A re-run that draws where the forwards
drew nothing (values served by the rollout cache) cannot be measured: the call gives no probe (said
once by the guard), its gradient untouched.

The JAGG gradient of the whole call is what its backward adds to ``.grad`` (a snapshot before the
call, read when the backward has finished: ``run_after_backward``, after DDP's own final
callback); the exact gradient is that minus Σ_w e_w. Under DDP the probe's forwards run on the
wrapped module itself (DDP's reducer never sees them), and the windows' errors, one flat buffer
per σ range, are all-reduced (averaged like DDP's gradients) once per probe; inside the user's
``no_sync()`` steps nothing is reduced and the figures are this rank's.

Under FSDP autograd never sees the sharded parameters (only the gathered copies), so a window keeps
its upstream gradients, and when the call's backward has finished (J read from FSDP's sharded
``.grad``) its forwards run again with grad, in the forward's module and autocast state, and ONE
backward through FSDP's own hooks into a side buffer (runtime/sharded_grads.py: ``.grad`` set
aside and put back) gives this rank's shard of the ranks' average e_w: (W + 2) F + W B per probed
window. The statistics sum their dot products over the ranks' shards (guard_stats.ShardedSum), so
every rank takes the same decision. The same holds for ``jaggc.stepwise``'s guard (steps/probe.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .._compat import (local_shard, backward_accumulates_everywhere, rng_drawn, rng_states,
                       rng_states_restored, run_after_backward, tree_flatten, tree_unflatten)
from ..errors import JaggUnsupportedError
from .aggregate import knot_composites
from .autocast import current_autocast
from .calls import DitCall, concat_calls, split_output
from .collectives import agree, all_reduce_tensor
from .engines import engine_of
from .forwards import chunked_outputs, forward_batched
from .flat_buffers import FlatBuffers
from .guard_ranks import agree_on_windows
from .guard_stats import (ProbeResult, ShardedSum, exact_gradient, local_dot, local_sum, range_of, reduce_norms,
                          total_error)
from .module_state import CallState, module_state
from .param_grads import parameter_grads
from .weights import noise_levels


def local_module(dit: nn.Module) -> nn.Module:
    """The module the probe's forwards run on: DDP's wrapped module (no reducer bookkeeping)."""
    return engine_of(dit).local_module(dit)


def _flat(grads, params, dtype, buffers: FlatBuffers | None = None, *,
          numel: Callable[[torch.Tensor], int] = torch.numel) -> torch.Tensor:
    """The gradients (None: zero) as one flat ``dtype`` vector, into one of ``buffers`` if given.
    ``numel``: a parameter's gradient size (``Engine.numel``: ZeRO-3's partitioned parameters are
    empty at rest)."""
    if buffers is None:
        return torch.cat([(torch.zeros(numel(p), dtype=dtype, device=p.device) if g is None else
                           g.reshape(-1).to(dtype)) for g, p in zip(grads, params)])
    out = buffers.empty(sum(numel(p) for p in params), dtype, params[0].device)
    offset = 0
    for g, p in zip(grads, params):
        piece = out[offset:offset + numel(p)]
        piece.zero_() if g is None else piece.copy_(g.reshape(-1))
        offset += numel(p)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return local_shard(t)                    # the shard itself (_compat/tripwire.py)


def slots_dtype(slots) -> torch.dtype:
    return torch.float64 if any(_local(s.shard()).dtype == torch.float64 for s in slots) else torch.float32


def sharded_flat(slots, grads, dtype) -> torch.Tensor:
    """This rank's shards of an FSDP module's gradient as one flat vector: ``grads`` one per gradient
    slot (``_compat.GradSlot``; None: zero), in slot order, padding included (zero, as FSDP pads)."""
    parts = []
    for slot, g in zip(slots, grads):
        shard = _local(slot.shard())
        parts.append(torch.zeros(shard.numel(), dtype=dtype, device=shard.device) if g is None
                     else _local(g).reshape(-1).to(dtype))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def sharded_grads(slots, dtype) -> torch.Tensor:
    """``sharded_flat`` of what FSDP holds in each slot now (its synced, sharded ``.grad``)."""
    return sharded_flat(slots, [(held[0] if held else None) for held in (s.held() for s in slots)], dtype)


def sharded_backward(dit: nn.Module, roots, cotangents, dtype, *, what: str) -> torch.Tensor:
    """One backward of ``roots`` through FSDP's own hooks into a side buffer (``.grad`` set aside and
    put back: runtime/sharded_grads.py): this rank's shard of the ranks' average, flat."""
    from .sharded_grads import ShardedGradBuffer

    buffer = ShardedGradBuffer(dit)
    buffer.backward(roots, cotangents, what=what)
    return sharded_flat(buffer.slots, buffer.buffer, dtype)


def grad_forwards(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int], *, time_arg, batch: int,
                  chunk: int | None, unbatched: Sequence[str]) -> dict[int, Any]:
    """The outputs of ``calls`` WITH grad, in the batched forwards the no-grad path would run."""
    with torch.enable_grad():
        return chunked_outputs(dit, calls, steps, list(range(len(calls))), time_arg=time_arg, batch=batch,
                               chunk=chunk or max(len(calls), 1), unbatched=unbatched)


class WindowProbe:
    """The probe of one JAGG window: measures e_w once the window's upstream gradients are known."""

    def __init__(self, call: CallProbe, position: int, sigma_min: float, *, calls, steps, time_arg, batch: int,
                 knots: tuple[int, ...], phi: torch.Tensor, unbatched, chunk, autocast=None):
        self.call, self.position, self.sigma_min = call, position, sigma_min
        self.calls, self.steps, self.time_arg, self.batch = list(calls), list(steps), time_arg, batch
        self.knots, self.phi, self.unbatched, self.chunk = knots, phi, unbatched, chunk
        # per-window mode: the module and autocast state the re-run forwards run in (those of the
        # window's forward, not of backward time), of the module they run on
        self.state = CallState(module_state(call.local), autocast if autocast is not None else current_autocast())
        self.knot_leaves: list | None = None          # flat leaves of the knots' batched output, with grad
        # per-window mode with live dropout: the window's no-grad forwards as [(positions, RNG states)],
        # knot groups first (deferred.py); the re-run makes the same forwards from the same states
        self.replay: list | None = None
        self.interior_leaves: dict[int, list] | None = None
        self.unmeasured: set[int] = set()

    @property
    def interior(self) -> list[int]:
        return [p for p in range(len(self.calls)) if p not in self.knots]

    def set_graph(self, knot_out: Any, interior_out: dict[int, Any]) -> None:
        self.knot_leaves = tree_flatten(knot_out)[0]
        self.interior_leaves = {p: tree_flatten(o)[0] for p, o in interior_out.items()}
        # the joint mode measures leaf by leaf (one aggregation node per output leaf)
        self.unmeasured = {i for i, x in enumerate(self.knot_leaves) if isinstance(x, torch.Tensor) and x.requires_grad}

    def _error_cotangents(self, per_leaf) -> tuple[list, list]:
        """The window's outputs with grad and the cotangents whose one backward is e_w (module docstring)."""
        outputs, cotangents = [], []
        for i, grads in per_leaf.items():
            ref = next((g for g in grads if g is not None), None)
            knot_leaf = self.knot_leaves[i]
            if ref is None or not (isinstance(knot_leaf, torch.Tensor) and knot_leaf.requires_grad):
                continue
            acc = torch.float64 if ref.dtype == torch.float64 else torch.float32
            wide = [None if g is None else g.to(acc) for g in grads]
            gamma = knot_composites(self.phi, wide)
            own = torch.cat([torch.zeros_like(ref, dtype=acc) if wide[k] is None else wide[k] for k in self.knots], 0)
            outputs.append(knot_leaf)
            cotangents.append((gamma - own).to(knot_leaf.dtype))
            for p in self.interior:
                if grads[p] is not None:
                    leaf = self.interior_leaves[p][i]
                    outputs.append(leaf)
                    cotangents.append(-grads[p].to(leaf.dtype))
        return outputs, cotangents

    def _rebuild_graph(self) -> bool:
        """Per-window mode: the knot and interior forwards again, with grad, in the forward's module and
        autocast state, and from the RNG states of the forwards that made the values where those drew
        (``replay``). False: the re-run drew random numbers where the forwards drew none; the call gives
        no probe (module docstring)."""
        dit = self.call.local
        if self.replay is not None:
            self._replay_graph(dit)
            return True
        before = rng_states(module=dit)
        with self.state.applied(dit), torch.enable_grad():
            knot_out = forward_batched(dit, [self.calls[p] for p in self.knots], [self.steps[p] for p in self.knots],
                                       self.time_arg, self.unbatched)
            interior = self.interior
            outs = grad_forwards(dit, [self.calls[p] for p in interior], [self.steps[p] for p in interior],
                                 time_arg=self.time_arg, batch=self.batch, chunk=self.chunk, unbatched=self.unbatched)
        if rng_drawn(before):
            self.call.skip(
                "the re-run of a per-window window's forwards drew random numbers (live dropout: a dropout module, "
                "F.dropout or attention's dropout_p in train mode) where the forwards that made its values drew "
                "none (the rollout cache served them): the probe would measure other masks than the values'. Turn "
                "dropout off while training with JAGG (eval(), p=0), or the rollout cache off")
            return False
        self.set_graph(knot_out, {interior[i]: o for i, o in outs.items()})
        return True

    def _replay_graph(self, dit: nn.Module) -> None:
        """The forwards of ``replay`` again with grad, each from its recorded RNG states: the knots'
        outputs concatenated in knot order (one batch, as ``forward_batched`` gives), the interior
        steps' per position."""
        outs: dict[int, Any] = {}
        with self.state.applied(dit), torch.enable_grad():
            for positions, states in self.replay:
                call = concat_calls([self.calls[p] for p in positions], self.time_arg,
                                    steps=[self.steps[p] for p in positions], unbatched=self.unbatched)
                with rng_states_restored(states):
                    out = call(dit)
                for p, o in zip(positions, split_output(out, len(positions), self.batch)):
                    outs[p] = o
            knots = [tree_flatten(outs[p]) for p in self.knots]
            spec = knots[0][1]
            knot_out = tree_unflatten([torch.cat(ls, 0) if isinstance(ls[0], torch.Tensor) else ls[0]
                                       for ls in zip(*[leaves for leaves, _ in knots])], spec)
        self.set_graph(knot_out, {p: outs[p] for p in self.interior})

    def measure(self, per_leaf: dict[int, Sequence[torch.Tensor | None]]) -> None:
        """e_w from the upstream gradients, ``{output leaf index: [g_s per window position]}``.
        Under FSDP they are kept, and e_w measured once the call's backward has finished. Nothing
        runs in a backward whose probe was skipped (``CallProbe.skip``): that backward computes
        exactly what the unguarded loss's does."""
        if self.call.skipped is not None:
            self.knot_leaves = self.interior_leaves = None
            return
        if self.call.sharded:
            kept = {i: [None if g is None else g.detach().clone() for g in grads] for i, grads in per_leaf.items()}
            self.call.kept.append((self, kept))
            self.knot_leaves = self.interior_leaves = None
            return
        self._measure(per_leaf)

    def measure_sharded(self, per_leaf) -> None:
        """FSDP: the window's forwards again with grad, in the forward's module and autocast state,
        and ONE backward through FSDP's own hooks into a side buffer (runtime/sharded_grads.py)."""
        if not self._rebuild_graph():
            return
        outputs, cotangents = self._error_cotangents(per_leaf)
        self.knot_leaves = self.interior_leaves = None
        if outputs:
            call = self.call
            call.add_window(self, sharded_backward(call.dit, outputs, cotangents, call.dtype,
                                                   what=f"jaggc guard: the probe of window {self.position}"))

    def _measure(self, per_leaf) -> None:
        if self.knot_leaves is None and not self._rebuild_graph():
            self.knot_leaves = self.interior_leaves = None
            return
        outputs, cotangents = self._error_cotangents(per_leaf)
        if outputs:
            call = self.call
            # retain: in the joint mode the real backward goes through the same knot graph next
            # walked for stand-ins only when a parameter got no gradient (steps/probe.py says why)
            grads = parameter_grads(outputs, call.params, cotangents, names=call.names, retain_graph=True,
                                    dit_outputs=False, what=f"jaggc guard: the probe of window {self.position}")
            call.add_window(self, _flat(grads, call.params, call.dtype, call.buffers))
        self.unmeasured -= set(per_leaf)
        if not self.unmeasured:
            self.knot_leaves = self.interior_leaves = None      # the interior graph is freed here


class CallProbe:
    """One probed call of the guarded loss (module docstring)."""

    def __init__(self, index: int, *, sigma_edges: tuple[float, ...], num_ranges: int,
                 on_finished: Callable[[CallProbe], None], on_skipped: Callable[[CallProbe], None] | None = None,
                 buffers: FlatBuffers | None = None):
        # what the guard's settings say (its σ ranges), and whom to hand the finished probe to:
        # given, so that this module never reaches back into guard.py
        self.index, self.sigma_edges, self.num_ranges, self.on_finished = index, sigma_edges, num_ranges, on_finished
        self.on_skipped = on_skipped
        self.buffers = buffers
        self.skipped: str | None = None               # why this call gives no probe (``skip``)
        self.dit: nn.Module | None = None
        self.local: nn.Module | None = None
        self.params: list[torch.Tensor] = []
        self.names: dict[int, str] = {}
        self.snapshot: torch.Tensor | None = None
        self.range_errors: dict[int, torch.Tensor] = {}
        self.windows: list[tuple[int, float, torch.Tensor]] = []      # (position, lowest σ, this rank's |e_w|²)
        self.positions = 0
        self.finished = False
        self.sharded = False                          # FSDP: shards, e_w measured after the backward
        self.kept: list[tuple[WindowProbe, dict]] = []

    # --- forward: the windows ---------------------------------------------------------------------
    def _bind(self, dit: nn.Module) -> None:
        if self.dit is not None:
            if dit is not self.dit:
                raise JaggUnsupportedError("jaggc guard: one loss call runs two different DiT modules; a guard probes "
                                           "one. Guard each module's loss separately")
            return
        engine = engine_of(dit)
        self.dit, self.local = dit, engine.local_module(dit)
        if engine.sharded:
            # autograd sees only FSDP's gathered copies: the probe keeps each window's upstream
            # gradients and measures them through FSDP's own backward after the call's (module docstring)
            self.sharded = True
            self.slots = engine.gradient_slots(dit)
            self.dtype = slots_dtype(self.slots)
        else:
            self.params = [p for p in self.local.parameters() if p.requires_grad]
            self.names = {id(p): n for n, p in self.local.named_parameters()}
            self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        # the .grad the call's backward will add to (earlier micro-steps' accumulation included)
        self.snapshot = self._grads()

    def _grads(self) -> torch.Tensor:
        if self.sharded:
            return sharded_grads(self.slots, self.dtype)
        return _flat([p.grad for p in self.params], self.params, self.dtype, self.buffers)

    def window(self, dit: nn.Module, calls, steps, *, time_arg, batch: int, times: torch.Tensor,
               knots: tuple[int, ...], phi: torch.Tensor, unbatched, chunk, autocast=None) -> WindowProbe:
        self._bind(dit)
        position = self.positions
        self.positions += 1
        sigma_min = float(noise_levels(times).min())
        return WindowProbe(self, position, sigma_min, calls=calls, steps=steps, time_arg=time_arg, batch=batch,
                           knots=knots, phi=phi, unbatched=unbatched, chunk=chunk, autocast=autocast)

    def add_window(self, window: WindowProbe, error: torch.Tensor) -> None:
        r = range_of(window.sigma_min, self.sigma_edges)
        self.range_errors[r] = error if r not in self.range_errors else self.range_errors[r].add_(error)
        # |e_w|², this rank's part, float64; reduced with the others at the end (``reduce_norms``)
        self.windows.append((window.position, window.sigma_min, local_dot(error, error)))

    # --- after the backward ---------------------------------------------------------------------
    def attach(self, out: Any) -> Any:
        """``out`` with its loss tensor wrapped so that its backward finishes the probe."""
        leaves, spec = tree_flatten(out)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
                from .._compat import tree_unflatten

                leaves[i] = _FinishProbe.apply(leaf, self)
                return tree_unflatten(leaves, spec)
        return out

    def skip(self, why: str) -> None:
        """This call gives no probe (``why``): nothing more is measured, nothing recorded."""
        if self.finished:
            return
        self.skipped, self.finished, self.kept = why, True, []
        self.range_errors, self.windows, self.snapshot = {}, [], None
        if self.on_skipped is not None:
            self.on_skipped(self)

    def finish(self) -> ProbeResult | None:
        """Reduce the windows' errors (DDP), read the call's gradient from ``.grad``: the probe."""
        if self.finished or self.dit is None:
            return None
        self.finished = True
        jagg = self._grads().sub_(self.snapshot)        # in place: one flat vector fewer
        reduce = ShardedSum() if self.sharded else local_sum
        if self.sharded:
            # every rank measures as many windows, each filed under its lowest σ over the ranks
            sigmas = agree_on_windows([w.sigma_min for w, _ in self.kept],
                                      what=f"jaggc guard: the probe of call {self.index}")
            for (window, _), sigma in zip(self.kept, sigmas):
                window.sigma_min = sigma
        for window, per_leaf in self.kept:      # FSDP: outside the call's backward now, .grad read
            window.measure_sharded(per_leaf)
        self.kept = []
        self._all_reduce()
        windows = reduce_norms(self.windows, reduce, jagg.device)
        error = total_error(self.range_errors, jagg, self.buffers)
        result = ProbeResult(index=self.index, jagg=jagg, exact=exact_gradient(jagg, error, self.buffers),
                             range_errors=dict(self.range_errors), windows=windows, reduce=reduce, measured_error=error)
        # the guard keeps this probe until the next call's: its vectors are the result's now, and the
        # guard reuses a flat vector only once nothing else refers to it (runtime/flat_buffers.py)
        self.snapshot, self.range_errors = None, {}
        return result

    def _all_reduce(self) -> None:
        import torch.distributed as dist

        engine = engine_of(self.dit)
        if engine.ddp is None or not engine.collective_backward:
            return      # the whole-loss probe averages over DDP's ranks (FSDP's: ShardedSum; DeepSpeed: refused)
        if not getattr(engine.ddp, "require_backward_grad_sync", True):
            return        # the user's no_sync() step: DDP reduced nothing, nor do we
        ranges = range(self.num_ranges)
        numel = self.snapshot.numel()
        flat = torch.cat([self.range_errors.get(r, torch.zeros(numel, dtype=self.dtype, device=self.snapshot.device))
                          for r in ranges])
        group = engine.process_group()
        all_reduce_tensor(flat, group=group)
        flat /= dist.get_world_size(group=group)
        parts = flat.split(numel)
        # a range no rank had a window in stays absent
        seen = agree([int(r in self.range_errors) for r in ranges], dist.ReduceOp.MAX, group=group)
        self.range_errors = {r: parts[r].clone() for r in ranges if seen[r] > 0}


SKIPPED_BACKWARD = (
    "the loss was backpropagated with torch.autograd.grad(...) or backward(inputs=...), which write no "
    ".grad (or only the inputs'), and the probe reads the call's JAGG gradient from what its backward adds "
    "to .grad; the gradient is the unguarded loss's, bit for bit. Probed calls are measured under a plain "
    "loss.backward() (a scaled one, a GradScaler's)")


class _FinishProbe(torch.autograd.Function):
    """Identity on the loss; its backward asks for the probe to finish once the backward is done.
    The loss's node is the first one its backward runs, so it is also where the form of the backward
    is known: under ``torch.autograd.grad`` or ``backward(inputs=...)`` the probe is skipped before
    any window's backward could measure (``SKIPPED_BACKWARD``)."""

    @staticmethod
    def forward(ctx, loss, probe):
        ctx.probe = probe
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        probe = ctx.probe
        if not backward_accumulates_everywhere():
            probe.skip(SKIPPED_BACKWARD)
        elif not probe.finished:
            run_after_backward(lambda: probe.on_finished(probe))
        return grad, None
