"""DiT-like modules with live dropout, a recorder of the forwards they make, and the hand computation of
a gradient with the dropout masks the values used (tests of jaggc's re-runs: issue 52).

``DropoutDiT(kind)`` draws its dropout one of three ways: ``"module"`` (an ``nn.Dropout`` in train mode),
``"functional"`` (``F.dropout(h, p, training=self.training)`` in its forward, no dropout module) or
``"sdpa"`` (``F.scaled_dot_product_attention(..., dropout_p=p)``). ``Recorder`` wraps it: every forward it
makes outside a backward pass is logged with the CPU RNG state it started from, its inputs and its output.

``hand_gradient(rec, values, cotangents)`` is Σ_s J_sᵀ c_s where J_s is the Jacobian of the forward that
made the value ``values[s]``: the logged forward whose output holds those rows bit for bit, run again from
its RNG state (its output checked bit for bit: the same masks), backpropagated on those rows. It relies
on nothing of jaggc's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jaggc._compat import in_backward

DIM, TOKENS, HIDDEN, HEADS = 3, 3, 8, 2


class DropoutDiT(nn.Module):
    def __init__(self, kind: str, p: float = 0.3, *, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.kind, self.p = kind, p
        self.w_in = nn.Parameter(0.6 * torch.randn(HIDDEN, DIM + 1, generator=g, dtype=torch.float64))
        self.w_out = nn.Parameter(0.6 * torch.randn(DIM, HIDDEN, generator=g, dtype=torch.float64))
        if kind == "module":
            self.drop = nn.Dropout(p)

    def forward(self, hidden_states, timestep):
        x = hidden_states                                   # (B, L, D)
        b, n = x.shape[0], x.shape[1]
        t = timestep.to(x.dtype).reshape(-1, 1, 1).expand(b, n, 1)
        h = torch.tanh(torch.cat([x, t], -1) @ self.w_in.T)   # (B, L, H)
        if self.kind == "module":
            h = self.drop(h)
        elif self.kind == "functional":
            h = F.dropout(h, self.p, training=self.training)
        elif self.kind == "sdpa":
            q = h.reshape(b, n, HEADS, HIDDEN // HEADS).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, q, q, dropout_p=self.p if self.training else 0.0)
            h = h + a.transpose(1, 2).reshape(b, n, HIDDEN)
        else:
            raise ValueError(self.kind)
        return h @ self.w_out.T


class Recorder(nn.Module):
    """The module jaggc sees: logs (CPU RNG state, inputs, output) of each forward made outside a backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.log: list = []

    def forward(self, hidden_states, timestep):
        state = torch.get_rng_state()
        out = self.inner(hidden_states, timestep)
        if not in_backward():
            self.log.append((state, hidden_states.detach(), timestep.detach(), out.detach().clone()))
        return out


def trajectory(steps: int, batch: int = 2, seed: int = 0):
    """(latents per step, per-sample timesteps (steps, B) decreasing, cotangents per step), float64."""
    g = torch.Generator().manual_seed(seed)
    zs = [torch.randn(batch, TOKENS, DIM, generator=g, dtype=torch.float64) for _ in range(steps)]
    base = torch.tensor([950.0, 910.0, 870.0][:batch], dtype=torch.float64)
    ts = torch.stack([base - 90.0 * k - 2.0 * k * k for k in range(steps)]) / 1000.0
    gs = [torch.randn(batch, TOKENS, DIM, generator=g, dtype=torch.float64) for _ in range(steps)]
    return zs, ts, gs


def _making_forward(rec: Recorder, value: torch.Tensor):
    b = value.shape[0]
    found = []
    for state, z, t, out in rec.log:
        for r in range(out.shape[0] // b):
            if torch.equal(out[r * b:(r + 1) * b], value):
                found.append((state, z, t, out, r))
    assert found, "no logged forward made this value"
    # a value made twice (the same call with the same masks) is the same forward; take the first
    return found[0]


def hand_gradient(rec: Recorder, values, cotangents) -> torch.Tensor:
    """Σ_s J_sᵀ c_s, flat, J_s at the masks that made ``values[s]`` (module docstring)."""
    params = list(rec.inner.parameters())
    total = [torch.zeros_like(p) for p in params]
    for value, c in zip(values, cotangents):
        if c is None:
            continue
        state, z, t, out, r = _making_forward(rec, value)
        b = value.shape[0]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            with torch.enable_grad():
                y = rec.inner(z, t)
        assert torch.equal(y.detach(), out), "the logged forward did not replay its own masks"
        for acc, g in zip(total, torch.autograd.grad(y[r * b:(r + 1) * b], params, c, allow_unused=True)):
            if g is not None:
                acc += g
    return torch.cat([x.reshape(-1) for x in total])


def jagg_cotangents(gs, ts, window: int):
    """Per step, the cotangent JAGG sends through its knots (Γ_j = Σ_s Φ[s, j] g_s) or None (an interior
    step): plain JAGG (``weights="t"``) on consecutive windows of ``window`` steps."""
    from jaggc.runtime.weights import resolve_basis

    basis = resolve_basis("t")
    out = [None] * len(gs)
    for lo in range(0, len(gs), window):
        pos = list(range(lo, min(lo + window, len(gs))))
        if len(pos) <= 2:
            for p in pos:
                out[p] = gs[p]
            continue
        knots, phi = basis.sample(ts[pos])
        for j, k in enumerate(knots):
            w = phi[:, j, :].to(gs[0].dtype)                   # (S, B)
            out[pos[k]] = sum(w[s].reshape(-1, 1, 1) * gs[p] for s, p in enumerate(pos))
    return out


def flat_grad(module: nn.Module) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in module.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
