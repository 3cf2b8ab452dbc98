"""jaggc.fidelity: the estimators' structure (exact = autograd, JAGG = the runtime, unbiasedness of
subsampling and of the randomized third knot, exactness cases) and calibrate's contract."""

import itertools

import pytest
import torch

import jaggc
from jaggc.fidelity import estimators as E
from jaggc.fidelity.calibrate import calibrate, format_table
from jaggc.verify.fields import AffineJacobianField, CurvedField

# one intra-op thread for this module only (conftest.one_thread restores the count after it)
pytestmark = pytest.mark.usefixtures("one_thread")

S, B, D = 9, 3, 4


def toy_loss(dit, batch):
    """A GRPO-like loss of gradient-independent DiT calls, nonlinear in each output."""
    total = 0.0
    for k in range(batch["states"].shape[1]):
        v = dit(batch["states"][:, k], batch["t"][:, k])
        total = total + (batch["adv"][:, None] * torch.tanh(v - batch["target"][:, k])).sum() + 0.1 * (v ** 2).sum()
    return total / batch["states"].shape[1]


def make_batch(seed=0, collinear=False, span=None):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.1, S, dtype=torch.float64) ** 1.5      # non-uniform grid
    if collinear:   # every state on one line, position affine in t: on the chord of every window
        z0, d = torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(B, D, generator=g, dtype=torch.float64)
        states = z0[:, None] + t[None, :, None] * d[:, None]
    else:
        states = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    return dict(states=states, t=t.expand(B, S).contiguous(),
                target=torch.randn(B, S, D, generator=g, dtype=torch.float64),
                adv=torch.randn(B, generator=g, dtype=torch.float64))


def autograd_flat(loss_fn, dit, batch):
    dit.zero_grad(set_to_none=True)
    loss_fn(dit, batch).backward()
    out = torch.cat([p.grad.reshape(-1) for p in dit.parameters()])
    dit.zero_grad(set_to_none=True)
    return out


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def curved():
    dit = CurvedField(D, seed=1)
    batch = make_batch(1)
    return dit, batch, E.record(toy_loss, dit, batch)


def test_exact_is_plain_autograd(curved):
    dit, batch, rec = curved
    est = E.exact(rec, dit)
    assert rel(est.grad, autograd_flat(toy_loss, dit, batch)) < 1e-12
    assert est.backward_passes == S and est.backward_fraction == 1.0


@pytest.mark.parametrize("weights", ["t", "index"])
def test_jagg_is_the_runtime(curved, weights):
    dit, batch, rec = curved
    for exact_windows in ((), (1,)):
        est = E.jagg(rec, dit, window=4, weights=weights, exact_windows=exact_windows)
        ref = E.runtime_gradient(toy_loss, dit, batch, window=4, weights=weights, exact_windows=exact_windows)
        assert rel(est.grad, ref) < 1e-12
    # and it is a real approximation here (the test is not vacuous)
    assert rel(E.jagg(rec, dit, window=4, weights=weights).grad, E.exact(rec, dit).grad) > 1e-3


def test_other_bases_are_the_runtime(curved):
    dit, batch, rec = curved
    for basis, est in ((jaggc.Basis("constant"), E.causal(rec, dit, window=4)),
                       (jaggc.Basis("lagrange"), E.lagrange(rec, dit, window=4))):
        assert rel(est.grad, E.runtime_gradient(toy_loss, dit, batch, window=4, weights=basis)) < 1e-12
    knots = (0, 3, 6, 8)
    est = E.hat(rec, dit, spacing=3)
    ref = E.runtime_gradient(toy_loss, dit, batch, window=S, weights=jaggc.Basis("linear", "t", knots=knots))
    assert rel(est.grad, ref) < 1e-12


def test_backward_fractions(curved):
    dit, _, rec = curved   # windows of 4 over 9 steps: [0-3] [4-7] [8]
    g = torch.Generator().manual_seed(0)
    cases = {"jagg": (E.jagg(rec, dit, window=4), 5), "causal": (E.causal(rec, dit, window=4), 3),
             "lagrange": (E.lagrange(rec, dit, window=4), 7), "random3": (E.random3(rec, dit, window=4, generator=g), 7),
             "s2": (E.subsample(rec, dit, window=4, k=2, generator=g), 5),
             "s1": (E.subsample(rec, dit, window=4, k=1, generator=g), 3),
             "hybrid": (E.jagg(rec, dit, window=4, exact_windows=(1,)), 7), "hat": (E.hat(rec, dit, spacing=3), 4)}
    for name, (est, passes) in cases.items():
        assert est.backward_passes == passes, name
        assert est.backward_fraction == pytest.approx(passes / S), name


def test_subsampling_is_unbiased(curved):
    dit, _, rec = curved
    exact = E.exact(rec, dit).grad
    combos = list(itertools.combinations(range(4), 2))
    ests = [E.subsample(rec, dit, window=4, k=2, picks={0: list(a), 1: list(b)}).grad
            for a, b in itertools.product(combos, combos)]
    assert rel(sum(ests) / len(ests), exact) < 1e-12
    assert max(rel(e, exact) for e in ests) > 1e-2          # one draw is not exact


def test_random_third_knot_is_unbiased_on_any_field(curved):
    dit, _, rec = curved
    exact = E.exact(rec, dit).grad
    ests = [E.random3(rec, dit, window=4, picks={0: a, 1: b}).grad for a in (1, 2) for b in (1, 2)]
    assert rel(sum(ests) / len(ests), exact) < 1e-12
    assert max(rel(e, exact) for e in ests) > 1e-3


def test_exact_cases_on_affine_jacobian_collinear_states():
    dit = AffineJacobianField(D, seed=2)
    batch = make_batch(2, collinear=True)
    rec = E.record(toy_loss, dit, batch)
    exact = E.exact(rec, dit).grad
    # E1: plain JAGG (t-weights) and every randomized third knot are exact, hence so is the mean
    assert rel(E.jagg(rec, dit, window=4).grad, exact) < 1e-12
    ests = [E.random3(rec, dit, window=4, picks={0: a, 1: b}).grad for a in (1, 2) for b in (1, 2)]
    assert rel(sum(ests) / 4, exact) < 1e-12
    # index weights on the non-uniform grid are not (the check can fail)
    assert rel(E.jagg(rec, dit, window=4, weights="index").grad, exact) > 1e-4


def test_denoised_endpoint():
    dit = AffineJacobianField(D, seed=3)
    batch = make_batch(3, collinear=True)
    rec = E.record(toy_loss, dit, batch)
    states = batch["states"]
    exact = E.exact(rec, dit).grad
    end_time = torch.full((B,), 0.05, dtype=torch.float64)
    # noise-free transitions along the line: z* of window [a, a+n) is the chord point at t_{a+n}
    t_all = torch.cat([batch["t"][0], end_time[:1]])
    d = (states[:, 1] - states[:, 0]) / (t_all[1] - t_all[0])
    nxt = states[:, 0:1] + (t_all[1:] - t_all[0])[None, :, None] * d[:, None]
    means = [nxt[:, k] for k in range(S)]
    est = E.denoised(rec, dit, window=4, means=means, end_time=end_time)
    assert rel(est.grad, exact) < 1e-12 and est.backward_passes == 5
    # with injected noise (means ≠ next states) the right knot moves off the chord: not exact
    g = torch.Generator().manual_seed(0)
    noisy = [m + 0.3 * torch.randn(m.shape, generator=g, dtype=m.dtype) for m in means]
    assert rel(E.denoised(rec, dit, window=4, means=noisy, end_time=end_time).grad, exact) > 1e-3


def test_routing_and_sigma_aware_windows(curved):
    dit, _, rec = curved
    assert E.windows_below(rec, 4, 0.5) == (1, 2)       # t_k < 0.5 from step 5 on
    scores = E.routing_scores(rec, 4)
    assert len(scores) == 3 and scores[2] != scores[2]   # the 1-step tail has no score (nan)
    ex = E.routed_exact_windows(rec, 4, jagg_frac=1 / 3)
    assert len([w for w in (0, 1) if w not in ex]) == 1


def test_calibrate_json_and_cheapest_meeting_target():
    dit = AffineJacobianField(D, seed=4)
    batches = [make_batch(s, collinear=True) for s in (4, 5)]
    cands = [dict(variant="jagg", window=w, weights="t", jagg_frac=1.0) for w in (3, 4, 6)]
    cands += [dict(variant="jagg", window=4, weights="index", jagg_frac=1.0),
              dict(variant="causal", window=4, weights="t", jagg_frac=1.0)]
    res = calibrate(toy_loss, dit, batches, target_cosine=0.999999, candidates=cands)
    assert set(res) >= {"settings", "subsample", "recommended"}
    keys = {"window", "weights", "jagg_frac", "variant", "backward_fraction", "cosine_mean", "cosine_min"}
    for row in res["settings"] + res["subsample"]:
        assert keys <= set(row)
    by = {r["label"]: r for r in res["settings"]}
    assert by["causal/W4/t"]["cosine_mean"] < 0.999999      # cheaper (1/W) but misses the target
    assert by["causal/W4/t"]["backward_fraction"] < by["jagg/W6/t"]["backward_fraction"]
    # every t-weighted JAGG is exact here; the cheapest of them is W = 6 (windows [0-5] [6-8]: 4/9)
    assert res["recommended"]["label"] == "jagg/W6/t"
    assert res["recommended"]["backward_fraction"] == pytest.approx(4 / 9)
    assert any(abs(r["backward_fraction"] - 5 / 9) < 1e-12 and r["variant"] == "subsample" for r in res["subsample"])
    assert jaggc.calibrate(toy_loss, dit, batches[0], 0.999999, cands)["recommended"]["label"] == "jagg/W6/t"


def test_calibrate_unreachable_target_recommends_exact(curved):
    dit, batch, _ = curved
    res = calibrate(toy_loss, dit, batch, target_cosine=0.9999999,
                    candidates=[dict(variant="jagg", window=4), dict(variant="causal", window=3)])
    assert res["recommended"] is None
    assert "exact" in res["note"]


def test_randomized_basis_is_the_random3_estimator(curved):
    """@jagg_compile/jagg_calls with weights=Basis("randomized", seed) computes the randomized
    third-knot estimator for the interior knots its seeded stream draws (replayed here)."""
    dit, batch, rec = curved       # windows of 4 over 9 steps: [0-3] [4-7] draw, [8] is exact
    draws = torch.Generator().manual_seed(5)
    picks = {w: 1 + int(torch.randint(2, (1,), generator=draws)) for w in (0, 1)}
    ref = E.runtime_gradient(toy_loss, dit, batch, window=4, weights=jaggc.Basis("randomized", seed=5))
    assert rel(E.random3(rec, dit, window=4, picks=picks).grad, ref) < 1e-12
    assert rel(ref, E.exact(rec, dit).grad) > 1e-3


def test_extrapolation_basis_is_the_causal_extrapolation(curved):
    """Knots shared along the trajectory (one backward per knot): each step after knot k_j uses
    J(k_j) + β (J(k_j) − J(k_{j−1})); checked against VJPs at the knots built by hand."""
    dit, batch, rec = curved
    knots = (0, 3, 6)
    ref = E.runtime_gradient(toy_loss, dit, batch, window=S, weights=jaggc.Basis("extrapolate", "t", knots=knots))
    t = rec.times
    pairs = []
    for j, k in enumerate(knots):
        cot = 0
        for s in range(S):
            seg = max(i for i, kk in enumerate(knots) if kk <= s)
            if seg == 0:
                w = torch.ones_like(t[0]) if j == 0 else torch.zeros_like(t[0])
            else:
                lo, hi = knots[seg - 1], knots[seg]
                beta = (t[s] - t[hi]) / (t[hi] - t[lo])
                w = -beta if j == seg - 1 else (1 + beta) if j == seg else torch.zeros_like(t[0])
            cot = cot + w[:, None] * rec.upstream[s]
        pairs.append((rec.calls[k], cot))
    by_hand = E.vjp_sum(dit, pairs, rec.time_arg)
    assert rel(by_hand, ref) < 1e-12
    assert rel(E.extrapolate(rec, dit, spacing=3).grad, ref) < 1e-12
    assert rel(ref, E.exact(rec, dit).grad) > 1e-3


@pytest.mark.usefixtures("fresh_dynamo")
def test_new_bases_through_jagg_compile(curved):
    """The extrapolation and randomized bases run through the Dynamo-compiled loss exactly as through
    the runtime (same seed, same draws), and the report names the basis."""
    dit, batch, _ = curved
    for window, make in ((4, lambda: jaggc.Basis("randomized", seed=5)),
                         (S, lambda: jaggc.Basis("extrapolate", knots=(0, 3, 6)))):
        ref = E.runtime_gradient(toy_loss, dit, batch, window=window, weights=make())
        compiled = jaggc.jagg_compile(toy_loss, window=window, weights=make(), capture="dynamo")
        got = E._flat(torch.autograd.grad(compiled(dit, batch), E.trainable(dit)), E.trainable(dit))
        assert rel(got, ref) < 1e-12
        assert compiled.report.windows[0].basis.startswith(make().kind)


def test_calibrate_flags_a_setting_whose_error_does_not_average_out(curved):
    """The same batch six times: plain JAGG's error is identical every time (bias, zero spread:
    flagged however good its cosine), the control-variate correction's draws scatter around zero
    (not flagged), and the note names the flagged setting."""
    dit, batch, _ = curved
    cands = [dict(variant="jagg", window=4), dict(variant="control", window=4, p=0.5, per="step")]
    res = calibrate(toy_loss, dit, [batch] * 6, target_cosine=0.5, candidates=cands, draws=4)
    by = {r["label"]: r for r in res["settings"]}
    jagg, control = by["jagg/W4/t"], by["control/W4/t/p0.5/step"]
    assert jagg["cosine_mean"] > 0.5 and jagg["biased"] and jagg["bias_over_floor"] > 100
    assert not control["biased"] and control["bias_over_floor"] < 1.5
    assert res["recommended"] is None    # plain JAGG is flagged; the correction does not beat subsampling here
    assert "biased" in res["note"] and "jagg/W4/t" in res["note"]
    assert "BIASED" in format_table(res)


def test_calibrate_recommends_by_the_default_rule():
    """Cheapest setting with cosine >= target that beats its subsampling baseline and is not biased."""
    from jaggc.fidelity.calibrate import _recommend

    def row(label, b, cos, sub, biased=False):
        return dict(label=label, backward_fraction=b, cosine_mean=cos, subsample_cosine_mean=sub,
                    beats_subsample=cos > sub, biased=biased)

    rows = [row("cheap_biased", 0.5, 0.99, 0.8, biased=True), row("cheap_loses", 0.55, 0.96, 0.97),
            row("ok", 0.66, 0.96, 0.9), row("ok_dearer", 0.78, 0.999, 0.99), row("below_target", 0.4, 0.9, 0.5)]
    assert _recommend(rows, [], 0.95, 4)["recommended"]["label"] == "ok"
    assert "cheap_biased" in _recommend(rows, [], 0.95, 4)["note"]
    assert _recommend(rows[:2], [], 0.95, 4)["recommended"] is None


def test_calibrate_one_batch_has_no_floor_and_states_are_loaded(curved):
    dit, batch, _ = curved
    cands = [dict(variant="jagg", window=4)]
    plain = calibrate(toy_loss, dit, batch, target_cosine=0.5, candidates=cands)
    row = plain["settings"][0]
    assert row["floor"] == float("inf") and not row["biased"]
    state = {k: v.clone() for k, v in dit.state_dict().items()}
    moved = {k: v + 0.05 for k, v in state.items()}
    try:
        at_moved = calibrate(toy_loss, dit, [batch], 0.5, cands, states=[moved])
        assert all(torch.equal(v, moved[k]) for k, v in dit.state_dict().items())
        assert at_moved["settings"][0]["cosine_mean"] != row["cosine_mean"]
    finally:
        dit.load_state_dict(state)
    with pytest.raises(ValueError, match="2 state dicts for 1 batches"):
        calibrate(toy_loss, dit, [batch], 0.5, cands, states=[state, state])
