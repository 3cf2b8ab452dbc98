"""The verifier's GRPO-loss properties (``jaggc.verify.loss_properties``) and their CLI suite.

What is checked:
  * the inline Flow-GRPO / DanceGRPO / CPS losses are the ``jaggc.grpo`` losses: same value, and
    their autograd upstream gradients equal ``grpo.upstream_grad``'s closed form;
  * every exact property holds to roundoff through ``@jagg_compile`` (FX and Dynamo) and every
    counterexample property finds a counterexample and shrinks it to the smallest window;
  * with per-step forwards the compiled loss value is bit-identical to the eager one;
  * the properties are not vacuous: the exact regime's examples include PPO-clipped and unclipped
    samples and a rollout from σ = 1; the same checks fail off the exact regime (curved field,
    W = 3 instead of 2) and when the aggregation backward is wrong (monkeypatched);
  * ``jaggc verify --suite losses`` runs them and writes the documented JSON entries.

Examples per property follow the hypothesis profile loaded by conftest.py: a fifth of its
max_examples, at least 3 (``ci``: 3; ``JAGGC_HYPOTHESIS_PROFILE=thorough``: 60). Each example
compiles a loss (a Dynamo compile is about a second of CPU), hence the fraction.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import settings

from jaggc import grpo
from jaggc.runtime.aggregate import KnotAggregate
from jaggc.verify import grpo_losses as gl
from jaggc.verify import loss_properties as lp
from jaggc.verify import cfg_properties, serving_properties
from jaggc.verify.cli import main_verify, registry
from jaggc.verify.fields import AffineJacobianField, CurvedField
from jaggc.verify.harness import TOL, rel_err
from jaggc.verify.properties import PROPERTIES as RUNTIME_PROPERTIES

EXAMPLES = max(3, settings().max_examples // 5)
EXACT = [name for name in lp.PROPERTIES if name not in ("grpo_off_chord", "grpo_curved_field")]
NEGATIVE = ["grpo_off_chord", "grpo_curved_field"]

# one fixed GRPO batch shape for the direct checks below: a window of 3 and a tail of 1,
# three samples (the last one PPO-clipped at spread 3), a shared grid starting at σ = 1
CASE = dict(W=3, n=4, B=3, D=2, per_sample=False, shift=3, start=0, extra=4, clip=1, spread=3.0, s=11)


# ----------------------------------------------------------------------------- the losses

@pytest.mark.parametrize("kind", grpo.STEP_KINDS)
def test_inline_losses_are_the_jaggc_grpo_losses(kind):
    field = gl._seeded(CurvedField, CASE, 0)
    rollout = gl.make_rollout(kind, field, CASE, 0, stream=1, on_chord=False)
    value, _ = gl.eager(rollout, field)
    assert rel_err(value, gl.grpo_reference_value(rollout, field)) < 1e-13
    for j, g in enumerate(gl.upstream_grads(rollout, field)):
        assert rel_err(g, _closed_form_upstream(kind, rollout, field, j)) < 1e-12


def _closed_form_upstream(kind: str, rollout, field, j: int) -> torch.Tensor:
    """grpo.upstream_grad at step j; the loss is a mean over B samples and n steps."""
    b = rollout.batch
    v = field(b["latents"][:, j], timestep=b["timesteps"][:, j]).detach()
    step_options = {"flow_grpo_sde": dict(noise_level=gl.NOISE_LEVEL, sigma_max=float(b["sigma_max"][0])),
                    "dance_flux": dict(eta=gl.ETA), "cps": dict(noise_level=gl.NOISE_LEVEL)}[kind]
    return grpo.upstream_grad(kind, v, b["latents"][:, j], b["next_latents"][:, j], b["sigmas"][:, j],
                              b["sigmas_next"][:, j], b["log_probs"][:, j], b["advantages"][:, j],
                              normaliser=v.shape[0] * rollout.num_steps, **gl._ppo_kw(rollout), **step_options)


# ----------------------------------------------------------------------------- the properties

@pytest.mark.parametrize("name", EXACT)
def test_exact_property_holds(name):
    r = lp.PROPERTIES[name](EXAMPLES, 0)
    assert r.kind == "exact" and r.name == name
    assert r.passed, r.counterexample
    assert r.examples == EXAMPLES
    assert r.max_rel_err < 1e-10, r.max_rel_err


@pytest.mark.parametrize("name", NEGATIVE)
def test_counterexample_property_finds_and_shrinks(name):
    r = lp.PROPERTIES[name](max(EXAMPLES, 5), 0)
    assert r.kind == "counterexample" and r.passed, r.detail
    assert r.max_rel_err > TOL
    # shrunk to the smallest window, one latent dim, one sample, the first step policy
    assert r.counterexample.startswith("W=3, D=1, kind=flow_grpo_sde, B=1, "), r.counterexample
    if name == "grpo_off_chord":
        assert "delta=[[1]]" in r.counterexample or "delta=[[-1]]" in r.counterexample


# ----------------------------------------------------------------------------- not vacuous

def test_exact_regime_example_has_clipped_and_unclipped_samples_and_sigma_one():
    kind = "flow_grpo_sde"  # the kind with a special case at σ = 1 (sigma_max)
    stats = lp._Stats()
    err = lp.check_grpo_exact(kind, stats=stats)(CASE, 0)
    assert err < 1e-10
    assert 0 < stats.clipped[0] < 1
    assert stats.seen["rollouts from sigma = 1"] == 1 and stats.seen["JAGG windows of >= 3 steps"] == 1
    assert stats.grad_norms[0] > 1e-6


def test_compiled_value_is_bit_identical_with_per_step_forwards():
    # on a curved field whose batched forwards differ from per-step ones in the last bits
    field = gl._seeded(CurvedField, CASE, 0)
    rollout = gl.make_rollout("dance_flux", field, CASE, 0, stream=1, on_chord=False)
    value, _ = gl.eager(rollout, field)
    assert torch.equal(gl.compiled(rollout, field, "fx", per_step=True)[0], value)
    assert rel_err(gl.compiled(rollout, field, "fx")[0], value) < 1e-14


def test_exact_check_fails_on_a_curved_field():
    assert lp.check_grpo_exact("dance_flux", CurvedField)(CASE, 0) > TOL


def test_window2_identity_is_not_trivially_exact():
    # the same rollouts at W = 3 are far from exact: W = 2 is exact because of the knots alone
    case = dict(CASE, W=2, kind="cps", capture="fx")
    assert lp._check_window2(case, 0, lp._Stats()) < 1e-12
    assert lp._check_window2(dict(case, W=3), 0, lp._Stats()) > TOL


@pytest.fixture
def wrong_backward(monkeypatch):
    """KnotAggregate's backward with its composites distorted by ``how``."""
    original = KnotAggregate.backward

    def install(how):
        def wrong(ctx, *grads):
            out = original(ctx, *grads)
            return (out[0], how(out[1])) + out[2:]
        monkeypatch.setattr(KnotAggregate, "backward", staticmethod(wrong))
    return install


def test_checks_catch_a_scaled_aggregation_backward(wrong_backward):
    wrong_backward(lambda gamma: 2 * gamma)
    case = dict(CASE, kind="flow_grpo_sde", capture="fx", spread=0.5)
    assert lp._check_dot_product(case, 0, lp._Stats()) > TOL
    assert lp.check_grpo_exact("cps")(case, 0) > TOL


def test_linearity_catches_a_nonlinear_aggregation_backward(wrong_backward):
    case = dict(CASE, kind="dance_flux", capture="fx", spread=0.9, adv_scale=1.0, a=1.5, b=-0.5)
    assert lp._check_linearity(case, 0, lp._Stats()) < 1e-12
    wrong_backward(lambda gamma: gamma * gamma.abs())
    assert lp._check_linearity(case, 0, lp._Stats()) > TOL


def test_off_chord_states_break_exactness_only_when_moved():
    case = dict(W=3, D=1, kind="cps", B=1, s=0)
    assert lp._check_off_chord(dict(case, delta=[[0]]), 0) < 1e-12
    assert lp._check_off_chord(dict(case, delta=[[1]]), 0) > TOL


# ----------------------------------------------------------------------------- CLI

def test_cli_registers_the_loss_suite():
    losses = list(lp.PROPERTIES) + list(cfg_properties.PROPERTIES)
    assert list(registry("losses")) == losses
    runtime = list(RUNTIME_PROPERTIES) + list(serving_properties.PROPERTIES)
    assert list(registry("runtime")) == runtime
    assert list(registry("all")) == runtime + losses
    assert not set(losses) & set(runtime)


def test_cli_losses_suite_json(tmp_path, capsys, monkeypatch):
    # two real properties (one of each kind) keep the run short; the format is what is checked
    monkeypatch.setattr(lp, "PROPERTIES", {k: lp.PROPERTIES[k] for k in ("grpo_window2_identity", "grpo_curved_field")})
    monkeypatch.setattr(cfg_properties, "PROPERTIES", {})
    path = tmp_path / "verify.json"
    rc = main_verify(["--suite", "losses", "--no-symbolic", "--examples", "3", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "grpo_window2_identity" in out and "counterexamples found and shrunk: 1/1" in out
    entries = json.loads(path.read_text())
    assert [e["name"] for e in entries] == ["grpo_window2_identity", "grpo_curved_field"]
    for e in entries:
        assert {"name", "kind", "passed", "examples", "max_rel_err"} <= set(e)
        assert e["kind"] in ("exact", "counterexample") and e["passed"] is True
        assert isinstance(e["examples"], int) and isinstance(e["max_rel_err"], float)


def test_fields_are_float64():
    # exactness to 1e-12 needs float64 all the way: fields, rollouts and the losses' math
    field = gl._seeded(AffineJacobianField, CASE, 0)
    rollout = gl.make_rollout("cps", field, CASE, 0, stream=1, on_chord=True)
    assert all(p.dtype == torch.float64 for p in field.parameters())
    assert all(t.dtype == torch.float64 for t in rollout.batch.values())
