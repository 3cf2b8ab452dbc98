"""Property checks over real multi-step GRPO losses, run through ``@jagg_compile`` and the runtime.

The losses, rollouts and runners live in :mod:`jaggc.verify.grpo_losses`. The losses are user code as Flow-GRPO / DanceGRPO write it: a Python loop over the trained steps of
a stored rollout (``batch["latents"][:, j]``, ``batch["next_latents"][:, j]``, timesteps, old
log-probs, advantages), one DiT call per step, the step's policy log-probability written out inline,
and the PPO clipped-ratio loss. There is one loss per step policy of :mod:`jaggc.grpo`
(``flow_grpo_sde_step``, ``dance_flux_step``, ``cps_step``); the rollouts that produce the stored
data are sampled with those functions, and the exact properties check that each inline loss equals
the ``jaggc.grpo`` loss on the same data. (``jaggc.grpo``'s step functions validate their inputs
with data-dependent Python, so they cannot be called inside a loss that Dynamo or FX captures.)

The "DiT" is a float64 velocity field of :mod:`jaggc.verify.fields` (smooth, nonlinear in θ) called
as ``field(latents, timestep=sigmas)``. Exact properties (pass iff every example has relative
error <= ``properties.TOL``; a violation is shrunk by hypothesis):

  * ``grpo_exact_<kind>``       E1 through a GRPO loss: J affine in (z, t), each window's states on
                                its chord (shifted, non-uniform, possibly per-sample σ grids; 1–2
                                windows and a shorter tail; PPO-clipped and unclipped samples).
                                The gradient of ``@jagg_compile(capture="fx")``, of
                                ``capture="dynamo"`` and of the runtime (``jagg_calls``) equals the
                                exact gradient, the two frontends agree, the compiled loss value is
                                bit-identical to the eager one (per-step forwards, drawn; to roundoff
                                with batched forwards), the eager loss equals the
                                ``jaggc.grpo`` loss, and the rewrite really ran (one joint DiT
                                backward per window of >= 3 steps, counted with hooks);
  * ``grpo_window2_identity``   W = 2, any field and any states (a curved field on a real SDE
                                rollout, tail of one step): the compiled gradient is exact;
  * ``grpo_advantage_linearity`` the upstream gradients g_k = ∂ℓ/∂v_k of an unclipped GRPO loss are
                                linear in the advantages, so the compiled JAGG gradient (and the
                                loss) must be too: ∇(aA₁ + bA₂) = a∇(A₁) + b∇(A₂), curved field;
  * ``grpo_dot_product``        the dot-product identity of the aggregation, end to end: for any
                                parameter direction δθ, ⟨∇θ L_JAGG, δθ⟩ equals
                                Σ_k ⟨g_k, (1−α_k) J_a δθ + α_k J_b δθ⟩ (forward-mode JVPs at the
                                window's knots, t-weights), on a curved field where JAGG is not
                                exact: the compiled backward is the adjoint of the interpolated
                                tangent model, nothing more and nothing less.

Counterexample properties (pass iff hypothesis FINDS an example with relative error > ``TOL``
through the compiled FX path, and shrinks it):

  * ``grpo_off_chord``          affine-Jacobian field, interior states moved off the chord;
  * ``grpo_curved_field``       curved field (J nonlinear in z and t), states on the chord.

The exact properties draw the capture path (``"fx"`` or ``"dynamo"``) per example, except
``grpo_exact_<kind>`` which runs both; the counterexample searches use FX only, because shrinking
re-traces the loss for every candidate and a Dynamo compile costs several times an FX trace.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from hypothesis import strategies as st
from torch import nn

from .. import grpo
from .fields import AffineJacobianField, CurvedField
from .grpo_losses import (CAPTURES, CLIP_RANGES, LOSSES, Rollout, _params, _require_backwards, _require_nonzero,
                          _seeded, _value_error, clipped_share, compile_loss, compiled, eager, grpo_reference_value,
                          make_rollout, runtime, upstream_grads)
from .harness import DT, PropertyResult, _gen, rel_err, run_counterexample_property, run_exact_property

__all__ = ["LOSSES", "PROPERTIES", "run_all"]


# ----------------------------------------------------------------------------- exact properties

class _Stats:
    """What the examples of one property covered (reported in PropertyResult.detail)."""

    def __init__(self):
        self.seen: Counter = Counter()
        self.clipped: list[float] = []
        self.grad_norms: list[float] = []

    def record_rollout(self, rollout: Rollout) -> None:
        self.seen["JAGG windows of >= 3 steps"] += sum(len(w) >= 3 for w in rollout.windows)
        self.seen["per-sample grids"] += int(not torch.equal(rollout.batch["sigmas"][0], rollout.batch["sigmas"][-1]))
        self.seen["rollouts from sigma = 1"] += int(bool((rollout.batch["sigmas"][:, 0] == 1).any()))

    def detail(self) -> str:
        parts = [", ".join(f"{k}: {v}" for k, v in sorted(self.seen.items()))]
        if self.clipped:
            parts.append(f"PPO-clipped (sample, step) share: mean {sum(self.clipped) / len(self.clipped):.0%}, "
                         f"max {max(self.clipped):.0%}")
        if self.grad_norms:
            parts.append(f"min exact |grad| {min(self.grad_norms):.2e}")
        return "; ".join(p for p in parts if p)


def _exact_with_stats(name: str, strategy, check, examples: int, seed: int) -> PropertyResult:
    """``run_exact_property`` with ``check(case, seed, stats)``; the result's detail says which
    loss kinds and capture paths the examples covered."""
    stats = _Stats()
    result = run_exact_property(name, strategy, lambda case, s: check(case, s, stats), examples, seed)
    result.detail = stats.detail()
    return result


def _draw_batch(draw) -> dict:
    """What every GRPO case draws besides its windows: samples B, latent dim D, the σ grid (shift,
    start index: 0 is σ = 1, extra grid steps; or one random grid per sample), the PPO clip range
    (index into CLIP_RANGES), the ratio spread (in clip ranges: 3 clips some samples) and a seed."""
    return dict(B=draw(st.integers(1, 3)), D=draw(st.integers(1, 3)), per_sample=draw(st.booleans()),
                shift=draw(st.integers(1, 5)), start=draw(st.integers(0, 8)), extra=draw(st.integers(0, 8)),
                clip=draw(st.integers(0, len(CLIP_RANGES) - 1)), spread=draw(st.sampled_from([3.0, 0.5, 0.0])),
                s=draw(st.integers(0, 2**16)))


@st.composite
def _exact_case(draw):
    """One or two windows of W steps and a tail shorter than W; per-step or batched forwards."""
    W = draw(st.integers(2, 5))
    windows, tail = draw(st.integers(1, 2)), draw(st.integers(0, W - 1))
    return dict(W=W, n=W * windows + tail, per_step=draw(st.booleans()), **_draw_batch(draw))


def check_grpo_exact(kind: str, field_cls=AffineJacobianField, stats: _Stats | None = None):
    """The check of ``grpo_exact_<kind>`` (``field_cls`` is a parameter so that the tests can show
    it fails on a field where JAGG is not exact)."""

    def check(case, seed) -> float:
        field = _seeded(field_cls, case, seed)
        rollout = make_rollout(kind, field, case, seed, stream=21, on_chord=True)
        value, exact = eager(rollout, field)
        _require_nonzero(exact, "the exact gradient")
        errs = [rel_err(value, grpo_reference_value(rollout, field))]
        errs.append(rel_err(runtime(rollout, field)[1], exact))
        grads = {}
        per_step = case.get("per_step", False)
        for capture in CAPTURES:
            c_value, grads[capture], backwards = compiled(rollout, field, capture, per_step=per_step)
            errs.append(_value_error(c_value, value, capture, per_step))
            _require_backwards(backwards, rollout, capture, per_step)
            errs.append(rel_err(grads[capture], exact))
        errs.append(rel_err(grads["fx"], grads["dynamo"]))
        if stats is not None:
            stats.record_rollout(rollout)
            stats.seen["per-step forwards (values bit-identical)"] += int(per_step)
            stats.clipped.append(clipped_share(rollout, field))
            stats.grad_norms.append(float(exact.norm()))
        return max(errs)

    return check


def _grpo_exact(kind: str) -> Callable[[int, int], PropertyResult]:
    def run(examples: int, seed: int = 0) -> PropertyResult:
        stats = _Stats()
        result = run_exact_property(f"grpo_exact_{kind}", _exact_case(), check_grpo_exact(kind, stats=stats),
                                    examples, seed)
        result.detail = stats.detail()
        return result

    run.__name__ = f"grpo_exact_{kind}"
    return run


@st.composite
def _rollout_case(draw, wmin: int = 2, wmax: int = 5, n_extra: int = 4):
    """Step policy, capture path, W and n >= W steps (windows of W and a tail), and the batch."""
    W = draw(st.integers(wmin, wmax))
    return dict(W=W, kind=draw(st.sampled_from(grpo.STEP_KINDS)), capture=draw(st.sampled_from(CAPTURES)),
                n=draw(st.integers(W, W + n_extra)), **_draw_batch(draw))


def _check_window2(case, seed, stats: _Stats) -> float:
    field = _seeded(CurvedField, case, seed)
    rollout = make_rollout(case["kind"], field, case, seed, stream=22, on_chord=False)
    value, exact = eager(rollout, field)
    _require_nonzero(exact, "the exact gradient")
    c_value, grad, backwards = compiled(rollout, field, case["capture"])
    _require_backwards(backwards, rollout, case["capture"])
    stats.seen.update([case["kind"], case["capture"]])
    return max(rel_err(grad, exact), _value_error(c_value, value, case["capture"], False))


def grpo_window2_identity(examples: int, seed: int = 0) -> PropertyResult:
    return _exact_with_stats("grpo_window2_identity", _rollout_case(2, 2, 5), _check_window2, examples, seed)


@st.composite
def _linearity_case(draw):
    case = draw(_rollout_case(3, 5))
    # |a A₁ + b A₂| <= 4 stays inside the advantage clamp (±5) and |u| < 1 keeps every ratio
    # strictly inside the clip range: the loss is then exactly linear in the advantages
    case.update(spread=draw(st.sampled_from([0.0, 0.9])), adv_scale=1.0,
                a=draw(st.floats(-2, 2, allow_nan=False)), b=draw(st.floats(-2, 2, allow_nan=False)))
    return case


def _with_advantages(rollout: Rollout, advantages: torch.Tensor) -> Rollout:
    return Rollout(rollout.kind, dict(rollout.batch, advantages=advantages), rollout.num_steps, rollout.window)


def _check_linearity(case, seed, stats: _Stats) -> float:
    field = _seeded(CurvedField, case, seed)
    rollout = make_rollout(case["kind"], field, case, seed, stream=23, on_chord=False)
    gen = _gen(24, case["s"], seed)
    B, n = case["B"], rollout.num_steps
    adv1, adv2 = ((2 * torch.rand(B, 1, generator=gen, dtype=DT) - 1).expand(B, n).clone() for _ in range(2))
    a, b, capture = case["a"], case["b"], case["capture"]
    loss = compile_loss(rollout, capture)  # one trace: only tensor values change below
    v1, g1, _ = compiled(_with_advantages(rollout, adv1), field, capture, loss)
    v2, g2, _ = compiled(_with_advantages(rollout, adv2), field, capture, loss)
    v12, g12, _ = compiled(_with_advantages(rollout, a * adv1 + b * adv2), field, capture, loss)
    _require_nonzero(g1, "the gradient for A₁")
    _require_nonzero(g2, "the gradient for A₂")
    stats.seen.update([case["kind"], case["capture"]])

    def err(lhs, rhs):
        scale = max(float(lhs.norm()), float(rhs.norm()))
        return float((lhs - rhs).norm()) / scale if scale > 1e-12 else float((lhs - rhs).norm())
    return max(err(g12, a * g1 + b * g2), err(v12, a * v1 + b * v2))


def grpo_advantage_linearity(examples: int, seed: int = 0) -> PropertyResult:
    return _exact_with_stats("grpo_advantage_linearity", _linearity_case(), _check_linearity, examples, seed)


def _knot_jvps(field: nn.Module, rollout: Rollout, tangent: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """J_k δθ at every knot step k (forward mode, through torch.func)."""
    from torch.func import functional_call, jvp

    names = [name for name, _ in field.named_parameters()]
    primals = tuple(p.detach() for p in _params(field))
    b = rollout.batch
    knots = sorted({k for w in rollout.windows for k in (w[0], w[-1])})

    def at(k):
        def f(*params):
            return functional_call(field, dict(zip(names, params)), (b["latents"][:, k],),
                                   {"timestep": b["timesteps"][:, k]})
        return jvp(f, primals, tuple(tangent))[1]
    return {k: at(k) for k in knots}


def jagg_directional_derivative(rollout: Rollout, field: nn.Module, tangent: list[torch.Tensor]) -> float:
    """Σ_k ⟨g_k, (1 − α_k) J_a δθ + α_k J_b δθ⟩: the JAGG estimator in direction δθ, built from
    the loss's upstream gradients and JVPs at the knots, with per-sample t-weights α_k."""
    gs = upstream_grads(rollout, field)
    jv = _knot_jvps(field, rollout, tangent)
    t = rollout.batch["timesteps"]
    total = 0.0
    for w in rollout.windows:
        a, b = w[0], w[-1]
        for k in w:
            alpha = ((t[:, k] - t[:, a]) / (t[:, b] - t[:, a])).view(-1, 1) if b != a else torch.zeros(1, 1, dtype=DT)
            total += float(((1 - alpha) * jv[a] * gs[k] + alpha * jv[b] * gs[k]).sum())
    return total


def _check_dot_product(case, seed, stats: _Stats) -> float:
    field = _seeded(CurvedField, case, seed)
    rollout = make_rollout(case["kind"], field, case, seed, stream=25, on_chord=False)
    gen = _gen(26, case["s"], seed)
    tangent = [torch.randn(p.shape, generator=gen, dtype=DT) for p in _params(field)]
    _, grad, _ = compiled(rollout, field, case["capture"])
    _require_nonzero(grad, "the JAGG gradient")
    lhs = float(grad @ torch.cat([d.reshape(-1) for d in tangent]))
    rhs = jagg_directional_derivative(rollout, field, tangent)
    stats.seen.update([case["kind"], case["capture"]])
    return abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)


def grpo_dot_product(examples: int, seed: int = 0) -> PropertyResult:
    return _exact_with_stats("grpo_dot_product", _rollout_case(3, 6, 6), _check_dot_product, examples, seed)


# ----------------------------------------------------------------------------- counterexample properties

@st.composite
def _off_chord_case(draw):
    W, D = draw(st.integers(3, 5)), draw(st.integers(1, 3))
    delta = draw(st.lists(st.lists(st.integers(-2, 2), min_size=D, max_size=D), min_size=W - 2, max_size=W - 2))
    return dict(W=W, D=D, kind=draw(st.sampled_from(grpo.STEP_KINDS)), B=draw(st.integers(1, 2)),
                s=draw(st.integers(0, 1000)), delta=delta)


def _off_chord_by(delta) -> Callable[[torch.Tensor], torch.Tensor]:
    """Moves sample 0's interior states (B, n, D) by ``delta`` ((W − 2) × D)."""
    def move(latents: torch.Tensor) -> torch.Tensor:
        moved = latents.clone()
        moved[0, 1:1 + len(delta)] += torch.tensor(delta, dtype=DT)
        return moved
    return move


def _check_off_chord(case, seed) -> float:
    field = _seeded(AffineJacobianField, case, seed)
    rollout = make_rollout(case["kind"], field, case, seed, stream=27, on_chord=True,
                           off_chord=_off_chord_by(case["delta"]))
    _, exact = eager(rollout, field)
    return rel_err(compiled(rollout, field, "fx")[1], exact)


def grpo_off_chord(examples: int, seed: int = 0) -> PropertyResult:
    return run_counterexample_property("grpo_off_chord", _off_chord_case(), _check_off_chord, examples, seed)


@st.composite
def _curved_case(draw):
    return dict(W=draw(st.integers(3, 5)), D=draw(st.integers(1, 3)), kind=draw(st.sampled_from(grpo.STEP_KINDS)),
                B=draw(st.integers(1, 2)), s=draw(st.integers(0, 1000)))


def _check_curved(case, seed) -> float:
    field = _seeded(CurvedField, case, seed)
    rollout = make_rollout(case["kind"], field, case, seed, stream=28, on_chord=True)
    _, exact = eager(rollout, field)
    return rel_err(compiled(rollout, field, "fx")[1], exact)


def grpo_curved_field(examples: int, seed: int = 0) -> PropertyResult:
    return run_counterexample_property("grpo_curved_field", _curved_case(), _check_curved, examples, seed)


PROPERTIES: dict[str, Callable[[int, int], PropertyResult]] = {
    **{f"grpo_exact_{kind}": _grpo_exact(kind) for kind in grpo.STEP_KINDS},
    "grpo_window2_identity": grpo_window2_identity,
    "grpo_advantage_linearity": grpo_advantage_linearity,
    "grpo_dot_product": grpo_dot_product,
    "grpo_off_chord": grpo_off_chord,
    "grpo_curved_field": grpo_curved_field,
}


def run_all(examples: int, seed: int = 0) -> list[PropertyResult]:
    return [fn(examples, seed) for fn in PROPERTIES.values()]
