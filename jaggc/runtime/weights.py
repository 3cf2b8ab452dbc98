"""Knots and basis weights: how a window's steps borrow the Jacobians of its knot steps.

A window of S steps has K knot steps (the steps whose Jacobian is computed with one grad forward
and one joint backward). Every step s gets basis weights Φ[s, j, b] over the knots (per sample b,
since per-sample timesteps give per-sample weights), and the composite upstream gradient of knot j
is Γ_j = Σ_s Φ[s, j] · g_s. Plain JAGG is the two-knot linear basis (knots = window endpoints,
Φ = (1-α, α)); shared-endpoint hat weights and three-knot Lagrange weights are other bases over
other knot sets, and the causal left-knot variant is the one-knot constant basis.

Invariant every deterministic basis keeps: at a knot step s = knots[j], Φ[s, :] is the unit
vector e_j, so the knot's own gradient is exact; and Σ_j Φ[s, j] = 1 (an affine Jacobian is
reproduced exactly). The randomized and control bases keep Σ_j Φ[s, j] = 1 but trade the first
property for unbiasedness: only their expectation over the draws is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import JaggInputError


KINDS = ("linear", "lagrange", "constant", "extrapolate", "randomized", "control")


@dataclass(frozen=True)
class Basis:
    """A knot placement and interpolation rule.

    kind: "linear" (piecewise-linear hat functions over the knots), "lagrange" (one polynomial
    through all knots), "constant" (every step uses the nearest knot at or before it: the causal
    left knot), "extrapolate" (causal linear extrapolation: a step after knot k_j uses the line
    through k_{j-1} and k_j; with knots shared by a trajectory-long window, one backward per
    knot), or "randomized" (plain JAGG plus one interior knot drawn uniformly per window call,
    with the endpoint composites corrected so that the expected gradient is the exact one), or
    "control" (plain JAGG plus a control-variate correction drawn per window call, so the
    expected gradient is the exact one while JAGG's small error is all the correction has to
    carry): ``per="window"``: with probability ``p`` every step of the window becomes a knot and
    the window's gradient is JAGG + (exact − JAGG) / p; ``per="step"``: each interior step
    independently, with probability ``p``, becomes a knot and adds (its exact term − its JAGG
    term) / p. Both cost 2 + p (W − 2) knots per window on average; per step, the corrections of
    neighbouring steps (whose errors are alike) are drawn apart, which lowers the variance.
    ``seed`` seeds the random kinds' own generator, so the user's RNG stream is untouched and the
    same seed gives the same gradients.
    by: "t" interpolates in timestep value, "index" in step position (the first author's code).
    knots: positions of the knot steps within the window; None means the window's two endpoints
    (or its first step for "constant").
    exact_below: σ-aware placement: a window call whose noise level σ falls below this anywhere runs
    every step as a knot with identity weights, i.e. exactly, in the same one joint backward.
    σ is the timestep where the DiT takes it in [0, 1] (Flux, Qwen-Image), else timestep / 1000
    (SD3's 0..1000); decided per call from the call's timesteps, so it works in every backward mode.
    """

    kind: str = "linear"
    by: str = "t"
    knots: tuple[int, ...] | None = None
    seed: int = 0
    p: float = 0.25
    per: str = "window"       # "control": correct whole windows or single interior steps
    exact_below: float | None = None   # σ-aware placement (σ units)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise JaggInputError(f"unknown basis kind {self.kind!r}; use one of {KINDS}")
        if self.by not in ("t", "index"):
            raise JaggInputError(f"unknown weights {self.by!r}; use weights='t' or weights='index'")
        if self.kind in ("randomized", "control") and self.knots is not None:
            raise JaggInputError(f"Basis({self.kind!r}) draws its knots per window; it takes no knots=")
        if self.kind == "control" and not 0 < self.p <= 1:
            raise JaggInputError(f"Basis('control', p={self.p!r}): the correction probability must be in (0, 1]")
        if self.per not in ("window", "step"):
            raise JaggInputError(f"Basis(per={self.per!r}): use per='window' or per='step'")
        check_noise_level("Basis(exact_below", self.exact_below)
        # the randomized basis's draws; a frozen dataclass, so set past __setattr__
        object.__setattr__(self, "_generator", None)

    def sample(self, times: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
        """(knot positions, Φ) for one window call: (knot_positions, matrix) for the deterministic
        kinds; a fresh draw for "randomized" and "control"; every step a knot with identity weights
        when σ-aware placement (``exact_below``) runs the call exactly."""
        num_steps = times.shape[0]
        if self.runs_exact(times):
            eye = torch.eye(num_steps, dtype=torch.float64, device=times.device)
            return tuple(range(num_steps)), eye[:, :, None].expand(num_steps, num_steps, times.shape[1]).clone()
        if self.kind not in ("randomized", "control") or num_steps <= (3 if self.kind == "randomized" else 2):
            return self.knot_positions(num_steps), self.matrix(times)
        if self._generator is None:
            object.__setattr__(self, "_generator", torch.Generator().manual_seed(self.seed))
        if self.kind == "control":
            if self.per == "step":
                draws = torch.rand(num_steps - 2, generator=self._generator, dtype=torch.float64)
                corrected = tuple(1 + i for i in range(num_steps - 2) if float(draws[i]) < self.p)
            elif float(torch.rand((), generator=self._generator, dtype=torch.float64)) < self.p:
                corrected = tuple(range(1, num_steps - 1))
            else:
                corrected = ()
            if not corrected:
                return (0, num_steps - 1), hat_matrix(self._x(times), (0, num_steps - 1))
            return (0,) + corrected + (num_steps - 1,), control_matrix(self._x(times), self.p, corrected)
        pos = 1 + int(torch.randint(num_steps - 2, (1,), generator=self._generator))
        return (0, pos, num_steps - 1), randomized_matrix(self._x(times), pos)

    def runs_exact(self, times: torch.Tensor) -> bool:
        """σ-aware placement: whether a window call with these (S, B) timesteps runs exactly."""
        return self.exact_below is not None and bool((noise_levels(times) < self.exact_below).any())

    def label(self) -> str:
        """``kind/by`` plus what else shapes the weights, e.g. ``control/t/p0.25/step``, ``linear/t/σ<0.5``."""
        parts = [self.kind, self.by]
        if self.kind == "control":
            parts.append(f"p{self.p:g}" + ("/step" if self.per == "step" else ""))
        if self.exact_below is not None:
            parts.append(f"σ<{self.exact_below:g}")
        return "/".join(parts)

    def _x(self, times: torch.Tensor) -> torch.Tensor:
        num_steps, batch = times.shape
        if self.by == "index":
            return torch.arange(num_steps, dtype=torch.float64, device=times.device)[:, None].expand(num_steps, batch)
        return times.to(torch.float64)

    def knot_positions(self, num_steps: int) -> tuple[int, ...]:
        if self.knots is not None:
            knots = tuple(self.knots)
            if list(knots) != sorted(set(knots)) or knots[0] < 0 or knots[-1] >= num_steps:
                raise JaggInputError(f"knots {knots} must be increasing positions in 0..{num_steps - 1}")
            if self.kind == "extrapolate" and knots[0] != 0:
                raise JaggInputError(f"knots {knots} must start at the window's first step 0")
            if self.kind in ("linear", "lagrange") and (knots[0] != 0 or knots[-1] != num_steps - 1):
                raise JaggInputError(f"knots {knots} must include both window endpoints 0 and {num_steps - 1}")
            return knots
        if self.kind == "constant" or num_steps == 1:
            return (0,)
        if self.kind == "lagrange" and num_steps >= 3:
            return (0, (num_steps - 1) // 2, num_steps - 1)
        if self.kind == "extrapolate":
            return (0, 1)
        if self.kind == "randomized":
            # the count every call has (its middle knot is drawn per call by ``sample``)
            return tuple(range(num_steps)) if num_steps <= 3 else (0, 1, num_steps - 1)
        return (0, num_steps - 1)

    def matrix(self, times: torch.Tensor) -> torch.Tensor:
        """Φ of shape (S, K, B) in float64 for per-step, per-sample times of shape (S, B)."""
        num_steps, batch = times.shape
        knots = self.knot_positions(num_steps)
        x = self._x(times)
        if self.kind == "constant":
            return _constant_matrix(num_steps, knots, batch, x)
        if self.kind == "lagrange":
            return lagrange_matrix(x, knots)
        if self.kind == "extrapolate":
            return extrapolation_matrix(x, knots)
        if self.kind in ("randomized", "control"):
            if num_steps <= (3 if self.kind == "randomized" else 2):
                return hat_matrix(x, knots)
            raise JaggInputError(f"Basis({self.kind!r}) has no fixed matrix; use Basis.sample(times)")
        return hat_matrix(x, knots)


def _constant_matrix(num_steps: int, knots: Sequence[int], batch: int, x: torch.Tensor) -> torch.Tensor:
    phi = torch.zeros(num_steps, len(knots), batch, dtype=torch.float64, device=x.device)
    # each step uses the nearest knot at or before it (the first knot before the first knot)
    for s in range(num_steps):
        j = max([i for i, k in enumerate(knots) if k <= s], default=0)
        phi[s, j] = 1.0
    return phi


def hat_matrix(x: torch.Tensor, knots: Sequence[int]) -> torch.Tensor:
    """Piecewise-linear interpolation weights: step s between knots k_j <= s <= k_{j+1}."""
    num_steps, batch = x.shape
    phi = torch.zeros(num_steps, len(knots), batch, dtype=torch.float64, device=x.device)
    if len(knots) == 1:
        phi[:, 0] = 1.0
        return phi
    for j in range(len(knots) - 1):
        lo, hi = knots[j], knots[j + 1]
        span = x[hi] - x[lo]
        for s in range(lo, hi + 1):
            alpha = (x[s] - x[lo]) / span
            phi[s, j] = 1.0 - alpha
            phi[s, j + 1] = alpha
    return phi


def extrapolation_matrix(x: torch.Tensor, knots: Sequence[int]) -> torch.Tensor:
    """Causal linear extrapolation: a step at or after knot k_j (j >= 1) uses the line through
    k_{j-1} and k_j; steps before k_1 use k_0 alone (no earlier knot to extrapolate from)."""
    num_steps, batch = x.shape
    phi = torch.zeros(num_steps, len(knots), batch, dtype=torch.float64, device=x.device)
    for s in range(num_steps):
        j = max(i for i, k in enumerate(knots) if k <= s)
        if j == 0:
            phi[s, 0] = 1.0
            continue
        lo, hi = knots[j - 1], knots[j]
        beta = (x[s] - x[hi]) / (x[hi] - x[lo])
        phi[s, j - 1] = -beta
        phi[s, j] = 1.0 + beta
    return phi


def randomized_matrix(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Knots (0, pos, S-1): plain two-knot weights for every step, except that the drawn interior
    step's gradient goes to its own knot scaled by m = S-2 (the number of interior steps) and its
    linear share is taken back from the endpoints: E over pos of Φᵀg is the exact Σ J_sᵀ g_s when
    the interior step is drawn uniformly (the estimator's correction term is unbiased)."""
    num_steps = x.shape[0]
    m = num_steps - 2
    linear = hat_matrix(x, (0, num_steps - 1))             # (S, 2, B)
    phi = torch.zeros(num_steps, 3, x.shape[1], dtype=torch.float64, device=x.device)
    phi[:, 0], phi[:, 2] = linear[:, 0], linear[:, 1]
    phi[pos, 0] = (1 - m) * linear[pos, 0]
    phi[pos, 2] = (1 - m) * linear[pos, 1]
    phi[pos, 1] = m
    return phi


def check_noise_level(owner: str, sigma: float | None) -> None:
    """The one check of a σ-aware threshold (``Basis(exact_below=...)``, ``Routing(exact_below=...)``)."""
    if sigma is not None and not 0 < float(sigma) <= 1:
        raise JaggInputError(f"{owner}={sigma!r}) is a noise level σ: use a value in (0, 1] (a timestep t of a "
                             f"0..1000 schedule is σ = t / 1000)")


def noise_levels(times: torch.Tensor) -> torch.Tensor:
    """σ of timesteps: the timesteps themselves where they lie in [0, 1] (a DiT that takes σ, as
    Flux and Qwen-Image do), else timestep / 1000 (SD3 and diffusers' 0..1000 convention). The
    scale is picked on the device: ``runs_exact`` runs per window call, so its one host sync is the
    final ``bool``."""
    return times / torch.where(times.max() <= 1.0, 1.0, 1000.0)


def control_matrix(x: torch.Tensor, p: float, corrected: Sequence[int] | None = None) -> torch.Tensor:
    """Knots: the endpoints and the ``corrected`` interior steps (default: all). A corrected step's
    row is (1 − 1/p) · (its plain two-knot weights) + (1/p) on its own knot: its JAGG term plus
    (exact − JAGG) / p; every other step keeps its plain JAGG weights. Each interior step corrected
    with probability p, the expectation is the exact gradient. Shape (S, K, B), K = 2 + len(corrected)."""
    num_steps, batch = x.shape
    corrected = tuple(range(1, num_steps - 1)) if corrected is None else tuple(corrected)
    knots = (0,) + corrected + (num_steps - 1,)
    linear = hat_matrix(x, (0, num_steps - 1))              # (S, 2, B)
    phi = torch.zeros(num_steps, len(knots), batch, dtype=torch.float64, device=x.device)
    phi[:, 0], phi[:, -1] = linear[:, 0], linear[:, 1]
    for k, step in enumerate(corrected, start=1):
        phi[step, 0] *= 1 - 1 / p
        phi[step, -1] *= 1 - 1 / p
        phi[step, k] = 1 / p
    return phi


def lagrange_matrix(x: torch.Tensor, knots: Sequence[int]) -> torch.Tensor:
    """Lagrange basis through all knots (exact for Jacobians polynomial of degree K-1 along x)."""
    num_steps, batch = x.shape
    phi = torch.ones(num_steps, len(knots), batch, dtype=torch.float64, device=x.device)
    for j, kj in enumerate(knots):
        for m, km in enumerate(knots):
            if m != j:
                phi[:, j] *= (x - x[km]) / (x[kj] - x[km])
    return phi


#: The default weights of ``jagg_compile`` and ``stepwise``: plain JAGG (t-weights) with σ-aware
#: placement, windows reaching σ < 0.5 run exactly; the cheapest candidate whose bias stayed within
#: 1.5x its noise floor (with a margin) and whose cosine beat subsampling in every cell of the bias
#: study (README, Fidelity; docs/bias_study.md). weights="t" is the paper's plain JAGG.
DEFAULT_WEIGHTS = Basis("linear", "t", exact_below=0.5)


def resolve_basis(weights: str | Basis) -> Basis:
    """The ``weights=`` option: "t", "index", or a Basis."""
    if isinstance(weights, Basis):
        return weights
    if weights in ("t", "index"):
        return Basis("linear", weights)
    raise JaggInputError(f"weights={weights!r} is not supported; use 't' (default), 'index' or a jaggc.Basis")
