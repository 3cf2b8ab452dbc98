"""The no-tracing intercept fallback (frontends/intercept.py): for loss code no frontend captures,
the loss runs twice with the DiT argument swapped for a recording proxy. Same JAGG gradient as the
runtime, one joint backward per window, refusals that name the step."""

from __future__ import annotations

import pytest
import torch

import jaggc
from helpers import grads, rel_err, zero_grads
from jaggc import JaggGraphError, JaggUnsupportedError, jagg_compile
from jaggc.runtime import DitCall, count_dit_passes, jagg_calls
from jaggc.verify.fields import AffineJacobianField

T, B = 7, 2


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.2, T, dtype=torch.float64)
    ts = torch.stack([t, t * 0.9], 1)
    zs = torch.randn(T, B, 3, generator=g, dtype=torch.float64)
    gs = torch.randn(T, B, 3, generator=g, dtype=torch.float64)
    return zs, ts, gs


def data_dependent_loss(dit, zs, ts, g):
    """Python control flow on a loss value: a graph break for Dynamo, a Proxy error for FX."""
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        loss = (v * g[k]).sum()
        if loss.item() > 0:
            loss = loss * 0.5
        total = total + loss
    return total


def test_auto_falls_back_to_intercept_with_the_runtime_gradient():
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs()
    compiled = jagg_compile(data_dependent_loss, window=3, weights="t")
    zero_grads(model)
    with count_dit_passes(model) as counts:
        loss = compiled(model, zs, ts, gs)
        loss.backward()
    got = grads(model).clone()
    assert compiled.report.path == "intercept"
    assert [w.steps for w in compiled.report.windows] == [[0, 1, 2], [3, 4, 5], [6]]
    assert counts.backwards == 3  # two JAGG windows and the 1-step tail

    # the runtime on the same calls with the same per-step upstream gradients (the `if` halves some)
    zero_grads(model)
    with torch.no_grad():
        scale = [0.5 if (dit_v * gk).sum().item() > 0 else 1.0
                 for dit_v, gk in zip([model(zs[k], ts[k]) for k in range(T)], gs)]
    outs = jagg_calls(model, [DitCall((zs[k], ts[k])) for k in range(T)], window=3)
    sum((o * gk * s).sum() for o, gk, s in zip(outs, gs, scale)).backward()
    assert grads(model).norm() > 0
    assert rel_err(got, grads(model)) < 1e-12
    assert torch.allclose(loss, data_dependent_loss(model, zs, ts, gs), rtol=1e-12, atol=0)


def test_intercept_is_exact_on_affine_fields_at_window_2():
    model = AffineJacobianField(3, seed=2)
    zs, ts, gs = inputs(1)
    zero_grads(model)
    data_dependent_loss(model, zs, ts, gs).backward()
    exact = grads(model).clone()
    zero_grads(model)
    jagg_compile(data_dependent_loss, window=2, capture="intercept")(model, zs, ts, gs).backward()
    assert rel_err(grads(model), exact) < 1e-12


def test_intercept_refuses_states_computed_from_dit_outputs():
    def chained(dit, zs, ts, g):
        z, total = zs[0], 0.0
        for k in range(zs.shape[0]):
            v = dit(z, ts[k])
            total = total + (v * g[k]).sum()
            z = z + 0.1 * v  # no detach: step k+1 depends on step k's output
        return total

    model = AffineJacobianField(3, seed=1)
    with pytest.raises(JaggGraphError, match=r"step 1: DiT input\(s\) input 0 require grad.*\.detach\(\)"):
        jagg_compile(chained, window=3, capture="intercept")(model, *inputs())
    assert all(p.grad is None for p in model.parameters())


def test_intercept_refuses_a_nondeterministic_loss():
    def noisy(dit, zs, ts, g):
        total = 0.0
        for k in range(zs.shape[0]):
            v = dit(zs[k] + 1e-3 * torch.randn_like(zs[k]), ts[k])  # sampling inside the loss
            total = total + (v * g[k]).sum()
        return total

    model = AffineJacobianField(3, seed=1)
    with pytest.raises(JaggUnsupportedError, match=r"step 0: the loss called the DiT with different inputs"):
        jagg_compile(noisy, window=3, capture="intercept")(model, *inputs())


def test_intercept_needs_the_dit_as_an_argument():
    model = AffineJacobianField(3, seed=1)

    def closed_over(zs, ts, g):
        return sum((model(zs[k], ts[k]) * g[k]).sum() for k in range(zs.shape[0]))

    with pytest.raises(JaggUnsupportedError, match="the DiT must be exactly one argument of the loss"):
        jagg_compile(closed_over, dit=model, window=3, capture="intercept")(*inputs())


def test_intercept_passes_no_grad_reference_calls_through():
    ref_calls = []

    def with_reference(dit, zs, ts, g):
        total = 0.0
        for k in range(zs.shape[0]):
            v = dit(zs[k], ts[k])
            with torch.no_grad():
                ref_calls.append(dit(zs[k], ts[k]))
            total = total + ((v - ref_calls[-1]) * g[k]).sum()
        return total

    model = AffineJacobianField(3, seed=1)
    compiled = jagg_compile(with_reference, window=3, capture="intercept")
    zero_grads(model)
    compiled(model, *inputs()).backward()
    assert len(ref_calls) == 2 * T  # the loss ran twice, each time with its T reference calls
    assert not any(r.requires_grad for r in ref_calls)
    assert grads(model).norm() > 0
    assert compiled.report.path == "intercept" and len(compiled.report.windows) == 3
    assert isinstance(compiled.report, jaggc.Report)
