"""Random state in ``jaggc.stepwise``'s re-runs (issue 52): a knot whose graph is not held
(``backward="per_window"``) re-runs in its window's backward, and must draw the dropout masks its call
drew: whether the DiT draws through an ``nn.Dropout`` module, ``F.dropout`` in its forward or attention's
``dropout_p``. Knots that would re-run as one batched call run one by one with their own RNG state when
their calls drew random numbers.

Checked in float64 against a hand computation with the same masks (tests/dropout_dits.py): ``.grad`` is
Σ_j J_{k_j}ᵀ Γ_j with each knot's Jacobian at the masks of the call that made the value the loop saw, and
the guard's exact gradient is Σ_s J_sᵀ g_s with every step's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import jaggc
from dropout_dits import DropoutDiT, Recorder, flat_grad, hand_gradient, jagg_cotangents, rel, trajectory

KINDS = ["module", "functional", "sdpa"]
T, W = 8, 4


def _loop(rec, jagg, zs, ts, gs):
    """One trajectory, one DiT call and one backward per step; the values the loop saw."""
    values = []
    for k in jagg.steps(range(T), ts.T):
        out = rec(hidden_states=zs[k], timestep=ts[k])
        values.append(out.detach().clone())
        (out * gs[k]).sum().backward()
    return values


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_knots", [True, False])
def test_per_window_knot_reruns_use_the_calls_masks(kind, batch_knots):
    torch.manual_seed(0)
    rec = Recorder(DropoutDiT(kind)).train()
    zs, ts, gs = trajectory(T)
    jagg = jaggc.stepwise(rec, window=W, weights="t", backward="per_window",
                          options=jaggc.Options(batch_knots=batch_knots))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            rec.zero_grad(set_to_none=True)
            rec.log.clear()
            values = _loop(rec, jagg, zs, ts, gs)
            want = hand_gradient(rec, values, jagg_cotangents(gs, ts, W))
            assert jagg.counts.reruns > 0
            assert rel(flat_grad(rec), want) < 1e-12
    jagg.close()


@pytest.mark.parametrize("kind", KINDS)
def test_guard_probe_of_a_per_window_trajectory_uses_the_calls_masks(kind):
    torch.manual_seed(1)
    rec = Recorder(DropoutDiT(kind)).train()
    zs, ts, gs = trajectory(T, seed=3)
    results = []
    jagg = jaggc.stepwise(rec, window=W, weights="t", backward="per_window",
                          guard=jaggc.Guard(every=1, on_probe=results.append))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec.log.clear()
        values = _loop(rec, jagg, zs, ts, gs)
    jagg.close()
    assert len(results) == 1
    exact = hand_gradient(rec, values, gs)
    jagg_grad = hand_gradient(rec, values, jagg_cotangents(gs, ts, W))
    assert rel(jagg_grad, exact) > 1e-3
    assert rel(flat_grad(rec), jagg_grad) < 1e-12
    assert rel(results[0].exact, exact) < 1e-12


@pytest.mark.parametrize("kind", ["functional", "sdpa"])
@pytest.mark.parametrize("backward", ["joint", "per_window"])
def test_cfg_slice_of_a_call_that_draws_runs_the_whole_call(kind, backward):
    """The CFG slice (learned in a first trajectory) runs a call's rows without gradient apart from its
    rows with gradient; a call that draws random numbers (dropout no module shows) would draw other masks
    in each part than a re-run of either could draw again. jaggc sees the draw and runs the whole call
    as one (with grad), unsliced: the gradient is the hand computation's with the whole call's masks.
    (Knots one by one: the slice is what is tested, not the batched knot re-run. Before the fix the
    per-window re-run of a sliced knot's rows drew other masks than its whole no-grad call; the joint
    form's held rows were right, but a re-run of them, lowmem out of order or under DDP/FSDP, was not.)"""
    torch.manual_seed(2)
    rec = Recorder(DropoutDiT(kind)).train()
    zs, ts, gs = trajectory(T, seed=5)
    jagg = jaggc.stepwise(rec, window=W, weights="t", backward=backward, cfg_slice=True,
                          options=jaggc.Options(batch_knots=False))
    scale = 3.0

    def cfg_loop():
        values, cotangents = [], []
        for k in jagg.steps(range(T), ts.T):
            out = rec(hidden_states=torch.cat([zs[k], zs[k]]), timestep=torch.cat([ts[k], ts[k]]))
            values.append(out.detach().clone())
            uncond, cond = out.chunk(2)
            v = uncond.detach() + scale * (cond - uncond.detach())
            cotangents.append(torch.cat([torch.zeros_like(gs[k]), scale * gs[k]]))
            (v * gs[k]).sum().backward()
        return values, cotangents

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for trajectory_index in range(2):
            rec.zero_grad(set_to_none=True)
            rec.log.clear()
            values, cotangents = cfg_loop()
            want = hand_gradient(rec, values, jagg_cotangents(cotangents, torch.cat([ts, ts], 1), W))
            assert rel(flat_grad(rec), want) < 1e-12, trajectory_index
    assert jagg.counts.sliced_steps == 0
    jagg.close()
