"""The frameworks' loops (``jaggc_studies.loops``: Flow-Factory, verl-omni) in one process, with the user's two lines.

Flow-Factory's ``GRPOTrainer.optimize`` (accelerate on the CPU, a tiny SD3, a random subset of 4 or 6
of its steps in ``randperm`` order, CFG with grad on both halves, the KL reference under
``use_ref_parameters``, two trajectories per sync, clip + step + zero_grad at ``sync_gradients`` in
the last step's body):

  * the change is two lines (measured from the two loops' source);
  * W=2 under accelerate's live CPU bf16 autocast with latents stored in bf16, and under fp16 (an fp16
    autocast forward, a GradScaler in ``accelerator.backward``) with latents in fp16 (the timestep
    cast to them: plan.py's cast match), LoRA (KL via peft's ``disable_adapter``) and full fine-tune
    (KL via a ``.data`` swap of every trained parameter into the reference and back, between each
    step's forward and its backward): the clipped gradient, the parameters after the step, every
    logged value and every per-step value equal the unchanged loop's bit for bit;
  * W=4 ``weights="t"`` over 6 steps (a window of 4 and one of 2) in float32: ``.grad`` at the step
    equals the JAGG computed apart from jaggc (``reference_jagg``) to 1e-5 (measured 2-3e-7: the
    steps' gradients summed in another order), LoRA and full fine-tune.

Under the bf16 autocast the W=4 comparison is not made against the whole-loss reference: its one
backward accumulates the steps' weight gradients in bf16 at the autocast cache's cast of each
trained weight, where the loop's per-step backward adds each step's in float32 (.grad): the
unchanged loop and its own whole loss differ by 3e-3 there (measured), which a 1e-5 bound cannot
separate from JAGG.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jaggc
from helpers import grads, reference_jagg, rel_err
from jaggc_studies import loops
from jaggc_studies.loops import flow_factory as ff

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]


def trained(run) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in run.adapter.get_trainable_parameters()])


def at_step(run) -> dict:
    """The clipped gradient, read in a pre-hook of the real optimizer step."""
    seen = {}
    run.optimizer.optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.setdefault("grads", []).append(grads(run.accelerator.unwrap_model(run.transformer))))
    return seen


@pytest.mark.parametrize("name", ["flow_factory"])
def test_the_change_is_two_lines(name):
    assert loops.lines_changed(name) == 2
    diff = loops.user_diff(name)
    assert diff[0] == "+" + loops.INSTALL and all("jaggc" in line for line in diff if line.startswith("+"))


@pytest.mark.parametrize("lora,latent_dtype", [(True, torch.bfloat16), (True, torch.float16),
                                               (False, torch.bfloat16)])
def test_flow_factory_window_two_is_the_unchanged_loop(lora, latent_dtype):
    precision = "fp16" if latent_dtype == torch.float16 else "bf16"
    kwargs = dict(lora=lora, latent_dtype=latent_dtype, mixed_precision=precision, num_sde_steps=4)
    a, b = ff.setup(**kwargs), ff.setup(**kwargs, stepwise=dict(window=2))
    assert a.adapter.scheduler.train_timesteps != sorted(a.adapter.scheduler.train_timesteps)
    seen_a, seen_b = at_step(a), at_step(b)
    logged_a, logged_b = ff.train_unchanged(a), ff.train_jaggc(b)
    assert len(seen_a["grads"]) == len(seen_b["grads"]) == 1
    assert torch.equal(seen_a["grads"][0], seen_b["grads"][0])
    assert torch.equal(trained(a), trained(b))
    assert len(logged_a) == len(logged_b) == 1 and sorted(logged_a[0]) == sorted(logged_b[0])
    assert all(torch.equal(logged_a[0][k], logged_b[0][k]) for k in logged_a[0])
    assert len(a.seen) == len(b.seen) == 8
    assert all(torch.equal(x, y) for sa, sb in zip(a.seen, b.seen) for x, y in zip(sa, sb))
    jaggc.stepwise(b.transformer).close()


@pytest.mark.parametrize("lora", [True, False])
def test_flow_factory_window_four_is_jagg(lora):
    run = ff.setup(lora=lora, latent_dtype=torch.float32, mixed_precision="no", num_sde_steps=6,
                   training_args=ff.TrainingArguments(max_grad_norm=1e12), stepwise=dict(window=4, weights="t"))
    model = run.accelerator.unwrap_model(run.transformer)
    args = run.training_args
    perm = torch.randperm(len(run.samples), generator=torch.Generator().manual_seed(args.seed))
    batches = [ff.stack([run.samples[i] for i in perm[k:k + args.per_device_batch_size]])
               for k in range(0, len(run.samples), args.per_device_batch_size)]
    errors = []

    def check(opt, a, k):
        total = 0
        for batch in batches:
            ref = copy.deepcopy(model)
            total = total + reference_jagg(lambda m: ff.reference_loss(run, batch, m), (ref,), ref, 4)[1]
        errors.append(rel_err(grads(model), total))

    run.optimizer.optimizer.register_step_pre_hook(check)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no fallback: every window as planned
        ff.train_jaggc(run)
    assert len(errors) == 1 and errors[0] <= 1e-5, errors
    c = jaggc.stepwise(run.transformer).counts
    assert (c.jagg_windows, c.exact_steps, c.backwards) == (2, 4, 6)
    jaggc.stepwise(run.transformer).close()


# --- verl-omni's engine loop ------------------------------------------------------------------------

def test_verl_omni_the_change_is_two_lines():
    assert loops.lines_changed("verl_omni") == 2


def test_verl_omni_window_two_is_the_unchanged_loop():
    from jaggc_studies.loops import verl_omni as vo

    (ea, da), (eb, db) = vo.setup(), vo.setup(stepwise=dict(window=2))
    seen = {}
    ea.optimizer.register_step_pre_hook(lambda o, a, k: seen.__setitem__("a", grads(ea.module)))
    eb.optimizer.register_step_pre_hook(lambda o, a, k: seen.__setitem__("b", grads(eb.module)))
    ra, rb = vo.train_batch(ea, da, vo.train_unchanged), vo.train_batch(eb, db, vo.train_jaggc)
    assert torch.equal(seen["a"], seen["b"])
    assert all(torch.equal(p, q) for p, q in zip(ea.module.parameters(), eb.module.parameters()))
    assert ra["loss"] == rb["loss"] and torch.equal(ra["old_log_probs"], rb["old_log_probs"])
    jaggc.stepwise(eb.module).close()


def test_verl_omni_window_four_is_jagg():
    """Two micro-batches of 2 rows, 4 steps each, every row its own SDE window (per-sample timesteps)."""
    from jaggc_studies.loops import verl_omni as vo

    engine, data = vo.setup(stepwise=dict(window=4, weights="t"), max_grad_norm=1e12)
    assert not torch.equal(data["all_timesteps"][0], data["all_timesteps"][1])
    errors, old = [], {}

    def spy(self, d, loss_function, forward_only):
        if not forward_only:
            old["data"] = d
        return vo.train_jaggc(self, d, loss_function, forward_only)

    def check(opt, a, k):
        ref = copy.deepcopy(engine.module)
        _, g = reference_jagg(lambda m: vo.reference_loss(engine, old["data"], m), (ref,), ref, 4)
        errors.append(rel_err(grads(engine.module), g))

    engine.optimizer.register_step_pre_hook(check)
    vo.train_batch(engine, data, spy)
    assert len(errors) == 1 and errors[0] <= 1e-5, errors
    c = jaggc.stepwise(engine.module).counts
    assert (c.jagg_windows, c.backwards, c.trajectories) == (2, 2, 4)     # the old-log-prob pass: 2 more
    jaggc.stepwise(engine.module).close()


def test_verl_omni_kept_outputs_keep_no_activations():
    """The engine keeps each step's log-prob and sample mean attached in ``meta_info`` until the batch
    ends: nothing of jaggc's windows stays alive through them (saved activations when the pass
    returns: none, as in the unchanged loop); the peak is the joint form's two knots' graphs."""
    from jaggc_studies.loops import verl_omni as vo

    unchanged = vo.saved_activations(None, num_timesteps=8)
    joint = vo.saved_activations(dict(window=4), num_timesteps=8)
    assert unchanged["kept"] == joint["kept"] == 0
    assert unchanged["peak"] < joint["peak"] <= 2 * unchanged["peak"]


def test_docs_show_each_framework_loop_s_diff_as_measured():
    """docs/trainers.md's diff blocks after the trainers' three are ``user_diff`` of the frameworks' loops."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "trainers.md").read_text()
    shown = re.findall(r"^```diff\n(.*?)^```", text, re.M | re.S)
    n = len(loops.LOOPS)
    assert [b.rstrip("\n") for b in shown[n:n + 2]] == ["\n".join(loops.user_diff(k)) for k in loops.FRAMEWORK_LOOPS]


def test_jaggc_trainers_times_the_frameworks_loops(capsys):
    """``jaggc trainers --frameworks``: each loop's lines changed and its CPU-time ratio beside its
    cost model (tiny, one round: the figures' form, not their values); an unknown loop is refused."""
    import argparse
    import re

    from jaggc_studies import trainer_check

    parser = argparse.ArgumentParser()
    trainer_check.add_arguments(parser)
    args = parser.parse_args(["--names", "none", "--loops", "", "--frameworks", "verl_omni", "--speed-size", "tiny",
                              "--rounds", "1"])
    assert trainer_check.main(args) == 0
    out = capsys.readouterr().out
    assert "verl_omni: 2 lines changed" in out
    assert re.search(r"verl_omni\s+\d+\.\d+x \[[\d.]+-[\d.]+\]\s+cost model \d+\.\d+x", out), out
    assert "flow_factory" not in out
    with pytest.raises(SystemExit, match="--frameworks 'bogus'"):
        trainer_check.main(parser.parse_args(["--names", "none", "--loops", "", "--frameworks", "bogus"]))
