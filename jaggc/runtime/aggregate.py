"""The aggregation node: W step outputs forward, K composite gradients backward.

Forward returns each step's output unchanged: knot steps are slices of the single batched knot
forward, interior steps are no-grad outputs. Backward receives the W upstream gradients g_s and
returns, for the batched knot output, cat_j Γ_j with Γ_j = Σ_s Φ[s, j] ⊙ g_s, so that autograd
runs ONE DiT backward through the knot forward with all composites at once.
"""

from __future__ import annotations

from typing import Sequence

import torch


class KnotAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phi: torch.Tensor, knot_out: torch.Tensor, knot_steps: tuple[int, ...], *step_outs):
        # step_outs[s] is None for knot steps (their value is a slice of knot_out)
        num_knots = len(knot_steps)
        batch = knot_out.shape[0] // num_knots
        ctx.batch = batch
        ctx.save_for_backward(phi)
        slices = knot_out.split(batch, 0)
        outs = []
        knot_of = {s: j for j, s in enumerate(knot_steps)}
        for s, v in enumerate(step_outs):
            outs.append(slices[knot_of[s]] if s in knot_of else v)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        (phi,) = ctx.saved_tensors
        grad_knots = knot_composites(phi, grads)
        return (None, grad_knots, None) + (None,) * phi.shape[0]


class TappedKnotAggregate(torch.autograd.Function):
    """KnotAggregate whose backward first hands the W upstream gradients to ``tap`` (a guard's
    probe of the window, guard_probe.py)."""

    @staticmethod
    def forward(ctx, tap, phi: torch.Tensor, knot_out: torch.Tensor, knot_steps: tuple[int, ...], *step_outs):
        ctx.tap = tap
        return KnotAggregate.forward(ctx, phi, knot_out, knot_steps, *step_outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.tap(grads)
        return (None,) + KnotAggregate.backward(ctx, *grads)


def knot_composites(phi: torch.Tensor, grads) -> torch.Tensor | None:
    """cat_j Γ_j, Γ_j = Σ_s Φ[s, j] ⊙ g_s, shape (K·B, ...), from per-step gradients g_s of one
    output leaf (None where a step's output got no gradient); None if every g_s is None."""
    num_steps, num_knots, batch = phi.shape
    ref = next((g for g in grads if g is not None), None)
    if ref is None:
        return None
    # accumulate low-precision gradients in fp32; fp32/fp64 stay as they are
    acc = ref.dtype if ref.dtype in (torch.float32, torch.float64) else torch.float32
    weights = phi.to(device=ref.device, dtype=acc).view(num_steps, num_knots, batch, *([1] * (ref.ndim - 1)))
    # the composites are written in place into the batched knot gradient: one fused multiply-add
    # per step for all knots at once (addcmul_ reads low-precision g as fp32), instead of a
    # temporary per (step, knot), a cast per step and a final torch.cat
    grad_knots = torch.zeros((num_knots * batch,) + tuple(ref.shape[1:]), dtype=acc, device=ref.device)
    composites = grad_knots.view((num_knots, batch) + tuple(ref.shape[1:]))
    for s, g in enumerate(grads):
        if g is not None:
            composites.addcmul_(g.unsqueeze(0), weights[s])
    return grad_knots.to(ref.dtype)


def aggregate_knots(phi: torch.Tensor, knot_out: torch.Tensor, knot_steps: Sequence[int],
              step_outs: Sequence[torch.Tensor | None], tap=None) -> list[torch.Tensor]:
    """Step outputs whose backward is the knot aggregation (see module docstring); ``tap``: see
    TappedKnotAggregate."""
    if tap is not None:
        return list(TappedKnotAggregate.apply(tap, phi, knot_out, tuple(knot_steps), *step_outs))
    return list(KnotAggregate.apply(phi, knot_out, tuple(knot_steps), *step_outs))
