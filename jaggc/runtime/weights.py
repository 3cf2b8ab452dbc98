"""Knots and basis weights: how a window's steps borrow the Jacobians of its knot steps.

A window of S steps has K knot steps (the steps whose Jacobian is computed with one grad forward
and one joint backward). Every step s gets basis weights Φ[s, j, b] over the knots (per sample b,
since per-sample timesteps give per-sample weights), and the composite upstream gradient of knot j
is Γ_j = Σ_s Φ[s, j] · g_s. Plain JAGG is the two-knot linear basis (knots = window endpoints,
Φ = (1-α, α)); shared-endpoint hat weights and three-knot Lagrange weights are other bases over
other knot sets, and the causal left-knot variant is the one-knot constant basis.

Invariant every basis keeps: at a knot step s = knots[j], Φ[s, :] is the unit vector e_j, so the
knot's own gradient is exact; and Σ_j Φ[s, j] = 1 (an affine Jacobian is reproduced exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import JaggInputError


@dataclass(frozen=True)
class Basis:
    """A knot placement and interpolation rule.

    kind: "linear" (piecewise-linear hat functions over the knots), "lagrange" (one polynomial
    through all knots) or "constant" (every step uses the first knot: the causal left knot).
    by: "t" interpolates in timestep value, "index" in step position (the first author's code).
    knots: positions of the knot steps within the window; None means the window's two endpoints
    (or its first step for "constant").
    """

    kind: str = "linear"
    by: str = "t"
    knots: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in ("linear", "lagrange", "constant"):
            raise JaggInputError(f"unknown basis kind {self.kind!r}; use 'linear', 'lagrange' or 'constant'")
        if self.by not in ("t", "index"):
            raise JaggInputError(f"unknown weights {self.by!r}; use weights='t' or weights='index'")

    def knot_positions(self, num_steps: int) -> tuple[int, ...]:
        if self.knots is not None:
            knots = tuple(self.knots)
            if list(knots) != sorted(set(knots)) or knots[0] < 0 or knots[-1] >= num_steps:
                raise JaggInputError(f"knots {knots} must be increasing positions in 0..{num_steps - 1}")
            if self.kind != "constant" and (knots[0] != 0 or knots[-1] != num_steps - 1):
                raise JaggInputError(f"knots {knots} must include both window endpoints 0 and {num_steps - 1}")
            return knots
        if self.kind == "constant" or num_steps == 1:
            return (0,)
        if self.kind == "lagrange" and num_steps >= 3:
            return (0, (num_steps - 1) // 2, num_steps - 1)
        return (0, num_steps - 1)

    def matrix(self, times: torch.Tensor) -> torch.Tensor:
        """Φ of shape (S, K, B) in float64 for per-step, per-sample times of shape (S, B)."""
        num_steps, batch = times.shape
        knots = self.knot_positions(num_steps)
        if self.by == "index":
            x = torch.arange(num_steps, dtype=torch.float64, device=times.device)[:, None].expand(num_steps, batch)
        else:
            x = times.to(torch.float64)
        if self.kind == "constant":
            return _constant_matrix(num_steps, knots, batch, x)
        if self.kind == "lagrange":
            return lagrange_matrix(x, knots)
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


def lagrange_matrix(x: torch.Tensor, knots: Sequence[int]) -> torch.Tensor:
    """Lagrange basis through all knots (exact for Jacobians polynomial of degree K-1 along x)."""
    num_steps, batch = x.shape
    phi = torch.ones(num_steps, len(knots), batch, dtype=torch.float64, device=x.device)
    for j, kj in enumerate(knots):
        for m, km in enumerate(knots):
            if m != j:
                phi[:, j] *= (x - x[km]) / (x[kj] - x[km])
    return phi


def resolve_basis(weights: str | Basis) -> Basis:
    """The ``weights=`` option: "t", "index", or a Basis."""
    if isinstance(weights, Basis):
        return weights
    if weights in ("t", "index"):
        return Basis("linear", weights)
    raise JaggInputError(f"weights={weights!r} is not supported; use 't' (default), 'index' or a jaggc.Basis")
