"""Off-policy serving (runtime/first_order.py) as properties: where the first-order formula is exact.

``first_order_serving`` (exact, float64): with a window's states on the chord, the outputs served after
an arbitrary parameter change δ (the recorded outputs at θ plus the knots' change, interpolated by the
window's t-weights) equal the outputs at θ + δ, and JAGG's gradient at θ + δ, its upstream gradients
taken at the served outputs of a loss nonlinear in them, equals the exact gradient there. On
``LinearAffineField`` (v linear in θ: the formula's first order is the whole change) and on
``AffineJacobianField`` (v nonlinear in θ, but its θ-dependent part affine in (z, t) for every θ, JAGG's
exactness class E1): there v_k(θ) − φ(z_k, t_k) interpolates the knots' for every θ, so the change
does too, whatever δ's size. The second-order term the formula leaves out is zero on the whole class.

``first_order_serving_curved`` (counterexample): on ``CurvedField`` (an MLP in (z, t)) the served outputs
miss the true ones beyond ``TOL`` for some δ: hypothesis finds such a case and shrinks it.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from ..runtime import Basis, run_exact, run_window
from ..runtime.first_order import serve_first_order
from .fields import AffineJacobianField, CurvedField, LinearAffineField
from .harness import (DT, PropertyResult, _calls, _chord, _gen, _grad_of, _window_times, rel_err,
                      run_counterexample_property, run_exact_property)


@st.composite
def _serving_case(draw):
    return dict(W=draw(st.integers(3, 8)), B=draw(st.integers(1, 3)), D=draw(st.integers(1, 4)),
                per_sample=draw(st.booleans()), step=draw(st.sampled_from([1e-3, 1e-1, 1.0, 10.0])),
                field=draw(st.sampled_from(["linear", "affine_jacobian"])), s=draw(st.integers(0, 2**16)))


@st.composite
def _curved_case(draw):
    return dict(W=draw(st.integers(3, 8)), B=draw(st.integers(1, 3)), D=draw(st.integers(1, 4)),
                per_sample=draw(st.booleans()), step=draw(st.sampled_from([1e-3, 1e-1, 1.0])),
                s=draw(st.integers(0, 2**16)))


def _outputs(field, calls) -> list[torch.Tensor]:
    with torch.no_grad():
        return [field(*c.args) for c in calls]


def _served(field, calls, times, move) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(served, true) outputs of every step after ``move(field)`` changed its parameters."""
    weights = Basis("linear", "t").matrix(times)                 # (W, 2, B): the window's t-weights
    recorded = _outputs(field, calls)
    move(field)
    true = _outputs(field, calls)
    knots = (0, len(calls) - 1)
    then, now = [recorded[k] for k in knots], [true[k] for k in knots]
    served = [serve_first_order(recorded[k], then, now, weights[k]) for k in range(len(calls))]
    return served, true


def _moved_by(gen: torch.Generator, step: float):
    def move(field):
        with torch.no_grad():
            for p in field.parameters():
                p.add_(step * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return move


def _check_serving(case, seed) -> float:
    W, B, D = case["W"], case["B"], case["D"]
    gen = _gen(21, case["s"], seed)
    kind = LinearAffineField if case["field"] == "linear" else AffineJacobianField
    field = kind(D, seed=(case["s"] + seed) % 997)
    times = _window_times(gen, W, B, case["per_sample"])
    calls = _calls(_chord(gen, times, D), times)
    served, true = _served(field, calls, times, _moved_by(gen, case["step"]))
    err = max(rel_err(s, t) for s, t in zip(served, true))
    # the training signal: upstream gradients of a loss nonlinear in the outputs, taken at the served
    # outputs, through JAGG at θ + δ, against the exact gradient with the true outputs' upstream
    target = torch.randn(W, B, D, generator=gen, dtype=DT)
    upstream = lambda outs: [torch.tanh(o - y) for o, y in zip(outs, target)]  # noqa: E731  d/dv of Σ logcosh
    jagg = _grad_of(field, lambda: run_window(field, calls), upstream(served))
    exact = _grad_of(field, lambda: run_exact(field, calls), upstream(true))
    if exact.norm() == 0:
        raise AssertionError("degenerate example: exact gradient is zero")
    return max(err, rel_err(jagg, exact))


def first_order_serving(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("first_order_serving", _serving_case(), _check_serving, examples, seed)


def _check_serving_curved(case, seed) -> float:
    W, B, D = case["W"], case["B"], case["D"]
    gen = _gen(22, case["s"], seed)
    field = CurvedField(D, seed=(case["s"] + seed) % 997)
    times = _window_times(gen, W, B, case["per_sample"])
    calls = _calls(_chord(gen, times, D), times)
    served, true = _served(field, calls, times, _moved_by(gen, case["step"]))
    return max(rel_err(s, t) for s, t in zip(served, true))


def first_order_serving_curved(examples: int, seed: int = 0) -> PropertyResult:
    return run_counterexample_property("first_order_serving_curved", _curved_case(), _check_serving_curved,
                                       examples, seed)


PROPERTIES = {"first_order_serving": first_order_serving, "first_order_serving_curved": first_order_serving_curved}

__all__ = ["PROPERTIES", "first_order_serving", "first_order_serving_curved"]
