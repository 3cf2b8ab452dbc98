"""Routing (runtime/routing.py, jagg_compile(routing=Routing(jagg_frac=, threshold=, exact_below=))): windows
scored from their velocities, the chosen ones run JAGG, the rest exact; decisions in the report."""

from __future__ import annotations

import pytest
import torch

import jaggc
from helpers import grad_of, grads, linear_loss, rel_err, zero_grads
from jaggc import models
from jaggc.runtime import DitCall, WindowOptions, count_dit_passes, jagg_calls
from jaggc.runtime.routing import Routing, choose_jagg_windows, run_routed, window_score
from jaggc.runtime.window import partition, prepare_window
from jaggc.verify.fields import AffineJacobianField, CurvedField, LinearThetaZ

T, B = 12, 2


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def sd3_64():
    return models.sd3("tiny", seed=0).double()


def sd3_calls(model, steps=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    cond = {k: v.double() for k, v in models.sd3_conditioning(model, B, seed=seed).kwargs.items()}
    shape = models.sd3_latent_shape(model, B)
    calls = [DitCall((), dict(hidden_states=torch.randn(shape, generator=g).double(),
                              timestep=torch.full((B,), 950.0 - 80 * k, dtype=torch.float64),
                              return_dict=False, **cond)) for k in range(steps)]
    return calls, [torch.randn(shape, generator=g).double() for _ in range(steps)]


def first(outs):
    return [o[0] for o in outs]


def test_score_is_one_on_a_velocity_linear_window():
    """States on the chord of v = θz: velocities are exactly t-interpolated, score 1; a curved field
    scores lower. (AffineJacobianField's θ-free cos(z)·t term would lower the score although JAGG is
    exact there: the score is a proxy, which is why jaggc.calibrate exists.)"""
    z0, z1 = torch.randn(B, 3, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    t = torch.tensor([0.9, 0.7, 0.45, 0.2], dtype=torch.float64)
    alpha = (t - t[0]) / (t[-1] - t[0])
    calls = [DitCall(((1 - a) * z0 + a * z1, s.expand(B))) for a, s in zip(alpha, t)]
    linear = window_score(prepare_window(LinearThetaZ(0.7), calls, range(4), WindowOptions()))
    curved = window_score(prepare_window(CurvedField(3, seed=1), calls, range(4), WindowOptions()))
    assert linear == pytest.approx(1.0, abs=1e-9)
    assert curved < 0.999


def test_choose_jagg_windows_rules():
    scores = [0.9, None, 0.2, 0.7, 0.5]
    sigmas = [0.9, 0.8, 0.6, 0.4, 0.1]
    assert choose_jagg_windows(scores, sigmas, Routing(jagg_frac=0.5)) == [True, False, False, True, False]
    assert choose_jagg_windows(scores, sigmas, Routing(threshold=0.6)) == [True, False, False, True, False]
    assert choose_jagg_windows(scores, sigmas, Routing(exact_below=0.5)) == [True, False, True, False, False]
    assert choose_jagg_windows(scores, sigmas, Routing(jagg_frac=0.5, exact_below=0.5)) == [
        True, False, False, False, False]


@pytest.mark.parametrize("routing,n_jagg", [(Routing(jagg_frac=0.34), 1), (Routing(jagg_frac=0.67), 2),
                                            (Routing(exact_below=0.5), 1), (Routing(threshold=-1.0), 3)])
def test_routed_gradient_is_exact_on_exact_windows_and_jagg_on_the_rest(sd3_64, routing, n_jagg):
    calls, gs = sd3_calls(sd3_64)
    windows = partition(T, 4)
    decision = {}

    def routed():
        outs, d = run_routed(sd3_64, [[calls[i] for i in w] for w in windows], windows, WindowOptions(), routing)
        decision["d"] = d
        return [o[0] for w in outs for o in w]

    got = grad_of(sd3_64, routed, gs)
    modes = decision["d"].modes
    assert modes.count("jagg") == n_jagg
    exact_windows = [i for i, m in enumerate(modes) if m == "exact"]
    want = grad_of(sd3_64, lambda: first(jagg_calls(sd3_64, calls, window=4, exact_windows=exact_windows)), gs)
    assert rel_err(got, want) < 1e-12
    # and the fraction form takes the best-scored windows
    if routing.threshold is None and routing.exact_below is None:
        scores = decision["d"].scores
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[:n_jagg]
        assert sorted(best) == [i for i, m in enumerate(modes) if m == "jagg"]


def test_routed_exact_window_counts(sd3_64):
    calls, gs = sd3_calls(sd3_64)
    zero_grads(sd3_64)
    with count_dit_passes(sd3_64) as counts:
        linear_loss(first(jagg_calls(sd3_64, calls, window=4, routing=Routing(jagg_frac=0.0, threshold=1.0))),
                    gs).backward()
    # every window: knot forward with grad, interior no-grad forward (scoring), interior grad forward
    assert counts.nograd_forward_batches == [2 * B] * 3
    assert counts.grad_forward_batches == [2 * B, 2 * B] * 3
    assert counts.backwards == 6
    zero_grads(sd3_64)


def test_compiled_routing_matches_runtime_and_reports_decisions():
    model = AffineJacobianField(3, seed=1)
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    zs = torch.randn(T, B, 3, generator=g, dtype=torch.float64)
    ts = torch.stack([t, 0.95 * t], 1)
    gs = torch.randn(T, B, 3, generator=g, dtype=torch.float64)

    def loss_fn(dit, zs, ts, gs):
        return sum((dit(zs[k], ts[k]) * gs[k]).sum() for k in range(zs.shape[0]))

    compiled = jaggc.jagg_compile(loss_fn, window=4, weights="t", routing=jaggc.Routing(jagg_frac=0.5, exact_below=0.3))
    zero_grads(model)
    compiled(model, zs, ts, gs).backward()
    got = grads(model).clone()
    rows = compiled.report.windows
    assert all(r.mode.startswith("routed:") for r in rows)
    assert rows[-1].mode == "routed:exact"  # reaches t < 0.3
    jagg_rows = [r.window for r in rows if r.mode == "routed:jagg"]
    assert len(jagg_rows) == 1  # floor(0.5 * 2 eligible)
    assert "score" in compiled.report.table()
    want = grad_of(model, lambda: jagg_calls(model, [DitCall((zs[k], ts[k])) for k in range(T)], window=4,
                                             exact_windows=[r.window for r in rows if r.mode == "routed:exact"]),
                   list(gs))
    assert rel_err(got, want) < 1e-12


def test_routing_refuses_per_window_mode():
    with pytest.raises(jaggc.JaggUnsupportedError, match="needs backward='joint'"):
        jaggc.jagg_compile(lambda dit, x: dit(x), backward="per_window", routing=jaggc.Routing(jagg_frac=0.5))
    with pytest.raises(jaggc.JaggInputError, match=r"Routing\(threshold=2\)"):
        jaggc.jagg_compile(lambda dit, x: dit(x), routing=jaggc.Routing(threshold=2))
