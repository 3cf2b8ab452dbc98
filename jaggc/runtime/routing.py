"""Routing: send only the windows where JAGG's assumption looks true to JAGG, the rest to exact.

JAGG is exact when the DiT's Jacobian is affine along the window and the states lie on the chord.
The velocities of the window are a cheap proxy that is already at hand (the knot forward and the
interior no-grad forwards run anyway), so each window gets a score (spec §2.5):

    v̂_k = Σ_j Φ[k, j] v_{knot j}           (the basis' prediction of step k's velocity)
    score = min over interior k of  mean over samples of  cos(v_k − v_a, v̂_k − v_a)

with v_a the first knot's velocity (the plain cos(v_k, v̂_k) saturates near 1, because the
velocities of neighbouring steps share a large common part). Three rules, combinable:

  * ``exact_below``: σ-aware placement; a window reaching a noise level σ below this value runs
    exact: the low-σ tail is where the gradient concentrates and the Jacobian is least affine (spec
    §3). σ is read from the timesteps as ``Basis(exact_below=...)`` reads it (``noise_levels``: the
    timesteps where they lie in [0, 1], else timestep / 1000), so the two are one rule in one unit;
    here it combines with the two rules below, there it runs in every backward mode;
  * ``threshold``: windows whose score is at least this go to JAGG;
  * ``jagg_frac``: of the remaining windows, the ⌊jagg_frac · n⌋ best-scored go to JAGG.

A window routed to exact reuses its knot forward (already with grad) and runs its interior steps
again with grad (one batched forward); its backward is the exact per-step gradient.

Velocity linearity is only a proxy for Jacobian linearity: ``jaggc.calibrate`` measures how well
the score predicts the gradient error on the user's model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from .._compat import tree_flatten
from ..backward_modes import backward_mode, mode_names, modes_where
from ..errors import JaggInputError, JaggUnsupportedError
from .calls import DitCall, split_output
from .forwards import forward_batched
from .weights import check_noise_level, noise_levels
from .window import PreparedWindow, WindowOptions, prepare_window, run_exact


@dataclass(frozen=True)
class Routing:
    jagg_frac: float = 1.0
    threshold: float | None = None
    exact_below: float | None = None   # σ units, as Basis(exact_below=...)

    def __post_init__(self):
        check_noise_level("Routing(exact_below", self.exact_below)
        if not 0.0 <= float(self.jagg_frac) <= 1.0:
            raise JaggInputError(f"Routing(jagg_frac={self.jagg_frac!r}) must be in [0, 1]")
        if self.threshold is not None and not -1.0 <= float(self.threshold) <= 1.0:
            raise JaggInputError(f"Routing(threshold={self.threshold!r}) is a cosine score: use a value in [-1, 1]")

    def check_backward(self, backward: str) -> None:
        """The one check that routing runs in a mode that supports it (jagg_compile and the runtime;
        the table is backward_modes.SUPPORT)."""
        if self.active and not backward_mode(backward).support.routing:
            raise JaggUnsupportedError(
                f"routing (Routing(jagg_frac={self.jagg_frac}, threshold={self.threshold}, "
                f"exact_below={self.exact_below})) needs {mode_names(modes_where('routing'))}: it scores every window before "
                f"choosing, which the per-window and low-memory modes' deferred knot work cannot do")

    @property
    def active(self) -> bool:
        """Whether windows are chosen at run time (else every window of > 2 steps is JAGG)."""
        return self.jagg_frac not in (0.0, 1.0) or self.threshold is not None or self.exact_below is not None


@dataclass
class RoutingDecision:
    """What ``run_routed`` did, per window (for the report)."""

    modes: list[str] = field(default_factory=list)
    scores: list[float | None] = field(default_factory=list)


def _velocity(output: Any) -> torch.Tensor:
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise JaggUnsupportedError("routing needs the DiT to return a floating-point tensor (the velocity)")
    return leaves[0].detach()


def window_score(prepared: PreparedWindow) -> float:
    """The §2.5 score of a prepared window (module docstring); +1 for a perfectly linear window."""
    num_knots, batch = len(prepared.knots), prepared.batch
    knot_v = _velocity(prepared.knot_out).split(batch, 0)
    knot_v = torch.stack([v.reshape(batch, -1) for v in knot_v]).double()   # (K, B, D)
    v_a = knot_v[0]
    worst = math.inf
    for k, out in prepared.interior_out.items():
        v_k = _velocity(out).reshape(batch, -1).double()
        phi = prepared.phi[k].to(knot_v.device, torch.float64)              # (K, B)
        v_hat = (phi[:, :, None] * knot_v).sum(0)
        cos = torch.nn.functional.cosine_similarity(v_k - v_a, v_hat - v_a, dim=1, eps=1e-30)
        worst = min(worst, float(cos.mean()))
    return worst if num_knots and prepared.interior_out else 1.0


def choose_jagg_windows(scores: Sequence[float | None], min_sigmas: Sequence[float], routing: Routing) -> list[bool]:
    """Which windows run JAGG, from their scores and lowest noise levels σ; ``None`` scores mark
    windows of <= 2 steps (always exact)."""
    eligible = [s is not None and (routing.exact_below is None or sigma >= routing.exact_below)
                for s, sigma in zip(scores, min_sigmas)]
    if routing.threshold is not None:
        eligible = [e and scores[i] >= routing.threshold for i, e in enumerate(eligible)]
    candidates = [i for i, e in enumerate(eligible) if e]
    keep = math.floor(routing.jagg_frac * len(candidates) + 1e-9)
    best = sorted(candidates, key=lambda i: -scores[i])[:keep]
    return [i in best for i in range(len(scores))]


def _exact_from_prepared(dit: nn.Module, prepared: PreparedWindow, options: WindowOptions) -> list[Any]:
    """A window routed to exact: the knot outputs as they are, the interior steps again with grad."""
    n, batch = len(prepared.calls), prepared.batch
    outs: list[Any] = [None] * n
    for p, o in zip(prepared.knots, split_output(prepared.knot_out, len(prepared.knots), batch)):
        outs[p] = o
    interior = [p for p in range(n) if p not in prepared.knots]
    if interior:
        batched = forward_batched(dit, [prepared.calls[p] for p in interior],
                                  [prepared.steps[p] for p in interior], prepared.time_arg, options.unbatched)
        for p, o in zip(interior, split_output(batched, len(interior), batch)):
            outs[p] = o
    return outs


def run_routed(dit: nn.Module, windows: Sequence[Sequence[DitCall]], steps: Sequence[Sequence[int]],
               options: WindowOptions, routing: Routing) -> tuple[list[list[Any]], RoutingDecision]:
    """Run a trajectory's windows, each as JAGG or exact by ``routing``; outputs per window."""
    routing.check_backward(options.backward)
    if not torch.is_grad_enabled():
        return [run_exact(dit, w, steps=s, options=options) for w, s in zip(windows, steps)], RoutingDecision()
    prepared: list[PreparedWindow | None] = []
    for calls, idx in zip(windows, steps):
        prepared.append(prepare_window(dit, calls, idx, options) if len(calls) > 2 else None)
    scores = [window_score(p) if p is not None else None for p in prepared]
    min_sigmas = [float(noise_levels(p.times).min()) if p is not None else -math.inf for p in prepared]
    chosen = choose_jagg_windows(scores, min_sigmas, routing)
    outs, decision = [], RoutingDecision(scores=scores)
    for calls, idx, prep, jagg in zip(windows, steps, prepared, chosen):
        if prep is None:
            outs.append(run_exact(dit, calls, steps=idx, options=options))
        elif jagg:
            outs.append(prep.assemble())
        else:
            outs.append(_exact_from_prepared(dit, prep, options))
        decision.modes.append("jagg" if jagg else "exact")
    return outs, decision
