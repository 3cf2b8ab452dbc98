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
outputs as flat tensors of the window's output leaf; ``serve_output`` applies it to every batched
floating leaf of an output; ``serve_window`` serves a whole-loss window's interior steps (the window
runtime holds every call of the window, so its knots run first and nothing is forwarded early).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._compat import tree_flatten, tree_unflatten


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


def serve_output(recorded: Any, then: list, now: list, weights: torch.Tensor, batch: int) -> Any:
    """``serve_first_order`` on each batched floating leaf of an output (the others as recorded)."""
    leaves, spec = tree_flatten(recorded)
    then_leaves = [tree_flatten(t)[0] for t in then]
    now_leaves = [tree_flatten(n)[0] for n in now]
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.ndim >= 1 and leaf.shape[0] == batch:
            leaf = serve_first_order(leaf, [t[i] for t in then_leaves], [n[i] for n in now_leaves], weights)
        out.append(leaf)
    return tree_unflatten(out, spec)


def serve_window(cache, calls: Sequence, knots: Sequence[int], interior: Sequence[int], phi: torch.Tensor,
                 knots_now: Sequence[Any], batch: int) -> dict[int, Any] | None:
    """A whole-loss window's interior outputs served first-order, keyed by window position: the recorded
    rows of every knot and interior call (one host read for all of them) and the knots' current outputs
    ``knots_now`` (one per knot, detached); None where any row was not recorded (the forwards run)."""
    positions = list(knots) + list(interior)
    pending = [cache.stale_prepare(calls[p]) for p in positions]
    if any(x is None for x in pending):
        return None
    rows = torch.cat([x.rows.to(pending[0].rows.device) for x in pending]).tolist()
    if any(r < 0 for r in rows):
        return None
    recorded = {p: x.table.output(rows[i * batch:(i + 1) * batch]) for i, (p, x) in enumerate(zip(positions, pending))}
    then = [recorded[k] for k in knots]
    return {p: serve_output(recorded[p], then, list(knots_now), phi[p], batch) for p in interior}


__all__ = ["serve_first_order", "serve_output", "serve_window"]
