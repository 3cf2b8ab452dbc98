"""Execute W consecutive DiT calls so that their values are exact and their backward is JAGG.

``run_window`` is the runtime the compiler pass emits one node for per window:
  * interior steps: no-grad forwards, batched across steps (``interior_chunk`` steps per call);
  * knot steps (the two endpoints for plain JAGG): ONE forward with grad on their
    batch-concatenated inputs, so the backward is one joint DiT backward;
  * a ``KnotAggregate`` node maps the W upstream gradients onto the knot outputs.
Everything goes through the normal ``dit(...)`` call and plain autograd, so DDP, FSDP, gradient
checkpointing, peft adapters and autocast see an ordinary forward/backward.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from .._compat import tree_flatten, tree_unflatten
from ..backward_modes import BACKWARD_MODES, BackwardMode, backward_mode
from ..errors import JaggInputError
from .aggregate import aggregate_knots
from .calls import (DitCall, batch_size, check_compatible, check_token_times, per_sample_time,
                    resolve_time_arg, split_output)
from .autocast import current_autocast
from .checks import check_calls, check_times
from .collectives import agree
from .deferred import BackwardGroup, DeferredWindow
from .engines import engine_of
from .first_order import serve_window
from .forwards import forward_batched, nograd_outputs
from .guard import active_probe
from .guard_probe import WindowProbe, grad_forwards
from .weights import Basis, noise_levels, resolve_basis

if TYPE_CHECKING:
    from .guard import Guard
    from .rollout_cache import RolloutCache

@dataclass(frozen=True)
class WindowOptions:
    """How a window runs. ``weights``: "t", "index" or a Basis. ``interior_chunk``: at most this
    many interior steps per no-grad forward (None: all at once). ``batch_knots=False`` runs each
    knot as its own forward (lower peak memory, same FLOPs). ``unbatched``: names of tensor inputs
    that are shared rather than batched even if their leading dim equals the batch (default: the
    position ids of Flux/Qwen-Image transformers, which never carry a batch dimension).
    ``backward``: "joint" (the knot forward keeps its activations until the loss's backward) or
    "per_window" (values from no-grad forwards; each window re-runs its knot forward inside the
    backward and frees it: peak memory of one window, two more forwards per window; deferred.py),
    or "lowmem" (each window's joint backward runs inside the loss's forward as soon as the loss's
    per-step terms give its upstream gradients: the joint mode's cost at one window's memory, for
    losses that are sums of per-step terms; lowmem.py).
    ``rollout_cache``: the on-policy fast path: interior outputs recorded during the rollout are
    reused while the parameters are unchanged (rollout_cache.py). ``guard``: a ``jaggc.Guard`` that
    probes some calls against the exact gradient and may run drifted σ ranges exactly (guard.py)."""

    weights: str | Basis = "t"
    time_arg: str | int | None = None
    interior_chunk: int | None = None
    batch_knots: bool = True
    unbatched: tuple[str, ...] = ("img_ids", "txt_ids")
    check_inputs: bool = True
    backward: BackwardMode = BackwardMode.JOINT   # or its string ("joint"); __post_init__ makes it the symbol
    rollout_cache: RolloutCache | None = field(default=None, compare=False)
    guard: Guard | None = field(default=None, compare=False)   # jaggc.Guard: probes and adapts (guard.py)

    def __post_init__(self):
        object.__setattr__(self, "backward", backward_mode(self.backward))
        from .guard import Guard

        if self.guard is not None and not isinstance(self.guard, Guard):
            raise JaggInputError(f"guard={self.guard!r}: pass a jaggc.Guard(every=..., on_drift=...) or None")

    @property
    def basis(self) -> Basis:
        return resolve_basis(self.weights)


def run_exact(dit: nn.Module, calls: Sequence[DitCall], *, steps: Sequence[int] | None = None,
              options: WindowOptions = WindowOptions()) -> list[Any]:
    """Plain per-step calls: the exact gradient, one DiT backward per step."""
    steps = list(steps) if steps is not None else list(range(len(calls)))
    if options.check_inputs and torch.is_grad_enabled():
        check_calls(dit, calls, steps)
    return [c(dit) for c in calls]


def _interior_outputs(dit, calls, steps, time_arg, options, batch) -> dict[int, Any]:
    """No-grad outputs of the interior steps, keyed by window position (rollout cache first). Under
    DDP/FSDP/DeepSpeed a forward is collective (FSDP gathers in each, DDP may broadcast buffers): the
    ranks serve the window's interior steps from their caches only if every rank has all of them (one
    all-reduce), else every rank forwards them."""
    cache = options.rollout_cache
    if cache is not None and engine_of(dit).collective_backward:
        found = [cache.lookup(c) for c in calls]
        if _every_rank(dit, all(o is not None for o in found)):
            return dict(enumerate(found))
        hit = sum(o is not None for o in found)       # found here, forwarded all the same: misses
        cache.stats.hits, cache.stats.misses = cache.stats.hits - hit, cache.stats.misses + hit
        cache = None
    return nograd_outputs(dit, calls, steps, time_arg=time_arg, batch=batch, chunk=options.interior_chunk,
                          unbatched=options.unbatched, cache=cache)


def _every_rank(dit: nn.Module, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of ``dit``'s engine (one all-reduce)."""
    import torch.distributed as dist

    return agree([int(ok)], dist.ReduceOp.MIN, group=engine_of(dit).process_group())[0] == 1


@dataclass
class PreparedWindow:
    """A window after its forwards: what assembling it as JAGG (or routing it to exact) needs."""

    calls: Sequence[DitCall]
    steps: list[int]
    time_arg: str | int
    batch: int
    times: torch.Tensor                 # (S, B) per-step, per-sample timesteps
    knots: tuple[int, ...]
    phi: torch.Tensor                   # (S, K, B) basis weights
    knot_out: Any                       # the knots' batched output, with grad
    interior_out: dict[int, Any]        # window position -> no-grad output
    probe: WindowProbe | None = None    # a guard's probe of this window (guard_probe.py)

    def assemble(self) -> list[Any]:
        """The JAGG outputs: values exact, backward through one joint knot backward."""
        return _assemble(self.phi, self.knot_out, self.knots, self.interior_out, len(self.calls), self.batch,
                         probe=self.probe)


def _checked_times(dit, calls, steps, options) -> tuple[str | int, int, torch.Tensor]:
    time_arg = resolve_time_arg(calls[0], options.time_arg)
    batch = batch_size(calls[0])
    if options.check_inputs:
        check_calls(dit, calls, steps)
        # the whole window, not only the groups that happen to be batched together below
        check_compatible(calls, time_arg, steps=steps, unbatched=options.unbatched)
    times = torch.stack([per_sample_time(c, time_arg, s) for c, s in zip(calls, steps)])
    if options.check_inputs:
        for c, s in zip(calls, steps):
            check_token_times(c, time_arg, s)
        check_times(times, steps)
    return time_arg, batch, times


def prepare_window(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int],
                   options: WindowOptions) -> PreparedWindow:
    """Checks, weights, the batched no-grad interior forwards and the knot forward with grad."""
    steps = list(steps)
    time_arg, batch, times = _checked_times(dit, calls, steps, options)
    knots, phi = sample_knots(options, times)
    interior = [p for p in range(len(calls)) if p not in knots]
    call_probe = active_probe(options) if interior else None
    probe, knot_out, interior_out = None, None, None
    if call_probe is not None:
        # a probed call: the interior forwards run with grad (same forwards, same values), so the
        # probe's exact gradient is one backward of the window (guard_probe.py)
        probe = call_probe.window(dit, calls, steps, time_arg=time_arg, batch=batch, times=times, knots=knots,
                                  phi=phi, unbatched=options.unbatched, chunk=options.interior_chunk)
        with_grad = grad_forwards(call_probe.local, [calls[p] for p in interior], [steps[p] for p in interior],
                                  time_arg=time_arg, batch=batch, chunk=options.interior_chunk,
                                  unbatched=options.unbatched)
        with_grad = {interior[i]: o for i, o in with_grad.items()}
        interior_out = {p: _detached(o) for p, o in with_grad.items()}
    cache = options.rollout_cache
    if call_probe is None and interior and cache is not None and cache.first_order:
        # off-policy serving (first_order.py): the knots first, then the interior steps from their
        # recorded outputs plus the knots' change since; under DDP/FSDP/DeepSpeed only where every rank
        # can (an agreement before the knots' forward and one after the lookups: the ranks' forwards pair)
        collective = engine_of(dit).collective_backward
        serves = _serves_first_order(dit, options, times)
        if collective:
            serves = _every_rank(dit, serves)
        if serves:
            knot_out = _knot_outputs(dit, calls, steps, knots, time_arg, options)
            interior_out = serve_window(cache, calls, knots, interior, phi,
                                        split_output(_detached(knot_out), len(knots), batch), batch)
            if collective and not _every_rank(dit, interior_out is not None):
                interior_out = None
            if interior_out is not None:
                cache.stats.first_order_served += len(interior)
    if interior_out is None:
        interior_out = _interior_outputs(dit, [calls[p] for p in interior], [steps[p] for p in interior],
                                         time_arg, options, batch)
        interior_out = {interior[i]: o for i, o in interior_out.items()}
    if knot_out is None:
        knot_out = _knot_outputs(dit, calls, steps, knots, time_arg, options)
    if probe is not None:
        probe.set_graph(knot_out, with_grad)
    return PreparedWindow(calls=calls, steps=steps, time_arg=time_arg, batch=batch, times=times, knots=knots,
                          phi=phi, knot_out=knot_out, interior_out=interior_out, probe=probe)


def _knot_outputs(dit, calls, steps, knots, time_arg, options: WindowOptions) -> Any:
    """The knots' forward with grad: one batched call, or the calls one by one concatenated."""
    if options.batch_knots:
        return forward_batched(dit, [calls[p] for p in knots], [steps[p] for p in knots], time_arg, options.unbatched)
    return _concatenated_outputs(dit, [calls[p] for p in knots])


def _serves_first_order(dit: nn.Module, options: WindowOptions, times: torch.Tensor) -> bool:
    """Whether a window's interior steps may be served first-order: a first-order rollout cache whose
    rows are the recording's before optimizer steps it accounts for, the window above the cache's
    ``min_sigma`` (announced where not); this rank's answer."""
    cache = options.rollout_cache
    if cache is None or not cache.first_order or not cache.serves_stale():
        return False
    lowest = float(noise_levels(times).min())
    if lowest < cache.min_sigma:
        warnings.warn(f"RolloutCache(first_order=True): a window reaches σ = {lowest:.3g} < min_sigma = "
                      f"{cache.min_sigma:g}, so its off-policy interior steps run their forwards (served there the "
                      f"training signal was measured off: docs/stepwise.md, 'Off-policy serving')", UserWarning,
                      stacklevel=2)
        return False
    return True


def sample_knots(options: WindowOptions, times: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """The basis's knots and weights for a window call; every step a knot (exact) where a guard
    moved the call's σ range to exact windows (guard.py, on_drift="adapt")."""
    if options.guard is not None and options.guard.runs_exact(times):
        num_steps = times.shape[0]
        eye = torch.eye(num_steps, dtype=torch.float64, device=times.device)
        return tuple(range(num_steps)), eye[:, :, None].expand(num_steps, num_steps, times.shape[1]).clone()
    return options.basis.sample(times)


def _detached(out: Any) -> Any:
    leaves, spec = tree_flatten(out)
    return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def prepare_exact_window(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int],
                         options: WindowOptions) -> PreparedWindow:
    """Every step a knot (Φ the identity): one forward with grad of the whole window, no
    interpolation (so no timestep order is required)."""
    steps = list(steps)
    time_arg, batch = resolve_time_arg(calls[0], options.time_arg), batch_size(calls[0])
    if options.check_inputs:
        check_calls(dit, calls, steps)
        check_compatible(calls, time_arg, steps=steps, unbatched=options.unbatched)
    n = len(calls)
    times = torch.stack([per_sample_time(c, time_arg, s) for c, s in zip(calls, steps)])
    phi = torch.eye(n, dtype=torch.float64, device=times.device)[:, :, None].expand(n, n, batch)
    # one forward per step, as the uncompiled loss runs them: an exact window is the exact gradient,
    # also under bf16 autocast, where a batched forward would differ by batch-size roundoff
    knot_out = _concatenated_outputs(dit, calls)
    return PreparedWindow(calls=calls, steps=steps, time_arg=time_arg, batch=batch, times=times,
                          knots=tuple(range(n)), phi=phi, knot_out=knot_out, interior_out={})


def _concatenated_outputs(dit: nn.Module, calls: Sequence[DitCall]) -> Any:
    """The calls run one by one, their outputs concatenated along the batch (one knot batch)."""
    outs = [c(dit) for c in calls]
    leaves = [tree_flatten(o)[0] for o in outs]
    spec = tree_flatten(outs[0])[1]
    return tree_unflatten([torch.cat(ls, 0) if isinstance(ls[0], torch.Tensor) else ls[0] for ls in zip(*leaves)],
                          spec)


def run_window(dit: nn.Module, calls: Sequence[DitCall], *, steps: Sequence[int] | None = None,
               options: WindowOptions = WindowOptions(), group: BackwardGroup | None = None) -> list[Any]:
    """Outputs of ``dit`` on each call, exact in value, with a JAGG backward (module docstring).

    ``group`` (per-window mode only) is shared by the windows of one loss evaluation so that DDP
    synchronises once per loss; None treats this window as the whole loss."""
    steps = list(steps) if steps is not None else list(range(len(calls)))
    if len(calls) <= 2 or not torch.is_grad_enabled():
        # a window of <= 2 steps is all knots: per-step autograd is the same gradient, simpler
        return run_exact(dit, calls, steps=steps, options=options)
    if options.backward.support.knots_in_backward:
        time_arg, batch, times = _checked_times(dit, calls, steps, options)
        knots, phi = sample_knots(options, times)
        call_probe = active_probe(options) if len(knots) < len(calls) else None
        probe = None if call_probe is None else call_probe.window(
            dit, calls, steps, time_arg=time_arg, batch=batch, times=times, knots=knots, phi=phi,
            unbatched=options.unbatched, chunk=options.interior_chunk, autocast=current_autocast())
        return DeferredWindow(dit, calls, steps, time_arg=time_arg, batch=batch, knots=knots, phi=phi,
                              interior_chunk=options.interior_chunk, batch_knots=options.batch_knots,
                              unbatched=options.unbatched, group=group, cache=options.rollout_cache,
                              probe=probe).run()
    return prepare_window(dit, calls, steps, options).assemble()


def _assemble(phi, knot_out, knots, interior_out, num_steps, batch, probe: WindowProbe | None = None) -> list[Any]:
    """Per-step outputs: differentiable leaves through KnotAggregate, the rest split as is. A
    guard's ``probe`` measures the window from the aggregation's backward (it has every g_s)."""
    knot_leaves, spec = tree_flatten(knot_out)
    interior_leaves = {p: tree_flatten(o)[0] for p, o in interior_out.items()}
    per_step = [[] for _ in range(num_steps)]
    for i, leaf in enumerate(knot_leaves):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            if leaf.ndim == 0 or leaf.shape[0] != len(knots) * batch:
                raise JaggInputError(
                    f"the DiT returned a tensor of shape {tuple(leaf.shape)} for {len(knots)} knot steps of "
                    f"batch {batch}; jaggc needs the batch dimension first in every output tensor")
            step_leaves = [None if p in knots else interior_leaves[p][i] for p in range(num_steps)]
            tap = None if probe is None else (lambda grads, i=i: probe.measure({i: grads}))
            for p, v in enumerate(aggregate_knots(phi.to(leaf.device), leaf, knots, step_leaves, tap=tap)):
                per_step[p].append(v)
        else:
            knot_parts = split_output(leaf, len(knots), batch)
            for p in range(num_steps):
                per_step[p].append(knot_parts[knots.index(p)] if p in knots else interior_leaves[p][i])
    return [tree_unflatten(leaves, spec) for leaves in per_step]


def check_window_size(window) -> None:
    """The one check of a ``window=`` option (jagg_compile, jagg_calls, the window pass, partition)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise JaggInputError(f"window={window!r}: a JAGG window needs an int of at least 2 steps; pass window=2 "
                             f"or more (4 is the default; 2 is exact, one joint backward per 2 steps)")


def partition(num_steps: int, window: int) -> list[list[int]]:
    """Consecutive windows of ``window`` steps; a shorter tail is its own (shorter) window."""
    check_window_size(window)
    return [list(range(lo, min(lo + window, num_steps))) for lo in range(0, num_steps, window)]


def deferred_grad_forwards(windows: Sequence[Sequence[int]], options: WindowOptions,
                           exact_windows: Sequence[int] = ()) -> int:
    """How many knot forwards the per-window backwards of these windows run (for BackwardGroup)."""
    if not options.backward.support.knots_in_backward:
        return 0
    total = 0
    for w, idx in enumerate(windows):
        if w not in exact_windows and len(idx) > 2:
            total += 1 if options.batch_knots else len(options.basis.knot_positions(len(idx)))
    return total
