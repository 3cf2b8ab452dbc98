"""Off-policy serving: a window's interior outputs from their recording plus the knots' first-order change.

A recording (the rollout, or a no-grad pass of the loop itself) holds each step's DiT output v_k(θ) at
the parameters θ it ran with. Once the optimizer has moved them to θ + δ, an interior step's output is
needed again. JAGG's own assumption predicts it: if the parameter-Jacobian J_k is the window's
interpolation of the knots' ones (J_k = Σ_j Φ[k, j] J_j; for plain JAGG Φ[k] = (1 − λ_k, λ_k),
λ_k = (t_k − t_a)/(t_b − t_a)), then to first order in δ

    v_k(θ + δ) = v_k(θ) + J_k δ = v_k(θ) + Σ_j Φ[k, j] (v_j(θ + δ) − v_j(θ)),

every term known once the knots' current outputs are computed (they carry the window's joint
backward anyway). It is exact for every δ on a field linear in θ whose Jacobian the basis interpolates
exactly (``jaggc verify``'s ``first_order_serving``), and off that class an approximation whose effect
on the training signal is measured (docs/stepwise.md, "Off-policy serving").

``serve_first_order`` is the formula, per sample (Φ's last axis), on the recorded and current knot
outputs as flat tensors of the window's output leaf.
"""

from __future__ import annotations

from typing import Sequence

import torch


def serve_first_order(recorded: torch.Tensor, knots_then: Sequence[torch.Tensor], knots_now: Sequence[torch.Tensor],
                      weights: torch.Tensor) -> torch.Tensor:
    """``recorded + Σ_j weights[j] (knots_now[j] − knots_then[j])`` (module docstring).

    ``recorded``, ``knots_then[j]`` and ``knots_now[j]``: (B, ...) outputs of one step's call and of the
    window's knots' calls; ``weights``: (K, B), the basis's row of this step (Φ[k, :, :]). The sum is
    taken in float32 at least (a bf16 DiT's outputs differ by a few ulps between then and now) and cast
    back to the recorded dtype."""
    acc = torch.promote_types(recorded.dtype, torch.float32)
    out = recorded.to(acc)
    for j, (then, now) in enumerate(zip(knots_then, knots_now)):
        w = weights[j].to(device=out.device, dtype=acc).reshape(-1, *([1] * (out.ndim - 1)))
        out = out + w * (now.detach().to(acc) - then.to(acc))
    return out.to(recorded.dtype)


__all__ = ["serve_first_order"]
