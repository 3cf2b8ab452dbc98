"""A velocity field whose JAGG error the test controls, and its per-step loop (the guard tests).

``DriftingField``: v = A z + b t + c + strength · relu(0.5 − t) · sin(W z), float64. Its parameter
Jacobian is affine in (z, t) where t >= 0.5, so a window of steps there, with its states on the
window's chord, is JAGG-exact; below 0.5 the ``sin`` term bends it by ``strength`` (a buffer: the loop
raises it between trajectories, as training would move a model away from where JAGG holds). With 8
steps at t = 1, .875, ..., .125 and W=4, the first window (lowest σ .625) is exact and the second
(lowest σ .125, the guard's σ range [0, 0.25)) is not once ``strength`` > 0.
"""

from __future__ import annotations

import torch
from torch import nn

D, B, T = 6, 3, 8
TIMES = [1.0 - k / T for k in range(T)]


class DriftingField(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(0.3 * torch.randn(D, D, generator=g, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))
        self.c = nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))
        self.W = nn.Parameter(torch.randn(D, D, generator=g, dtype=torch.float64))
        self.register_buffer("strength", torch.zeros((), dtype=torch.float64))

    def forward(self, hidden_states, timestep):
        t = timestep[:, None]
        bend = self.strength * torch.relu(0.5 - t) * torch.sin(hidden_states @ self.W.T)
        return (hidden_states @ self.A.T + t * self.b + self.c + bend,)


def trajectory(seed: int) -> dict:
    """States on each window's chord (so the affine part is JAGG-exact), per-step upstream weights."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.randn(3, B, D, generator=g, dtype=torch.float64)
    states = []
    for w in range(2):
        a, b = ends[w], ends[w + 1]
        t0, t1 = TIMES[4 * w], TIMES[4 * w + 3]
        for k in range(4 * w, 4 * w + 4):
            alpha = (TIMES[k] - t0) / (t1 - t0)
            states.append((1 - alpha) * a + alpha * b)
    return dict(states=torch.stack(states), times=torch.tensor(TIMES, dtype=torch.float64),
                weights=torch.randn(T, B, D, generator=g, dtype=torch.float64))


def step_loss(dit, traj: dict, k: int) -> torch.Tensor:
    v = dit(hidden_states=traj["states"][k], timestep=traj["times"][k].expand(B))[0]
    return (v * traj["weights"][k]).sum()


def loop(dit, traj: dict, jagg=None) -> torch.Tensor:
    """One trajectory of the per-step loop (backward per step); the trajectory's gradient."""
    for p in dit.parameters():
        p.grad = None
    steps = range(T) if jagg is None else jagg.steps(range(T), traj["times"])
    for k in steps:
        step_loss(dit, traj, k).backward()
    return torch.cat([p.grad.reshape(-1) for p in dit.parameters()])


__all__ = ["B", "D", "DriftingField", "T", "TIMES", "loop", "step_loss", "trajectory"]
