"""Velocity fields with known Jacobian structure: where JAGG is provably exact, and where not.

All are ``nn.Module``s called like a DiT, ``field(x, timestep)`` with x of shape (B, D) and a
per-sample timestep (B,), and have smooth, nonlinear dependence on their parameters θ.
"""

from __future__ import annotations

import torch
from torch import nn


def _param(*shape, generator, dtype):
    return nn.Parameter(torch.randn(*shape, generator=generator, dtype=dtype) * 0.5)


class AffineJacobianField(nn.Module):
    """v = M(θ) z + b(θ) t + c(θ) + φ(z, t), M(θ) = tanh(A)·B: J = ∂v/∂θ is affine in (z, t).

    Spec condition E1: JAGG is exact when the window's states lie on the chord with weights α_k.
    """

    def __init__(self, dim: int, *, seed: int = 0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.A = _param(dim, dim, generator=g, dtype=dtype)
        self.B = _param(dim, dim, generator=g, dtype=dtype)
        self.u = _param(dim, generator=g, dtype=dtype)
        self.w = _param(dim, generator=g, dtype=dtype)

    def forward(self, x, timestep):
        m = torch.tanh(self.A) @ self.B
        t = timestep.to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        theta_free = torch.cos(x) * t  # φ(z, t): any θ-free term leaves J unchanged
        return x @ m.T + t * torch.sin(self.u) + torch.exp(0.1 * self.w) + theta_free


class LinearAffineField(nn.Module):
    """v = W z + u t + c: linear in θ = (W, u, c), its Jacobian affine in (z, t).

    A parameter change δ moves every output by exactly J δ, so off-policy serving's first-order formula
    (runtime/first_order.py) is exact on it for any δ when the window's states lie on the chord.
    """

    def __init__(self, dim: int, *, seed: int = 0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W = _param(dim, dim, generator=g, dtype=dtype)
        self.u = _param(dim, generator=g, dtype=dtype)
        self.c = _param(dim, generator=g, dtype=dtype)

    def forward(self, x, timestep):
        t = timestep.to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return x @ self.W.T + t * self.u + self.c


class TimeAffineField(nn.Module):
    """v = b(θ) t + c(θ) + φ(z, t): J is free of z and affine in t (exactness condition E2, verify/symbolic.py).

    t-weighted JAGG is exact for arbitrary states; index weights are not on non-uniform grids.
    """

    def __init__(self, dim: int, *, seed: int = 0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.u = _param(dim, generator=g, dtype=dtype)
        self.w = _param(dim, dim, generator=g, dtype=dtype)

    def forward(self, x, timestep):
        t = timestep.to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return t * torch.sinh(self.u) + torch.tanh(self.w).sum(0) + torch.tanh(x) * (1 + t)


class LinearThetaZ(nn.Module):
    """v = θ z (counterexample C1: off-chord states break JAGG)."""

    def __init__(self, theta: float = 1.0, dtype=torch.float64):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(theta, dtype=dtype))

    def forward(self, x, timestep):
        return self.theta * x


class ThetaT(nn.Module):
    """v = θ t (counterexample C2: index weights break on a non-uniform t grid)."""

    def __init__(self, dim: int = 1, theta: float = 1.0, dtype=torch.float64):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(theta, dtype=dtype))
        self.dim = dim

    def forward(self, x, timestep):
        return self.theta * timestep.to(x.dtype).reshape(-1, 1).expand(x.shape[0], self.dim)


class CurvedField(nn.Module):
    """A small MLP in (z, t): J is not affine; JAGG is an approximation here."""

    def __init__(self, dim: int, hidden: int = 16, *, seed: int = 0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = _param(hidden, dim + 1, generator=g, dtype=dtype)
        self.w2 = _param(dim, hidden, generator=g, dtype=dtype)

    def forward(self, x, timestep):
        t = timestep.to(x.dtype).reshape(-1, 1)
        h = torch.tanh(torch.cat([x, t], 1) @ self.w1.T)
        return h @ self.w2.T
