"""``jaggc.stepwise``: JAGG across a loop's own per-step ``backward()``, against the whole-loss path.

A Flow-GRPO step (SDE log-prob + PPO clip) on a tiny SD3 in float64, 8 trained steps, written as a
trainer writes it: one DiT call and one ``backward()`` per step. Checked, for every backward form
(joint, lowmem, per_window), steps in σ order and in a random order, plain JAGG (``weights="t"``)
and the σ-aware default:

  * ``.grad`` after the last step's backward equals ``@jagg_compile``'s on the summed loss with the
    same windows and weights (float64, <= 1e-13 relative), and at W=2 the unchanged loop's;
  * every value the loop sees (each step's loss) is bit-equal to the unchanged loop's (the same
    call, the same shapes: an interior step's no-grad forward computes what a grad forward does);
  * the DiT passes are the cost model's: per JAGG window 2 grad forwards + W - 2 no-grad forwards and
    ONE DiT backward (per_window and out-of-order lowmem: + 2 re-runs);
  * the low-memory form holds at most two steps' activations (saved tensors), the joint form in a
    random order more;
  * a second trajectory after an optimizer step is right again, and the plan's refusals name the
    step and the fix.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import jaggc
from helpers import grads, rel_err
from jaggc.runtime.memory import track_saved_tensors
from jaggc_studies import example_losses as el

pytestmark = pytest.mark.usefixtures("one_thread")

T = 8
RANDOM_ORDER = [5, 2, 7, 0, 3, 6, 1, 4]


@pytest.fixture(scope="module")
def problem():
    ex = el.build_example("flow_grpo_sd3", num_steps=T, batch=2, seed=0)
    model = ex.model.double()
    batch = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in ex.batch.items()}
    return model, batch


def step_loss(dit, batch, j):
    latents = batch["latents"][:, j]
    noise_pred = dit(hidden_states=latents, timestep=batch["timesteps"][:, j],
                     encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"],
                     return_dict=False)[0]
    _, log_prob, _, _ = el.sde_step_with_logprob(noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                                 batch["next_latents"][:, j], batch["sigma_max"])
    return el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])


def whole_loss(dit, batch):
    return sum(step_loss(dit, batch, j) for j in range(batch["timesteps"].shape[1]))


def per_step_loop(dit, batch, order, jagg=None):
    """The trainer's loop: a DiT call and a backward() per step; the steps' loss values."""
    steps = order if jagg is None else jagg.steps(order, batch["timesteps"])
    values = []
    for j in steps:
        loss = step_loss(dit, batch, j)
        values.append(loss.detach())
        loss.backward()
    return values


def whole_loss_grad(model, batch, window, weights):
    m = copy.deepcopy(model)
    jaggc.jagg_compile(whole_loss, window=window, weights=weights)(m, batch).backward()
    return grads(m)


WEIGHTS = {"t": "t", "default": jaggc.Basis("linear", "t", exact_below=0.5)}


@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("order", ["sigma", "random"])
@pytest.mark.parametrize("backward", ["joint", "lowmem", "per_window"])
def test_grad_equals_whole_loss_jagg(problem, backward, order, weights):
    model, batch = problem
    ref = whole_loss_grad(model, batch, 4, WEIGHTS[weights])
    unchanged = copy.deepcopy(model)
    values_ref = per_step_loop(unchanged, batch, list(range(T)))
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4, weights=WEIGHTS[weights], backward=backward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # lowmem out of order announces its re-runs (tested below)
        values = per_step_loop(m, batch, RANDOM_ORDER if order == "random" else list(range(T)), jagg)
    assert rel_err(grads(m), ref) < 1e-13
    assert rel_err(grads(m), grads(unchanged)) > 1e-4        # JAGG is not the exact gradient here
    by_step = dict(zip(RANDOM_ORDER if order == "random" else range(T), values))
    assert all(torch.equal(by_step[j], values_ref[j]) for j in range(T))
    windows = jagg.report.windows
    assert [w["steps"] for w in windows] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [w["mode"] for w in windows] == (["jagg", "jagg"] if weights == "t" else ["jagg", "exact"])
    c = jagg.counts
    jagg_windows = 2 if weights == "t" else 1
    reruns = 2 * jagg_windows if backward == "per_window" or (backward == "lowmem" and order == "random") else 0
    assert (c.jagg_windows, c.reruns, c.fallbacks) == (jagg_windows, reruns, 0)
    exact_steps = T - 4 * jagg_windows
    assert c.backwards == jagg_windows + exact_steps          # one per JAGG window, one per exact step
    # a knot forwards with grad once: at its step (its graph held), or re-run in its window's
    # backward, a window's two knots batched into one call
    grad_calls = (jagg_windows if reruns else 2 * jagg_windows) + exact_steps
    assert (c.grad_forwards, c.nograd_forwards) == (grad_calls, 2 * jagg_windows + reruns)
    jagg.close()


def test_window_two_is_the_unchanged_loop_bit_for_bit(problem):
    model, batch = problem
    unchanged, m = copy.deepcopy(model), copy.deepcopy(model)
    per_step_loop(unchanged, batch, RANDOM_ORDER)
    jagg = jaggc.stepwise(m, window=2)
    with pytest.warns(UserWarning, match="no window of the declared trajectory runs JAGG"):
        per_step_loop(m, batch, RANDOM_ORDER, jagg)
    assert torch.equal(grads(m), grads(unchanged))
    jagg.close()


def test_second_trajectory_after_an_optimizer_step(problem):
    model, batch = problem
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    jagg = jaggc.stepwise(m, window=4, weights="t")
    per_step_loop(m, batch, list(range(T)), jagg)
    opt.step()
    opt.zero_grad()
    ref = whole_loss_grad(m, batch, 4, "t")     # at the moved parameters
    per_step_loop(m, batch, RANDOM_ORDER, jagg)
    assert rel_err(grads(m), ref) < 1e-13
    assert jagg.counts.trajectories == 2
    jagg.close()


def test_low_memory_form_holds_two_steps_of_activations(problem):
    """Saved-tensor bytes at their peak: the unchanged loop holds one step; lowmem at most two, in
    either order; the joint form in a random order holds every open window's knots."""
    model, batch = problem

    def peak(order, backward=None):
        m = copy.deepcopy(model)
        jagg = None if backward is None else jaggc.stepwise(m, window=4, weights="t", backward=backward)
        with warnings.catch_warnings(), track_saved_tensors() as stats:
            warnings.simplefilter("ignore")
            per_step_loop(m, batch, order, jagg)
        if jagg is not None:
            jagg.close()
        return stats.peak_bytes

    one_step = peak(list(range(T)))
    knots_first = [0, 3, 4, 7, 1, 2, 5, 6]        # both windows' knots visited before their interiors
    for order in (list(range(T)), RANDOM_ORDER, knots_first):
        assert peak(order, "lowmem") <= 2.2 * one_step
        assert peak(order, "per_window") <= 2.2 * one_step
    assert peak(list(range(T)), "joint") <= 2.2 * one_step
    assert peak(knots_first, "joint") > 2.5 * one_step     # four knots of two open windows at once (shared inputs once)


def test_stepwise_returns_the_installed_one_and_close_restores_the_module(problem):
    model, batch = problem
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=3, backward="lowmem")
    assert jaggc.stepwise(m) is jagg
    assert jaggc.stepwise(m, window=3, backward="lowmem") is jagg
    with pytest.raises(jaggc.JaggInputError, match=r"other settings \(\['window'\]"):
        jaggc.stepwise(m, window=4, backward="lowmem")
    jagg.close()
    assert "forward" not in m.__dict__
    assert jaggc.stepwise(m) is not jagg
    jaggc.stepwise(m).close()


def test_calls_outside_a_trajectory_and_without_grad_run_as_written(problem):
    model, batch = problem
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4)
    ref = step_loss(copy.deepcopy(model), batch, 0)
    assert torch.equal(step_loss(m, batch, 0), ref)           # no trajectory declared
    with jagg.trajectory(batch["timesteps"]):
        with torch.no_grad():
            assert torch.equal(step_loss(m, batch, 3), step_loss(copy.deepcopy(model), batch, 3))
    assert jagg.counts.grad_forwards == jagg.counts.nograd_forwards == 0
    jagg.close()


# --- the plan ----------------------------------------------------------------------------------


def test_declared_units_may_be_the_other_convention(problem):
    """DanceGRPO stores int(σ * 1000) and calls the DiT with timesteps / 1000: either may be declared."""
    model, batch = problem
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4, weights="t")
    steps = jagg.steps(RANDOM_ORDER, batch["timesteps"] / 1000)   # σ declared, the SD3 calls take 0..1000
    for j in steps:
        step_loss(m, batch, j).backward()
    assert rel_err(grads(m), whole_loss_grad(model, batch, 4, "t")) < 1e-13
    jagg.close()


def test_plan_refusals_name_the_fix(problem):
    model, batch = problem
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4)
    with pytest.raises(jaggc.JaggInputError, match="same timestep"):
        jagg.trajectory([1000.0, 900.0, 900.0])
    with pytest.raises(jaggc.JaggInputError, match="declares no step"):
        jagg.trajectory([])
    with pytest.raises(jaggc.JaggInputError, match="shape"):
        jagg.trajectory(torch.zeros(2, 3, 4))
    with pytest.raises(jaggc.JaggInputError, match=r"test_stepwise.py:\d+: a grad-enabled call of the DiT at timestep"
                                                   r" .* none of this trajectory's declared steps"):
        with jagg.trajectory(batch["timesteps"][:, :4]):
            step_loss(m, batch, 6)
    with pytest.raises(jaggc.JaggUnsupportedError, match="deterministic basis"):
        jaggc.stepwise(copy.deepcopy(model), weights=jaggc.Basis("randomized"))
    with pytest.raises(jaggc.JaggInputError, match="backward="):
        jaggc.stepwise(copy.deepcopy(model), backward="later")
    with pytest.raises(jaggc.JaggInputError, match="do not apply"):
        jaggc.stepwise(copy.deepcopy(model), options=jaggc.Options(backend="inductor"))
    jagg.close()


def test_cfg_doubled_batch_matches_the_declared_steps(problem):
    """Flow-GRPO calls the DiT on [uncond; cond]: a batch of 2B against a (B, steps) declaration."""
    model, batch = problem
    neg = torch.zeros_like(batch["prompt_embeds"])
    neg_pooled = torch.zeros_like(batch["pooled_prompt_embeds"])

    def cfg_step(dit, j):
        latents = batch["latents"][:, j]
        out = dit(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([batch["timesteps"][:, j]] * 2),
                  encoder_hidden_states=torch.cat([neg, batch["prompt_embeds"]]),
                  pooled_projections=torch.cat([neg_pooled, batch["pooled_prompt_embeds"]]), return_dict=False)[0]
        uncond, text = out.chunk(2)
        v = uncond.detach() + 4.5 * (text - uncond.detach())
        _, log_prob, _, _ = el.sde_step_with_logprob(v, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                                     batch["next_latents"][:, j], batch["sigma_max"])
        return el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])

    ref_model = copy.deepcopy(model)
    jaggc.jagg_compile(lambda dit, b: sum(cfg_step(dit, j) for j in range(T)), window=4, weights="t",
                       dit=ref_model)(ref_model, batch).backward()
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4, weights="t")
    for j in jagg.steps(range(T), batch["timesteps"]):
        cfg_step(m, j).backward()
    assert rel_err(grads(m), grads(ref_model)) < 1e-13
    jagg.close()


def test_a_compiled_per_step_function_warns_once_with_the_way_out(problem):
    """Never silently slow: decorating the per-step function a trainer's loop calls compiles one
    trained call per call (report 1 -> 1, no window): warned once, naming the function's line and
    ``jaggc.stepwise``; the values and gradient are the undecorated loop's."""
    model, batch = problem
    compiled = jaggc.jagg_compile(step_loss, window=4)
    m, unchanged = copy.deepcopy(model), copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for j in range(4):
            compiled(m, batch, j).backward()
    ours = [str(w.message) for w in caught if "one trained DiT call per call" in str(w.message)]
    assert len(ours) == 1, ours
    assert "test_stepwise.py:" in ours[0] and "jaggc.stepwise(transformer" in ours[0]
    assert all(w.filename == __file__ for w in caught if "one trained DiT call per call" in str(w.message))
    per_step_loop(unchanged, batch, range(4))
    assert rel_err(grads(m), grads(unchanged)) < 1e-13


def test_a_whole_trajectory_loss_does_not_warn_per_step(problem):
    model, batch = problem
    compiled = jaggc.jagg_compile(whole_loss, window=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            compiled(copy.deepcopy(model), batch)


def test_re_runs_replay_module_state_autocast_and_dropout():
    """A knot re-run in its window's backward (per_window; lowmem out of order) computes what its
    call computed: the loop switches train/eval before each call (a LoRA with live dropout in
    train mode) and calls odd steps in a bf16 autocast block. Re-runs replay each call's module and
    autocast state and RNG draws, so their gradient equals the held graphs' (joint), float64 for
    the parameters, and the values the loop sees equal the unchanged loop's, seed for seed."""
    import peft

    ex = el.build_example("flow_grpo_sd3", num_steps=T, batch=2, seed=0)
    batch = dict(ex.batch)
    base = peft.get_peft_model(ex.model, peft.LoraConfig(r=4, lora_alpha=4, lora_dropout=0.5, init_lora_weights=False,
                                                         target_modules=["to_q", "to_k", "to_v", "to_out.0"]))

    def loop(dit, order, jagg=None):
        torch.manual_seed(123)
        values = []
        for j in (order if jagg is None else jagg.steps(order, batch["timesteps"])):
            dit.train() if j % 3 else dit.eval()
            with torch.autocast("cpu", torch.bfloat16) if j % 2 else contextlib.nullcontext():
                loss = step_loss(dit, batch, j)
            values.append(loss.detach())
            loss.backward()
        return values

    results = {}
    for backward, order in (("joint", RANDOM_ORDER), ("per_window", RANDOM_ORDER), ("lowmem", RANDOM_ORDER),
                            ("joint", list(range(T))), ("per_window", list(range(T)))):
        m = copy.deepcopy(base)
        jagg = jaggc.stepwise(m, window=4, weights="t", backward=backward)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[backward, tuple(order)] = (loop(m, order, jagg), grads(m), jagg.counts.reruns)
        jagg.close()
    for order in (RANDOM_ORDER, list(range(T))):
        unchanged = copy.deepcopy(base)
        values_ref = loop(unchanged, order)              # the same draws in the same order of calls
        _, joint_grad, _ = results["joint", tuple(order)]
        assert rel_err(grads(unchanged), joint_grad) > 1e-3
        for (backward, key_order), (values, g, reruns) in results.items():
            if key_order != tuple(order):
                continue
            assert all(torch.equal(a, b) for a, b in zip(values, values_ref)), backward
            assert reruns == (0 if backward == "joint" else 4)
            assert rel_err(g, joint_grad) < 1e-6, backward     # bf16 steps: the same bf16 ops, fp32 sums


def test_activation_checkpointing_written_around_the_call(problem):
    """``torch.utils.checkpoint.checkpoint(dit, ...)`` around each step's call: the knots' held graphs
    recompute inside the window's backward (the recomputation is no step of its own) and the
    gradient is the whole-loss JAGG's; the saved activations stay the checkpoint's."""
    from torch.utils.checkpoint import checkpoint

    model, batch = problem

    def checkpointed_step(dit, j):
        latents = batch["latents"][:, j]

        def call(z, t):
            return dit(hidden_states=z, timestep=t, encoder_hidden_states=batch["prompt_embeds"],
                       pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]

        v = checkpoint(call, latents, batch["timesteps"][:, j], use_reentrant=False)
        _, log_prob, _, _ = el.sde_step_with_logprob(v, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                                     batch["next_latents"][:, j], batch["sigma_max"])
        return el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])

    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4, weights="t")
    with track_saved_tensors() as saved:
        for j in jagg.steps(RANDOM_ORDER, batch["timesteps"]):
            checkpointed_step(m, j).backward()
    assert rel_err(grads(m), whole_loss_grad(model, batch, 4, "t")) < 1e-13
    assert jagg.counts.fallbacks == 0 and jagg.counts.jagg_windows == 2
    plain = copy.deepcopy(model)
    with track_saved_tensors() as unchecked:
        per_step_loop(plain, batch, RANDOM_ORDER, jaggc.stepwise(plain, window=4, weights="t"))
    assert saved.peak_bytes < 0.5 * unchecked.peak_bytes
    jagg.close()
    jaggc.stepwise(plain).close()
