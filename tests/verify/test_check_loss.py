"""``jaggc.verify.check_loss``: translation validation of ``@jagg_compile`` on a user's own loss.

  * a loss jaggc has never seen (Flow-GRPO-like: CFG concatenation with the uncond half detached,
    a KL-like term against a no-grad reference call, per-step sigma weighting, 10 shift-3 steps)
    passes in float64 with max rel. err < 1e-10 for windows 2, 3, 4 in under a minute, and the same
    call with ``weights="index"`` fails with a shrunk counterexample;
  * every trainer shape of ``jaggc_studies.trainer_shapes`` passes (peft adapters followed by the stand-in);
  * the silently wrong result of the real-trainer issue (the intercept path serving an adapter-off
    output as the policy's) is caught: with module state left out of the recording's key and the
    replay handing back the window outputs, the intercept path fails the check (with the replay
    handing back the recording's values, as it does since issue 28, it passes);
  * ``assert_loss_exact`` raises with the table; ``jaggc verify --loss module:factory`` runs it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from jaggc_studies import example_losses, trainer_shapes
from jaggc.frontends import intercept
from jaggc.runtime import module_state
from jaggc.verify import assert_loss_exact, check_loss
from jaggc.verify.cli import main_verify

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")


def unseen_loss(transformer, batch):
    num_steps = batch["latents"].shape[1]
    embeds = torch.cat([batch["negative_prompt_embeds"], batch["prompt_embeds"]])
    pooled = torch.cat([batch["negative_pooled_prompt_embeds"], batch["pooled_prompt_embeds"]])
    total = 0.0
    for j in range(num_steps):
        z, t = batch["latents"][:, j], batch["timesteps"][:, j]
        out = transformer(hidden_states=torch.cat([z, z]), timestep=torch.cat([t, t]), encoder_hidden_states=embeds,
                          pooled_projections=pooled, return_dict=False)[0]
        uncond, text = out.chunk(2)
        v = uncond.detach() + 4.5 * (text - uncond.detach())
        with torch.no_grad():
            ref = transformer(hidden_states=z, timestep=t, encoder_hidden_states=batch["prompt_embeds"],
                              pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
        sigma = batch["sigmas"][:, j].view(-1, 1, 1, 1)
        dt = batch["sigmas_next"][:, j].view(-1, 1, 1, 1) - sigma
        mean = z + dt * v
        std = 0.5 * torch.sqrt(-dt)
        log_prob = (-((batch["next_latents"][:, j] - mean) ** 2) / (2 * std**2)).mean(dim=(1, 2, 3))
        ratio = torch.exp(log_prob - batch["log_probs"][:, j])
        adv = batch["advantages"][:, j]
        policy = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)).mean()
        kl = ((v - ref) ** 2).mean()
        total = total + batch["sigmas"][:, j].mean() * (policy + 0.01 * kl)     # per-step sigma weighting
    return total / num_steps


@pytest.fixture(scope="module")
def unseen():
    ex = example_losses.cfg_sd3(num_steps=10, batch=2, seed=3)
    return ex.model, ex.batch


def test_unseen_loss_passes_in_float64(unseen):
    model, batch = unseen
    check = check_loss(unseen_loss, model, batch)
    assert check.passed, check.table()
    assert check.max_rel_err < 1e-10 and check.windows == (2, 3, 4) and check.capture_path == "fx"
    assert check.examples == 25 and all(v < 1e-4 for v in check.real_dit.values())


def test_index_weights_fail_with_a_shrunk_counterexample(unseen):
    model, batch = unseen
    check = check_loss(unseen_loss, model, batch, weights="index")
    assert not check.passed and check.max_rel_err > 1e-4
    assert check.counterexample and "window=" in check.counterexample
    with pytest.raises(AssertionError, match=r"(?s)check_loss: FAILED .* counterexample \(shrunk\): window="):
        assert_loss_exact(unseen_loss, model, batch, weights="index", examples=5)


@pytest.mark.parametrize("name", list(trainer_shapes.SHAPES))
def test_trainer_shapes_pass(name):
    shape = trainer_shapes.SHAPES[name]()
    check = check_loss(shape.loss_fn, shape.model, shape.args, examples=6)
    assert check.passed, check.table()
    assert check.max_rel_err < 1e-10


def test_catches_the_adapter_state_bug(monkeypatch):
    """With the rollout cache keyed by inputs only (the bug the real-trainer issue found), the
    windows' interior values pair the adapter-off reference output with the policy's call. The
    intercept replay now hands the loss the recording's own output values (issue 28), so that bug
    no longer reaches the result; with the replay handing back the window outputs, as it did when
    the bug was found, check_loss fails."""
    shape = trainer_shapes.flow_grpo_sd3()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert check_loss(shape.loss_fn, shape.model, shape.args, examples=4, capture="intercept").passed
        monkeypatch.setattr(module_state.ModuleState, "output_key", lambda self: ())
        assert check_loss(shape.loss_fn, shape.model, shape.args, examples=4, capture="intercept").passed
        monkeypatch.setattr(intercept, "_with_recorded_values", lambda values, outs: outs)
        broken = check_loss(shape.loss_fn, shape.model, shape.args, examples=4, capture="intercept")
    assert not broken.passed and broken.max_rel_err > 1e-3


def factory():
    ex = example_losses.flow_grpo_sd3(num_steps=6, batch=2, seed=0)
    return ex.loss_fn, ex.model, ex.batch


def test_cli(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main_verify(["--loss", f"{__name__}:factory", "--examples", "4", "--json", str(out)]) == 0
    assert "check_loss: PASSED" in capsys.readouterr().out
    import json

    entry = json.loads(out.read_text())[0]
    assert entry["passed"] and entry["kind"] == "loss" and entry["max_rel_err"] < 1e-10
    assert main_verify(["--loss", "no_such_module:f"]) == 2


FACTORY_MODULE = '''
from jaggc_studies import example_losses


def factory():
    ex = example_losses.flow_grpo_sd3(num_steps=6, batch=2, seed=0)
    return ex.loss_fn, ex.model, ex.batch


def with_window():
    ex = example_losses.flow_grpo_sd3(num_steps=6, batch=2, seed=0)
    return ex.loss_fn, ex.model, ex.batch, dict(window=4)
'''


def test_cli_finds_a_module_in_the_current_directory_and_refuses_owned_options(tmp_path):
    """``jaggc verify --loss mymod:factory`` run from the module's folder (no PYTHONPATH), as
    ``python -m`` users expect; a factory whose compile options hold ``window`` gets a jaggc message
    naming it (it was a raw ``TypeError: ... multiple values for keyword argument 'window'``)."""
    import os
    import subprocess
    import sys

    (tmp_path / "mymod.py").write_text(FACTORY_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # `python -c` would put '' on sys.path; -I (isolated) starts as the `jaggc` console script does:
    # without the current directory on it
    script = [sys.executable, "-I", "-c", "import sys; from jaggc.verify.cli import main_verify; "
                                          "sys.exit(main_verify(sys.argv[1:]))"]
    ok = subprocess.run(script + ["--loss", "mymod:factory", "--examples", "2", "--windows", "2,3"],
                        cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "check_loss: PASSED" in ok.stdout
    owned = subprocess.run(script + ["--loss", "mymod:with_window", "--examples", "2"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert owned.returncode == 2
    assert "compile option(s) ['window'] are check_loss's own" in owned.stderr and "Traceback" not in owned.stderr
