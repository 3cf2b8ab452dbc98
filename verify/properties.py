"""Property checks of the JAGG runtime and compiler, usable by the tests and by ``jaggc verify``.

Each property is a function ``run(examples, seed) -> PropertyResult`` built on hypothesis and run
programmatically (derandomized, no example database, no deadline; ``seed`` is mixed into every
torch generator, so a (examples, seed) pair is reproducible).

Exact properties (float64; pass iff every example has relative error <= ``TOL``; on a violation
hypothesis shrinks the failing example and it is reported as the counterexample):
  * ``e1_run_window``       E1: J affine in (z, t), states on the chord: JAGG == exact gradient;
  * ``e1_compiled``         the same through ``@jagg_compile(window=W, capture="fx")`` with a
                            Python-int step count (one or two windows);
  * ``e2_time_affine``      E2: J free of z, affine in t: t-weighted JAGG exact for any states;
  * ``window2_identity``    W = 2 (``run_window``, ``jagg_calls(window=2)`` and the batched
                            ``KnotAggregate`` path with identity weights) == exact, any field;
  * ``upstream_linearity``  the JAGG gradient is linear in the upstream gradients g_k;
  * ``aggregate_adjoint``   ⟨F(u), w⟩ == ⟨u, B(w)⟩: the backward of ``KnotAggregate``
                            (w = (g_s) ↦ Γ_j = Σ_s Φ[s, j] g_s) is the adjoint of the
                            interpolation u ↦ (Σ_j Φ[s, j] u_j)_s, for every basis;
  * ``forward_values``      the outputs of ``run_window`` equal the per-step outputs.
Counterexample properties (pass iff hypothesis FINDS an example with relative error > ``TOL``;
the example is shrunk to a minimal one):
  * ``off_chord_affine``    AffineJacobianField with interior states moved off the chord;
  * ``curved_field``        CurvedField (J nonlinear in z and t), states on the chord;
  * ``index_weights_grid``  TimeAffineField with index weights on a shift-s grid.

The harness (results, runners, numerics) is :mod:`jaggc.verify.harness`; ``check_model`` on real
DiT trajectories is :mod:`jaggc.verify.model_check`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from hypothesis import strategies as st

from ..runtime import (Basis, KnotAggregate, WindowOptions, concat_calls, hat_matrix, jagg_calls, run_exact,
                       run_window)
from .fields import AffineJacobianField, CurvedField, TimeAffineField
from .harness import (DT, TOL, PropertyResult, _calls, _chord, _gen, _grad_of, _upstream, _window_times, rel_err, shift_sigmas, run_counterexample_property, run_exact_property)

__all__ = ["PROPERTIES", "PropertyResult", "TOL", "run_all"]


# ----------------------------------------------------------------------------- exact properties

@st.composite
def _window_case(draw, wmin: int = 3, wmax: int = 8):
    return dict(W=draw(st.integers(wmin, wmax)), B=draw(st.integers(1, 3)), D=draw(st.integers(1, 4)),
                per_sample=draw(st.booleans()), s=draw(st.integers(0, 2**16)))


def _check_e1_run_window(case, seed) -> float:
    gen = _gen(1, case["s"], seed)
    field = AffineJacobianField(case["D"], seed=(case["s"] + seed) % 997)
    times = _window_times(gen, case["W"], case["B"], case["per_sample"])
    calls = _calls(_chord(gen, times, case["D"]), times)
    gs = _upstream(gen, case["W"], case["B"], case["D"])
    exact = _grad_of(field, lambda: run_exact(field, calls), gs)
    jagg = _grad_of(field, lambda: run_window(field, calls), gs)
    if exact.norm() == 0:
        raise AssertionError("degenerate example: exact gradient is zero")
    return rel_err(jagg, exact)


def e1_run_window(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("e1_run_window", _window_case(2, 8), _check_e1_run_window, examples, seed)


_COMPILED: dict[int, Any] = {}


def _compiled_loss(window: int):
    if window not in _COMPILED:
        from ..api import jagg_compile

        @jagg_compile(window=window, weights="t", capture="fx")
        def loss(field, z, t, g, n: int):
            total = 0
            for k in range(n):
                v = field(z[k], t[k])
                total = total + (v * g[k]).sum()
            return total

        _COMPILED[window] = loss
    return _COMPILED[window]


@st.composite
def _compiled_case(draw):
    case = draw(_window_case(2, 6))
    case["windows"] = draw(st.integers(1, 2))
    return case


def _check_e1_compiled(case, seed) -> float:
    W, B, D, nw = case["W"], case["B"], case["D"], case["windows"]
    gen = _gen(2, case["s"], seed)
    field = AffineJacobianField(D, seed=(case["s"] + seed) % 997)
    n = W * nw
    # one shift-3 grid slice for the whole trajectory; each window's states on its own chord
    times = _window_times(gen, n, B, case["per_sample"])
    z = torch.cat([_chord(gen, times[w * W:(w + 1) * W], D) for w in range(nw)], 0)
    g = torch.stack(_upstream(gen, n, B, D))
    loss = _compiled_loss(W)
    for p in field.parameters():
        p.grad = None
    value = loss(field, z, times, g, n)
    jagg = torch.autograd.grad(value, list(field.parameters()))
    ref_value = sum((field(z[k], times[k]) * g[k]).sum() for k in range(n))
    exact = torch.autograd.grad(ref_value, list(field.parameters()))
    flat = lambda gs: torch.cat([x.reshape(-1) for x in gs])  # noqa: E731
    report = loss.report
    if report is None or report.path != "fx" or not report.windows:
        raise AssertionError(f"the loss was not compiled through fx: {report}")
    return max(rel_err(flat(jagg), flat(exact)), rel_err(value, ref_value))


def e1_compiled(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("e1_compiled", _compiled_case(), _check_e1_compiled, examples, seed)


def _check_e2(case, seed) -> float:
    gen = _gen(3, case["s"], seed)
    field = TimeAffineField(case["D"], seed=(case["s"] + seed) % 997)
    times = _window_times(gen, case["W"], case["B"], case["per_sample"])
    states = torch.randn(case["W"], case["B"], case["D"], generator=gen, dtype=DT)
    calls = _calls(states, times)
    gs = _upstream(gen, case["W"], case["B"], case["D"])
    exact = _grad_of(field, lambda: run_exact(field, calls), gs)
    jagg = _grad_of(field, lambda: run_window(field, calls, options=WindowOptions(weights="t")), gs)
    return rel_err(jagg, exact)


def e2_time_affine(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("e2_time_affine", _window_case(3, 8), _check_e2, examples, seed)


@st.composite
def _w2_case(draw):
    return dict(n=draw(st.integers(2, 6)), B=draw(st.integers(1, 3)), D=draw(st.integers(1, 4)),
                s=draw(st.integers(0, 2**16)))


def _check_window2(case, seed) -> float:
    n, B, D = case["n"], case["B"], case["D"]
    gen = _gen(4, case["s"], seed)
    field = CurvedField(D, seed=(case["s"] + seed) % 997)
    times = _window_times(gen, n, B, True)
    calls = _calls(torch.randn(n, B, D, generator=gen, dtype=DT), times)
    gs = _upstream(gen, n, B, D)
    exact_all = _grad_of(field, lambda: run_exact(field, calls), gs)
    errs = [rel_err(_grad_of(field, lambda: jagg_calls(field, calls, window=2), gs), exact_all)]
    pair, gpair = calls[:2], gs[:2]
    exact2 = _grad_of(field, lambda: run_exact(field, pair), gpair)
    errs.append(rel_err(_grad_of(field, lambda: run_window(field, pair), gpair), exact2))

    def via_aggregate():  # the batched knot forward + KnotAggregate, which run_window skips at W=2
        out = concat_calls(pair, 1)(field)
        phi = hat_matrix(torch.stack([c.args[1] for c in pair]), (0, 1))
        return list(KnotAggregate.apply(phi, out, (0, 1), None, None))
    errs.append(rel_err(_grad_of(field, via_aggregate, gpair), exact2))
    return max(errs)


def window2_identity(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("window2_identity", _w2_case(), _check_window2, examples, seed)


@st.composite
def _linearity_case(draw):
    case = draw(_window_case(3, 8))
    case["a"] = draw(st.floats(-3, 3, allow_nan=False))
    case["b"] = draw(st.floats(-3, 3, allow_nan=False))
    return case


def _check_linearity(case, seed) -> float:
    W, B, D = case["W"], case["B"], case["D"]
    gen = _gen(5, case["s"], seed)
    field = CurvedField(D, seed=(case["s"] + seed) % 997)
    times = _window_times(gen, W, B, case["per_sample"])
    calls = _calls(torch.randn(W, B, D, generator=gen, dtype=DT), times)
    g1, g2 = _upstream(gen, W, B, D), _upstream(gen, W, B, D)
    a, b = case["a"], case["b"]
    run = lambda: run_window(field, calls)  # noqa: E731
    lhs = _grad_of(field, run, [a * x + b * y for x, y in zip(g1, g2)])
    rhs = a * _grad_of(field, run, g1) + b * _grad_of(field, run, g2)
    scale = max(float(rhs.norm()), float(lhs.norm()), 1e-300)
    return float((lhs - rhs).norm()) / scale if scale > 1e-12 else float((lhs - rhs).norm())


def upstream_linearity(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("upstream_linearity", _linearity_case(), _check_linearity, examples, seed)


@st.composite
def _adjoint_case(draw):
    return dict(S=draw(st.integers(2, 8)), B=draw(st.integers(1, 3)), D=draw(st.integers(1, 4)),
                kind=draw(st.sampled_from(["linear", "lagrange", "constant"])),
                by=draw(st.sampled_from(["t", "index"])), s=draw(st.integers(0, 2**16)))


def _check_adjoint(case, seed) -> float:
    S, B, D = case["S"], case["B"], case["D"]
    gen = _gen(6, case["s"], seed)
    # strictly decreasing, non-uniform per-sample times
    times = torch.cumsum(0.05 + torch.rand(S, B, generator=gen, dtype=DT), 0).flip(0)
    basis = Basis(case["kind"], case["by"])
    knots = basis.knot_positions(S)
    phi = basis.matrix(times)  # (S, K, B)
    K = len(knots)
    u = torch.randn(K * B, D, generator=gen, dtype=DT, requires_grad=True)
    interior = [None if s in knots else torch.randn(B, D, generator=gen, dtype=DT) for s in range(S)]
    outs = KnotAggregate.apply(phi, u, tuple(knots), *interior)
    w = [torch.randn(B, D, generator=gen, dtype=DT) for _ in range(S)]
    (gamma,) = torch.autograd.grad(outs, u, grad_outputs=w)  # backward map B(w)
    uj = u.detach().reshape(K, B, D)
    forward_map = torch.einsum("skb,kbd->sbd", phi, uj)  # F(u)_s = Σ_j Φ[s, j] u_j
    lhs = float((forward_map * torch.stack(w)).sum())
    rhs = float((u.detach() * gamma).sum())
    # and the knot rows of Φ are unit vectors: the knot steps' own gradient is exact
    knot_rows = max(float((phi[s] - torch.eye(K, dtype=DT)[j][:, None]).abs().max()) for j, s in enumerate(knots)) \
        if case["kind"] != "constant" else 0.0
    return max(abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300), knot_rows)


def aggregate_adjoint(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("aggregate_adjoint", _adjoint_case(), _check_adjoint, examples, seed)


@st.composite
def _forward_case(draw):
    case = draw(_window_case(2, 8))
    case["chunk"] = draw(st.one_of(st.none(), st.integers(1, 8)))
    case["batch_knots"] = draw(st.booleans())
    case["curved"] = draw(st.booleans())
    return case


def _check_forward(case, seed) -> float:
    W, B, D = case["W"], case["B"], case["D"]
    gen = _gen(7, case["s"], seed)
    cls = CurvedField if case["curved"] else AffineJacobianField
    field = cls(D, seed=(case["s"] + seed) % 997)
    times = _window_times(gen, W, B, case["per_sample"])
    calls = _calls(torch.randn(W, B, D, generator=gen, dtype=DT), times)
    opts = WindowOptions(interior_chunk=case["chunk"], batch_knots=case["batch_knots"])
    got = run_window(field, calls, options=opts)
    want = run_exact(field, calls)
    return max(rel_err(a, b) for a, b in zip(got, want))


def forward_values(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("forward_values", _forward_case(), _check_forward, examples, seed)


# ----------------------------------------------------------------------------- counterexample properties

def _window_rel_err(field, calls, gs) -> float:
    """Relative error of one JAGG window's gradient against the exact per-step one."""
    exact = _grad_of(field, lambda: run_exact(field, calls), gs)
    return rel_err(_grad_of(field, lambda: run_window(field, calls), gs), exact)


@st.composite
def _off_chord_case(draw):
    W, D = draw(st.integers(3, 6)), draw(st.integers(1, 3))
    delta = draw(st.lists(st.lists(st.integers(-2, 2), min_size=D, max_size=D), min_size=W - 2, max_size=W - 2))
    return dict(W=W, D=D, s=draw(st.integers(0, 1000)), delta=delta)


def _check_off_chord(case, seed) -> float:
    W, D = case["W"], case["D"]
    gen = _gen(8, case["s"], seed)
    field = AffineJacobianField(D, seed=(case["s"] + seed) % 997)
    times = shift_sigmas(16)[4:4 + W, None]
    z = _chord(gen, times, D)
    z[1:-1, 0] += torch.tensor(case["delta"], dtype=DT).reshape(W - 2, D)
    calls = _calls(z, times)
    gs = _upstream(gen, W, 1, D)
    return _window_rel_err(field, calls, gs)


def off_chord_affine(examples: int, seed: int = 0) -> PropertyResult:
    return run_counterexample_property("off_chord_affine", _off_chord_case(), _check_off_chord, examples, seed)


@st.composite
def _curved_case(draw):
    return dict(W=draw(st.integers(3, 6)), D=draw(st.integers(1, 3)), s=draw(st.integers(0, 1000)))


def _check_curved(case, seed) -> float:
    W, D = case["W"], case["D"]
    gen = _gen(9, case["s"], seed)
    field = CurvedField(D, seed=(case["s"] + seed) % 997)
    times = shift_sigmas(16)[4:4 + W, None]
    calls = _calls(_chord(gen, times, D), times)
    return _window_rel_err(field, calls, _upstream(gen, W, 1, D))


def curved_field(examples: int, seed: int = 0) -> PropertyResult:
    return run_counterexample_property("curved_field", _curved_case(), _check_curved, examples, seed)


@st.composite
def _grid_case(draw):
    W = draw(st.integers(3, 6))
    n = draw(st.integers(W - 1, 24))
    return dict(W=W, grid_steps=n, start=draw(st.integers(0, n + 1 - W)), shift=draw(st.integers(1, 5)),
                D=draw(st.integers(1, 3)), s=draw(st.integers(0, 1000)))


def _check_grid(case, seed) -> float:
    W, D = case["W"], case["D"]
    gen = _gen(10, case["s"], seed)
    field = TimeAffineField(D, seed=(case["s"] + seed) % 997)
    times = shift_sigmas(case["grid_steps"], float(case["shift"]))[case["start"]:case["start"] + W, None]
    calls = _calls(torch.randn(W, 1, D, generator=gen, dtype=DT), times)
    gs = _upstream(gen, W, 1, D)
    exact = _grad_of(field, lambda: run_exact(field, calls), gs)
    by_index = _grad_of(field, lambda: run_window(field, calls, options=WindowOptions(weights="index")), gs)
    return rel_err(by_index, exact)


def index_weights_grid(examples: int, seed: int = 0) -> PropertyResult:
    return run_counterexample_property("index_weights_grid", _grid_case(), _check_grid, examples, seed)


PROPERTIES: dict[str, Callable[[int, int], PropertyResult]] = {
    "e1_run_window": e1_run_window,
    "e1_compiled": e1_compiled,
    "e2_time_affine": e2_time_affine,
    "window2_identity": window2_identity,
    "upstream_linearity": upstream_linearity,
    "aggregate_adjoint": aggregate_adjoint,
    "forward_values": forward_values,
    "off_chord_affine": off_chord_affine,
    "curved_field": curved_field,
    "index_weights_grid": index_weights_grid,
}


def run_all(examples: int, seed: int = 0) -> list[PropertyResult]:
    return [fn(examples, seed) for fn in PROPERTIES.values()]
