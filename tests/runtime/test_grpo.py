"""Tests for jaggc.grpo: step policies, PPO-clip loss, advantages, closed-form upstream gradient."""

from __future__ import annotations

import math

import pytest
import torch

from jaggc.errors import JaggInputError
from jaggc.grpo import (
    StepPolicy,
    cps_step,
    dance_flux_step,
    dance_grpo_advantages,
    flow_grpo_advantages,
    flow_grpo_sde_step,
    flow_match_sigmas,
    ppo_clip_loss,
    ppo_clip_stats,
    step_coefficients,
    upstream_grad,
)

F64 = torch.float64
LOG_SQRT_2PI = 0.9189385332046727  # log(sqrt(2*pi))
STEP = {"flow_grpo_sde": flow_grpo_sde_step, "dance_flux": dance_flux_step, "cps": cps_step}
STEP_KW = {
    "flow_grpo_sde": dict(noise_level=0.7, sigma_max=0.977),
    "dance_flux": dict(eta=0.3),
    "cps": dict(noise_level=0.7),
}
# per-sample noise levels: sigma == 1 (needs sigma_max), mid, the tiny last step, sigma_next == 0
SIGMA = torch.tensor([1.0, 0.923, 0.525, 0.183, 0.7, 0.3], dtype=F64)
SIGMA_NEXT = torch.tensor([0.977, 0.892, 0.432, 0.009, 0.6, 0.0], dtype=F64)
SHAPE = (6, 2, 3, 5)  # B = 6, D = 30


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(SHAPE, generator=g, dtype=F64)
    z = torch.randn(SHAPE, generator=g, dtype=F64)
    return v, z, g


def _autograd_upstream(kind, v, z, x1, old, adv, *, clip_range, normaliser):
    v = v.clone().requires_grad_(True)
    lp = STEP[kind](v, z, SIGMA, SIGMA_NEXT, prev_sample=x1, **STEP_KW[kind]).log_prob
    loss = ppo_clip_loss(lp, old, adv, clip_range=clip_range).sum() / normaliser
    return torch.autograd.grad(loss, v)[0]


def _assert_close(actual, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-11, atol=1e-13 * scale)


# ---------------------------------------------------------------------------------------------
# closed-form upstream gradient vs autograd


@pytest.mark.parametrize("kind", list(STEP))
def test_upstream_grad_matches_autograd_on_policy(kind):
    v, z, g = _tensors(1)
    step = STEP[kind](v, z, SIGMA, SIGMA_NEXT, generator=g, **STEP_KW[kind])
    old = step.log_prob.detach()
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -7.0, 0.0], dtype=F64)
    kw = dict(clip_range=1e-4, normaliser=12.0)
    got = upstream_grad(kind, v, z, step.prev_sample, SIGMA, SIGMA_NEXT, old, adv,
                        **kw, **STEP_KW[kind])
    want = _autograd_upstream(kind, v, z, step.prev_sample, old, adv, **kw)
    _assert_close(got, want)
    assert got[:5].abs().amax(dim=(1, 2, 3)).min() > 0  # only the A = 0 sample is zero
    assert got[5].abs().max() == 0


@pytest.mark.parametrize("kind", list(STEP))
def test_upstream_grad_matches_autograd_off_policy_with_clipping(kind):
    v, z, g = _tensors(2)
    v_old = v + 0.1 * torch.randn(SHAPE, generator=g, dtype=F64)
    x1 = STEP[kind](v_old, z, SIGMA, SIGMA_NEXT, generator=g, **STEP_KW[kind]).prev_sample
    lp = STEP[kind](v, z, SIGMA, SIGMA_NEXT, prev_sample=x1, **STEP_KW[kind]).log_prob
    # r = exp(-delta) = 1.22, 1.22, 0.82, 0.82, 0.99, 1: with eps = 0.05 the clipped branch is
    # active for sample 0 (A > 0, r > 1+eps) and sample 3 (A < 0, r < 1-eps) only
    old = lp.detach() + torch.tensor([-0.2, -0.2, 0.2, 0.2, 0.01, 0.0], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, -7.0], dtype=F64)
    kw = dict(clip_range=0.05, normaliser=3.0)
    got = upstream_grad(kind, v, z, x1, SIGMA, SIGMA_NEXT, old, adv, **kw, **STEP_KW[kind])
    want = _autograd_upstream(kind, v, z, x1, old, adv, **kw)
    _assert_close(got, want)
    per_sample = got.abs().amax(dim=(1, 2, 3))
    assert per_sample[0] == 0 and per_sample[3] == 0
    assert (per_sample[[1, 2, 4, 5]] > 0).all()
    stats = ppo_clip_stats(lp, old, adv, clip_range=0.05)
    assert stats["clipped_frac"].item() == pytest.approx(2 / 6)
    assert stats["clipfrac"].item() == pytest.approx(4 / 6)


@pytest.mark.parametrize("kind", ["flow_grpo_sde", "dance_flux"])
def test_on_policy_upstream_grad_is_scaled_noise(kind):
    v, z, g = _tensors(3)
    eps = torch.randn(SHAPE, generator=g, dtype=F64)
    a, b, s = (t.view(-1, 1, 1, 1) for t in step_coefficients(kind, SIGMA, SIGMA_NEXT,
                                                              **STEP_KW[kind]))
    x1 = a * z + b * v + s * eps
    old = STEP[kind](v, z, SIGMA, SIGMA_NEXT, prev_sample=x1, **STEP_KW[kind]).log_prob
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -7.0, 4.0], dtype=F64)
    n, d = 5.0, 30
    got = upstream_grad(kind, v, z, x1, SIGMA, SIGMA_NEXT, old, adv, clip_range=1e-4,
                        normaliser=n, **STEP_KW[kind])
    adv_hat = adv.clamp(-5, 5).view(-1, 1, 1, 1)
    _assert_close(got, -adv_hat * b * eps / (n * d * s))


def test_on_policy_cps_upstream_grad():
    v, z, g = _tensors(4)
    eps = torch.randn(SHAPE, generator=g, dtype=F64)
    a, b, s = (t.view(-1, 1, 1, 1) for t in step_coefficients("cps", SIGMA, SIGMA_NEXT))
    x1 = a * z + b * v + s * eps
    old = cps_step(v, z, SIGMA, SIGMA_NEXT, prev_sample=x1).log_prob
    adv = torch.ones(6, dtype=F64)
    got = upstream_grad("cps", v, z, x1, SIGMA, SIGMA_NEXT, old, adv, clip_range=1e-4)
    _assert_close(got, -(2 * b / 30) * s * eps)


# ---------------------------------------------------------------------------------------------
# hand-computed step values (1 element, sigma = 0.5 -> 0.25 unless stated; z = 1, v = 0.5)


def _one(x):
    return torch.tensor([[x]], dtype=F64)


def test_flow_grpo_sde_by_hand():
    # std_dev_t = 0.7*sqrt(0.5/0.5) = 0.7; dt = -0.25
    # mean = z(1 + 0.49/1.0*(-0.25)) + v(1 + 0.49*0.5/1.0)(-0.25) = 0.8775 z - 0.31125 v = 0.721875
    # std = 0.7*sqrt(0.25) = 0.35; z' = 1: (1 - 0.721875)^2/(2*0.1225) = 0.3157286352040818
    # log_prob = -0.3157286352040818 - log(0.35) - log(sqrt(2 pi))
    #          = -0.3157286352040818 + 1.0498221244986778 - 0.9189385332046727 = -0.1848450439100766
    st = flow_grpo_sde_step(_one(0.5), _one(1.0), 0.5, 0.25, prev_sample=_one(1.0))
    assert st.mean.item() == pytest.approx(0.721875, abs=1e-15)
    assert st.std.item() == pytest.approx(0.35, abs=1e-15)
    assert st.std_dev_t.item() == pytest.approx(0.7, abs=1e-15)
    assert (st.a.item(), st.b.item()) == pytest.approx((0.8775, -0.31125), abs=1e-15)
    assert st.log_prob.item() == pytest.approx(-0.1848450439100766, abs=1e-14)


def test_flow_grpo_sde_at_sigma_one_uses_sigma_max():
    # sigma = 1, sigma_next = 0.75, sigma_max = 0.75: std_dev_t = 0.7*sqrt(1/(1-0.75)) = 1.4
    # a = 1 + 1.96/2*(-0.25) = 0.755; b = (1 + 0)*(-0.25) = -0.25 (exactly dt at sigma = 1)
    # mean = 0.755 - 0.125 = 0.63; std = 1.4*0.5 = 0.7; z' = 0.9: resid 0.27
    # log_prob = -0.0729/0.98 - log(0.7) - log(sqrt(2 pi))
    #          = -0.07438775510204 + 0.35667494393873 - 0.91893853320467 = -0.6366513443679811
    st = flow_grpo_sde_step(_one(0.5), _one(1.0), 1.0, 0.75, sigma_max=0.75,
                            prev_sample=_one(0.9))
    assert st.std_dev_t.item() == pytest.approx(1.4, abs=1e-15)
    assert (st.a.item(), st.b.item()) == pytest.approx((0.755, -0.25), abs=1e-15)
    assert st.mean.item() == pytest.approx(0.63, abs=1e-15)
    assert st.log_prob.item() == pytest.approx(-0.6366513443679811, abs=1e-14)
    # sigma_max changes nothing where sigma < 1
    a = flow_grpo_sde_step(_one(0.5), _one(1.0), 0.5, 0.25, prev_sample=_one(1.0))
    b = flow_grpo_sde_step(_one(0.5), _one(1.0), 0.5, 0.25, sigma_max=0.75, prev_sample=_one(1.0))
    assert a.log_prob.item() == b.log_prob.item()


def test_dance_flux_by_hand():
    # eta = 0.3: a = 1 + 0.09*(-0.25)/1.0 = 0.9775; b = -0.25*(1 + 0.09*0.5/1.0) = -0.26125
    # mean = 0.9775 - 0.130625 = 0.846875; std = 0.3*sqrt(0.25) = 0.15; z' = 0.8: resid -0.046875
    # quadratic term = -0.046875^2/(2*0.0225) = -0.048828125
    # with constants: -0.048828125 - log(0.15) - log(sqrt(2 pi)) = 0.9293533266812086
    st = dance_flux_step(_one(0.5), _one(1.0), 0.5, 0.25, prev_sample=_one(0.8))
    assert (st.a.item(), st.b.item()) == pytest.approx((0.9775, -0.26125), abs=1e-15)
    assert st.mean.item() == pytest.approx(0.846875, abs=1e-15)
    assert st.std.item() == pytest.approx(0.15, abs=1e-15)
    assert st.log_prob.item() == pytest.approx(0.9293533266812086, abs=1e-14)
    bare = dance_flux_step(_one(0.5), _one(1.0), 0.5, 0.25, prev_sample=_one(0.8),
                           include_constants=False)
    assert bare.log_prob.item() == pytest.approx(-0.048828125, abs=1e-15)


def test_cps_by_hand():
    # noise_level = 1/3, sigma = 0.5, sigma_next = 0.4: std = 0.4*sin(pi/6) = 0.2
    # sqrt(0.4^2 - 0.2^2) = sqrt(0.12) = 0.34641016151377546
    # a = (1 - 0.4) + 0.34641016 = 0.9464101615137754; b = -0.5*0.6 + 0.5*0.34641016 = -0.12679491924311226
    # mean = 0.9464101615137754 - 0.06339745962155613 = 0.8830127018922193; z' = 0.9
    # log_prob = -(0.9 - 0.8830127018922193)^2 = -0.0002885682970026
    st = cps_step(_one(0.5), _one(1.0), 0.5, 0.4, noise_level=1 / 3, prev_sample=_one(0.9))
    assert st.std.item() == pytest.approx(0.2, abs=1e-15)
    assert (st.a.item(), st.b.item()) == pytest.approx(
        (0.9464101615137754, -0.12679491924311226), abs=1e-15)
    assert st.mean.item() == pytest.approx(0.8830127018922193, abs=1e-15)
    assert st.log_prob.item() == pytest.approx(-0.0002885682970026, abs=1e-15)


def test_log_prob_is_mean_over_elements():
    v, z, _ = _tensors(5)
    x1 = z + 0.01
    for kind in STEP:
        st = STEP[kind](v, z, SIGMA, SIGMA_NEXT, prev_sample=x1, **STEP_KW[kind])
        per_elem = STEP[kind](v.reshape(-1, 1), z.reshape(-1, 1), SIGMA.repeat_interleave(30),
                              SIGMA_NEXT.repeat_interleave(30), prev_sample=x1.reshape(-1, 1),
                              **STEP_KW[kind]).log_prob
        _assert_close(st.log_prob, per_elem.view(6, 30).mean(1))


# ---------------------------------------------------------------------------------------------
# coefficients, sampling, dtypes


@pytest.mark.parametrize("kind", list(STEP))
def test_step_coefficients_match_step_functions(kind):
    v, z, g = _tensors(6)
    st = STEP[kind](v, z, SIGMA, SIGMA_NEXT, generator=g, **STEP_KW[kind])
    a, b, s = step_coefficients(kind, SIGMA, SIGMA_NEXT, **STEP_KW[kind])
    assert a.shape == b.shape == s.shape == (6,)
    col = (lambda t: t.view(-1, 1, 1, 1))
    _assert_close(st.mean, col(a) * z + col(b) * v)
    torch.testing.assert_close(st.std, col(s), rtol=0, atol=0)
    torch.testing.assert_close(st.a, col(a), rtol=0, atol=0)
    torch.testing.assert_close(st.b, col(b), rtol=0, atol=0)


def test_step_coefficients_match_the_derived_closed_forms():
    sig, nxt = SIGMA[1:], SIGMA_NEXT[1:]  # sigma < 1
    dt = nxt - sig
    a, b, s = step_coefficients("flow_grpo_sde", sig, nxt, noise_level=0.7)
    _assert_close(a, 1 + 0.49 * dt / (2 * (1 - sig)))
    _assert_close(b, dt * (1 + 0.49 / 2))
    _assert_close(s, 0.7 * torch.sqrt(sig / (1 - sig)) * torch.sqrt(-dt))
    a, b, s = step_coefficients("dance_flux", sig, nxt, eta=0.3)
    _assert_close(a, 1 + 0.09 * dt / (2 * sig))
    _assert_close(b, dt * (1 + 0.09 * (1 - sig) / (2 * sig)))
    a, b, s = step_coefficients("cps", sig, nxt, noise_level=0.7)
    _assert_close(b, -sig * (1 - nxt) + (1 - sig) * nxt * math.cos(math.pi * 0.7 / 2))
    _assert_close(s, nxt * math.sin(math.pi * 0.7 / 2))


@pytest.mark.parametrize("kind", list(STEP))
def test_sampling_uses_generator_noise_and_detaches(kind):
    v, z, _ = _tensors(7)
    v.requires_grad_(True)
    st = STEP[kind](v, z, 0.525, 0.432, generator=torch.Generator().manual_seed(9),
                    **STEP_KW[kind])
    assert isinstance(st, StepPolicy)
    assert not st.prev_sample.requires_grad and st.log_prob.requires_grad
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9), dtype=F64)
    _assert_close(st.prev_sample, (st.mean + st.std * noise).detach())
    assert st.log_prob.shape == (6,)


def test_fp32_math_for_low_precision_inputs_and_fp64_kept():
    v, z, _ = _tensors(8)
    lo = flow_grpo_sde_step(v.bfloat16(), z.bfloat16(), 0.5, 0.25, prev_sample=z.bfloat16())
    assert lo.log_prob.dtype == lo.mean.dtype == torch.float32
    hi = flow_grpo_sde_step(v, z, 0.5, 0.25, prev_sample=z)
    assert hi.log_prob.dtype == F64
    g = upstream_grad("dance_flux", v.bfloat16(), z.bfloat16(), z.bfloat16(), 0.5, 0.25,
                      torch.zeros(6), torch.ones(6), clip_range=0.1)
    assert g.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# PPO loss and advantages by hand


def test_ppo_clip_loss_by_hand():
    # eps = 0.2; r = 1.5, 0.5, 1.1, 0.7, 1.0; A = 1, 1, -2, -1, 10 (clamped to 5)
    # max(-1.5, -1.2) = -1.2 (clipped); max(-0.5, -0.8) = -0.5; max(2.2, 2.2) = 2.2;
    # max(0.7, 0.8) = 0.8 (clipped); max(-5, -5) = -5
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.7, 1.0], dtype=F64)
    old = torch.tensor([0.3, -0.1, 0.0, 2.0, -1.0], dtype=F64)
    lp = old + ratio.log()
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0, 10.0], dtype=F64)
    loss = ppo_clip_loss(lp, old, adv, clip_range=0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 2.2, 0.8, -5.0], dtype=F64))
    stats = ppo_clip_stats(lp, old, adv, clip_range=0.2)
    assert stats["clipfrac"].item() == pytest.approx(3 / 5)  # |r - 1| > 0.2: 1.5, 0.5, 0.7
    assert stats["clipped_frac"].item() == pytest.approx(2 / 5)
    # 0.5*mean(log(r)^2) = 0.5*(0.164402 + 0.480453 + 0.009084 + 0.127217 + 0)/5
    assert stats["approx_kl"].item() == pytest.approx(0.0781155, abs=1e-6)
    assert stats["ratio_mean"].item() == pytest.approx(0.96)
    assert (stats["ratio_min"].item(), stats["ratio_max"].item()) == pytest.approx((0.5, 1.5))


def test_flow_grpo_advantages_by_hand():
    # Flow-GRPO stat_tracking.py example: prompts a b a c b a, rewards 1..6
    # means: a = 10/3, b = 3.5, c = 4; population std of 1..6 = sqrt(35/12) = 1.707825127659933
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=F64)
    ids = ["a", "b", "a", "c", "b", "a"]
    centred = torch.tensor([-7 / 3, -1.5, -1 / 3, 0.0, 1.5, 8 / 3], dtype=F64)
    got = flow_grpo_advantages(rewards, ids)
    torch.testing.assert_close(got, centred / (1.707825127659933 + 1e-4))
    # per-prompt population std: a = sqrt(114/27) = 2.0548046676563256, b = 1.5, c = 0
    std = torch.tensor([2.0548046676563256, 1.5, 2.0548046676563256, 0.0, 1.5,
                        2.0548046676563256], dtype=F64)
    got = flow_grpo_advantages(rewards, ids, global_std=False)
    torch.testing.assert_close(got, centred / (std + 1e-4))
    assert got[3].item() == 0.0
    assert flow_grpo_advantages([1, 2, 3], [0, 0, 1]).dtype == torch.float32


def test_dance_grpo_advantages_by_hand():
    # groups (1, 2, 3): mean 2, unbiased std 1; (10, 10, 13): mean 11, unbiased std sqrt(6/2)
    got = dance_grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0], dtype=F64), 3)
    want = torch.tensor([-1 / (1 + 1e-8), 0.0, 1 / (1 + 1e-8), -1 / (3**0.5 + 1e-8),
                         -1 / (3**0.5 + 1e-8), 2 / (3**0.5 + 1e-8)], dtype=F64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# schedule


def test_flow_match_sigmas_match_spec():
    spec = [1.0, .977, .951, .923, .892, .858, .819, .775, .725, .668, .602, .525, .432, .321,
            .183, .009, 0.0]
    sig = flow_match_sigmas(16)
    assert sig.shape == (17,) and sig[-1].item() == 0.0
    assert [round(x, 3) for x in sig.tolist()] == spec


# ---------------------------------------------------------------------------------------------
# refusals


def _refuses(name, fn, *args, **kw):
    with pytest.raises(JaggInputError) as info:
        fn(*args, **kw)
    assert name in str(info.value)
    assert isinstance(info.value, ValueError)


def test_refusals_name_the_input():
    v, z, _ = _tensors(10)
    _refuses("sigma_max", flow_grpo_sde_step, v, z, SIGMA, SIGMA_NEXT)
    _refuses("sigma_max", flow_grpo_sde_step, v, z, 1.0, 0.9, sigma_max=1.0)
    _refuses("sigma_next", dance_flux_step, v, z, 0.5, 0.5)
    _refuses("sigma_next", cps_step, v, z, 0.5, -0.1)
    _refuses("'sigma'", dance_flux_step, v, z, 0.0 + torch.zeros(6), -torch.zeros(6) - 0.0)
    _refuses("'sigma'", cps_step, v, z, torch.full((7,), 0.5), 0.25)
    _refuses("'sigma'", flow_grpo_sde_step, v, z, 1.5, 0.25)
    _refuses("'z'", cps_step, v, z[:, :1], 0.5, 0.25)
    _refuses("prev_sample", cps_step, v, z, 0.5, 0.25, prev_sample=z[:3])
    _refuses("'v'", cps_step, v.flatten()[:6], z.flatten()[:6], 0.5, 0.25)
    _refuses("noise_level", flow_grpo_sde_step, v, z, 0.5, 0.25, noise_level=0.0)
    _refuses("noise_level", cps_step, v, z, 0.5, 0.25, noise_level=1.5)
    _refuses("eta", dance_flux_step, v, z, 0.5, 0.25, eta=-0.3)
    _refuses("sigma_next", step_coefficients, "cps", SIGMA, SIGMA_NEXT[:3])
    _refuses("kind", step_coefficients, "ode", 0.5, 0.25)
    _refuses("eta", step_coefficients, "cps", 0.5, 0.25, eta=0.3)
    lp = torch.zeros(6)
    _refuses("old_log_prob", ppo_clip_loss, lp, torch.zeros(5), lp, clip_range=0.1)
    _refuses("advantages", ppo_clip_loss, lp, lp, torch.zeros(6, 1), clip_range=0.1)
    _refuses("clip_range", ppo_clip_loss, lp, lp, lp, clip_range=-0.1)
    _refuses("adv_clip_max", ppo_clip_stats, lp, lp, lp, clip_range=0.1, adv_clip_max=0)
    _refuses("kind", upstream_grad, "ode", v, z, z, 0.5, 0.25, lp, lp, clip_range=0.1)
    _refuses("normaliser", upstream_grad, "cps", v, z, z, 0.5, 0.25, lp, lp, clip_range=0.1,
             normaliser=0)
    _refuses("prev_sample", upstream_grad, "cps", v, z, None, 0.5, 0.25, lp, lp, clip_range=0.1)
    _refuses("old_log_prob", upstream_grad, "cps", v, z, z, 0.5, 0.25, lp[:2], lp, clip_range=0.1)
    _refuses("rewards", flow_grpo_advantages, [1.0, float("nan")], ["a", "a"])
    _refuses("rewards", dance_grpo_advantages, [1.0, float("inf")], 2)
    _refuses("prompt_ids", flow_grpo_advantages, [1.0, 2.0, 3.0], ["a", "a"])
    _refuses("group_size", dance_grpo_advantages, [1.0, 2.0, 3.0], 2)
    _refuses("group_size", dance_grpo_advantages, [1.0, 2.0], 1)
    _refuses("rewards", dance_grpo_advantages, [[1.0, 2.0]], 2)
    _refuses("num_steps", flow_match_sigmas, 0)
