"""The FX capture's value reads: tensor values a loss turns into Python values, baked into the
trace and re-checked on every call by a guard (``frontends/value_reads.py``).

  * ``math.sqrt``/``math.log`` of a traced tensor stay graph nodes (torch.fx autowraps ``math``):
    a new value needs no new trace;
  * ``float(x)``, ``x.item()``, ``bool(...)`` and a value-dependent shape (``nonzero``) are reads:
    an unchanged value reuses the graph, a changed one traces another, and the answer is always
    the eager loss's;
  * a Python number computed from a traced tensor that then decides a shape (``x[:, :k]``) is
    read (guarded) too; in arithmetic it is not;
  * reads that cannot be guarded are refused: of a random op, of a tensor written in place;
  * a loss that keeps re-tracing because a read keeps changing is reported once, naming it.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import loss_and_grad, rel_err
from jaggc import JaggCaptureError, jagg_compile
from jaggc.verify.fields import AffineJacobianField

T, B = 4, 2


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.2, T, dtype=torch.float64)
    return (torch.randn(T, B, 3, generator=g, dtype=torch.float64), torch.stack([t, t * 0.9], 1),
            torch.randn(T, B, 3, generator=g, dtype=torch.float64))


def sqrt_loss(dit, zs, ts, g, sigmas):
    total = 0.0
    for k in range(zs.shape[0]):
        std = 0.3 * math.sqrt(sigmas[k] - sigmas[k + 1])      # DanceGRPO's flux_step
        total = total + (dit(zs[k], ts[k]) * g[k]).sum() / (2 * std**2) - math.log(std)
    return total


def float_loss(dit, zs, ts, g, sigmas):
    total = 0.0
    for k in range(zs.shape[0]):
        scale = float(sigmas[k])                  # a read
        if scale > 0.5:                           # a branch on it
            total = total + (dit(zs[k], ts[k]) * g[k]).sum() * scale
        else:
            total = total + (dit(zs[k], ts[k]) * g[k]).sum() * sigmas[k + 1].item()
    return total


def lookup_loss(dit, zs, ts, g, schedule):
    """Flow-GRPO's step lookup: the index of each sample's timestep in the schedule."""
    total = 0.0
    for k in range(zs.shape[0]):
        index = (schedule == ts[k, 0]).nonzero()
        pos = 1 if len(index) > 1 else 0
        i = index[pos].item()
        total = total + (dit(zs[k], ts[k]) * g[k]).sum() * (schedule[i] - schedule[i + 1])
    return total


def shape_loss(dit, zs, ts, g, sigmas):
    total = 0.0
    for k in range(zs.shape[0]):
        keep = math.ceil(sigmas[0] * 3)           # a number from a tensor (a graph node) ...
        part = dit(zs[k], ts[k])[:, :keep]
        total = total + (part * g[k][:, :keep]).sum() / part.shape[1]    # ... that decides a shape read here
    return total


def _check(loss, args, model, compiled):
    eager, eager_grad = loss_and_grad(loss, args, model)
    got, got_grad = loss_and_grad(compiled, args, model)
    torch.testing.assert_close(got, eager, rtol=1e-13, atol=1e-13)
    assert rel_err(got_grad, eager_grad) < 1e-12      # window=2: every step is a knot


def _sigmas(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_math_functions_stay_graph_nodes():
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs()
    compiled = jagg_compile(sqrt_loss, window=2, capture="fx")
    for sigmas in (_sigmas(1.0, 0.8, 0.6, 0.3, 0.1), _sigmas(0.9, 0.7, 0.4, 0.2, 0.05)):
        _check(sqrt_loss, (model, zs, ts, gs, sigmas), model, compiled)
    assert compiled.traces == 1 and compiled.report.guarded_reads == 0
    assert "math_sqrt(" in compiled.report.stage("capture")


@pytest.mark.parametrize("loss, values", [
    (float_loss, [(1.0, 0.8, 0.6, 0.3, 0.1), (1.0, 0.8, 0.6, 0.3, 0.1), (0.4, 0.8, 0.6, 0.3, 0.1)]),
    (shape_loss, [(0.9, 0, 0, 0, 0), (0.8, 0, 0, 0, 0), (0.2, 0, 0, 0, 0)]),
], ids=["float_item_bool", "number_decides_shape"])
def test_reads_are_guarded(loss, values):
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs()
    compiled = jagg_compile(loss, window=2, capture="fx")
    traces = []
    for v in values:
        _check(loss, (model, zs, ts, gs, _sigmas(*v)), model, compiled)
        traces.append(compiled.traces)
    assert compiled.report.guarded_reads > 0
    # the first two values give the same reads (shape_loss: ceil(0.9*3) == ceil(0.8*3)), the third not
    assert traces == [1, 1, 2]


def test_value_dependent_shapes_are_guarded():
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs()
    zero = torch.zeros(1, dtype=torch.float64)
    schedule = torch.cat([ts[:, 0], zero, zero])
    compiled = jagg_compile(lookup_loss, window=2, capture="fx")
    _check(lookup_loss, (model, zs, ts, gs, schedule), model, compiled)
    _check(lookup_loss, (model, zs, ts, gs, schedule), model, compiled)
    assert compiled.traces == 1
    shifted = torch.cat([zero + 2, ts[:, 0], zero])     # same shape, every index moves by one
    _check(lookup_loss, (model, zs, ts, gs, shifted), model, compiled)
    assert compiled.traces == 2
    assert any("re-traced" in n for n in compiled.report.notes)


def random_read_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        if torch.rand(()).item() > 2.0:           # reads a random number
            total = total + 1.0
        total = total + (dit(zs[k], ts[k]) * g[k]).sum()
    return total


def inplace_read_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        t = ts[k].clone()
        t.mul_(2.0)
        total = total + (dit(zs[k], ts[k]) * g[k]).sum() * float(t[0])
    return total


@pytest.mark.parametrize("loss, why", [
    (random_read_loss, r"the loss draws random numbers \(aten::rand\) from values torch.fx does not trace"),
    (inplace_read_loss, r"the loss reads a tensor as a Python value .* that depends on a tensor written in place "
                        r"\(mul_\)")])
def test_unguardable_reads_are_refused(loss, why):
    model = AffineJacobianField(3, seed=1)
    with pytest.raises(JaggCaptureError, match=r"test_value_reads.py:\d+: " + why):
        jagg_compile(loss, window=2, capture="fx")(model, *inputs())
    # capture="auto" still computes it right, on a path that runs the loss's Python
    with pytest.warns(UserWarning, match="runs through capture path"):
        compiled = jagg_compile(loss, window=2)
        got, _ = loss_and_grad(compiled, (model, *inputs()), model)
    torch.testing.assert_close(got, loss(model, *inputs()))


def test_a_loss_that_keeps_retracing_is_reported_once():
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs()
    compiled = jagg_compile(float_loss, window=2, capture="fx")
    with pytest.warns(UserWarning, match=r"float_loss was traced 8 times .* values it reads as Python numbers "
                                         r"changed \(latest: .*test_value_reads.py:\d+: float\(x\) was "):
        for i in range(10):
            compiled(model, zs, ts, gs, _sigmas(0.9 + i * 0.001, 0.8, 0.6, 0.3, 0.1))
    assert compiled.traces == 10
