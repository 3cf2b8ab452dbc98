"""Off-policy serving (``rollout_cache="first_order"``): interior steps after optimizer steps since the rollout.

The trainers' loops step the optimizer inside an epoch, so their later trajectories are off-policy and
the plain rollout cache stops serving. With ``first_order`` an interior step's output is its recorded
one plus its window's knots' change since the recording (runtime/first_order.py), the knots forwarded
first where the loop has not reached them. Checked on MixGRPO's, DanceGRPO's and Flow-GRPO's loops
(an optimizer step after every sample or half-epoch) and verl-omni's engine loop:

  * every off-policy interior step served, no interior forward run; the counts of served steps and
    early knot forwards;
  * the outputs the loop sees at a served step equal the formula computed apart from jaggc, from the
    rollout's outputs, the knots' outputs now (a copy of the model at the trajectory's parameters, on
    the stored states) and the declared timesteps (fp32, 1e-5 relative);
  * the gradient stays close to the forwards' (cosine > 0.9999 on these loops: the served outputs move the
    upstream gradients only at second order), and the mode is off unless asked: ``rollout_cache=True``
    serves nothing off-policy;
  * it never serves what it must not: a parameter written outside an optimizer step, more than
    ``max_optimizer_steps`` steps, a loop whose knot call has other inputs than the recording's (the window
    runs exactly, announced);
  * verl-omni's old-log-prob pass (the loop itself under ``no_grad``) records like a rollout: its update
    pass is served from it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jaggc
from helpers import grads, rel_err
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg, rollouts, verl_omni as vo

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


def _flux_run(module, epoch, cache, **kwargs):
    run = module.setup(**kwargs, stepwise=dict(window=4, weights="t", rollout_cache=cache))
    grads_at_steps = []
    run.optimizer.register_step_pre_hook(lambda o, a, k: grads_at_steps.append(grads(run.transformer).clone()))
    epoch(run, seed=3)
    return run, grads_at_steps


LOOPS = {"mix_grpo": (mg, rollouts.mix_grpo_epoch, dict(samples=3, gradient_accumulation_steps=1)),
         "dance_grpo": (dg, rollouts.dance_grpo_epoch, dict(num_steps=10, samples=3, gradient_accumulation_steps=1))}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_off_policy_interior_steps_are_served(name):
    module, epoch, kwargs = LOOPS[name]
    runs = {}
    for cache in ("first_order", True):
        run, seen = _flux_run(module, epoch, cache, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module.train_jaggc(run)
        runs[cache] = (run, seen, vars(jaggc.stepwise(run.transformer).counts).copy())
        jaggc.stepwise(run.transformer).close()
    (_, served, c), (_, forwarded, ref) = runs["first_order"], runs[True]
    # trajectory 1 on-policy from the cache, as the plain cache; 2 and 3 after 1 and 2 optimizer steps:
    # their windows' 2 interior steps each served first-order, none forwarded
    assert c["cached_forwards"] == ref["cached_forwards"] > 0
    assert (c["first_order_served"], c["nograd_forwards"]) == (4, 0)
    assert ref["nograd_forwards"] == 4 and ref["first_order_served"] == 0
    assert c["prefetched_knots"] >= 1 and c["first_order_missed"] == 0
    # each off-policy window's knots run as one forward (serving.py): one forward fewer per window
    assert c["batched_knot_forwards"] == 2 and c["grad_forwards"] == ref["grad_forwards"] - 2, (c, ref)
    assert torch.equal(served[0], forwarded[0])               # on-policy: the same
    for a, b in zip(served[1:], forwarded[1:]):
        assert _cosine(a, b) > 0.9999 and rel_err(a, b) > 0   # first-order: close, not equal


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_knots_forwarded_together_give_the_gradient_of_knots_forwarded_one_by_one(name):
    """An off-policy window's knots run as ONE forward of their batch-concatenated inputs (MixGRPO: the loop's
    call of the first knot takes the other along; DanceGRPO's random order: an interior step reached first
    fetches both). ``Options(batch_knots=False)`` runs them one by one: the same gradient up to fp32
    summation order (a weight gradient summed over both knots' rows in one product instead of two; <= 256
    terms at 6e-8 each bounds it well under 1e-5), one forward fewer per window."""
    module, epoch, kwargs = LOOPS[name]
    runs = {}
    for together in (True, False):
        run = module.setup(**kwargs, stepwise=dict(window=4, weights="t", rollout_cache="first_order",
                                                   options=jaggc.Options(batch_knots=together)))
        seen = []
        run.optimizer.register_step_pre_hook(lambda o, a, k: seen.append(grads(run.transformer).clone()))
        epoch(run, seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module.train_jaggc(run)
        runs[together] = (seen, vars(jaggc.stepwise(run.transformer).counts).copy())
        jaggc.stepwise(run.transformer).close()
    (together, c), (apart, ref) = runs[True], runs[False]
    assert c["batched_knot_forwards"] == 2 and ref["batched_knot_forwards"] == 0, (c, ref)
    # one forward fewer per off-policy window, and for the on-policy trajectory's knots re-run in its backward
    # (batched too by default: rerun.py)
    assert c["grad_forwards"] == ref["grad_forwards"] - 3 and c["first_order_served"] == ref["first_order_served"] == 4
    assert len(together) == len(apart) == 3
    for a, b in zip(together, apart):
        assert rel_err(a, b) < 1e-5


def _below_min_sigma(name: str, together: bool, change=None):
    """``name``'s loop with every window below ``min_sigma`` (1.0): its off-policy interior steps run their
    forwards; ((gradients at each optimizer step), counts, warnings)."""
    module, epoch, kwargs = LOOPS[name]
    run = module.setup(**kwargs, stepwise=dict(window=4, weights="t", rollout_cache=jaggc.FirstOrder(min_sigma=1.0),
                                               options=jaggc.Options(batch_knots=together)))
    seen = []
    run.optimizer.register_step_pre_hook(lambda o, a, k: seen.append(grads(run.transformer).clone()))
    epoch(run, seed=3)
    if change is not None:
        change(run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.train_jaggc(run)
    counts = vars(jaggc.stepwise(run.transformer).counts).copy()
    jaggc.stepwise(run.transformer).close()
    return seen, counts, [str(w.message) for w in caught]


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_interior_forwards_below_min_sigma_run_together(name):
    """A window off-policy below ``min_sigma`` runs its interior steps' forwards: as ONE forward without grad
    (the loop's first interior call takes the other along, on the recording's inputs of its samples; the
    loop's call of the other takes that output, its rows checked). ``batch_knots=False``: one by one, the same
    gradient up to fp32 summation order (as the knots above), one forward more per off-policy window."""
    together, c, _ = _below_min_sigma(name, True)
    apart, ref, _ = _below_min_sigma(name, False)
    assert c["first_order_served"] == ref["first_order_served"] == 0
    assert (c["batched_interior_forwards"], ref["batched_interior_forwards"]) == (2, 0), (c, ref)
    assert (c["nograd_forwards"], ref["nograd_forwards"]) == (2, 4), (c, ref)
    assert len(together) == len(apart) == 3
    for a, b in zip(together, apart):
        assert rel_err(a, b) < 1e-5


def test_an_interior_step_called_on_other_inputs_runs_its_own_forward():
    """The loop calls an interior step that was forwarded with the other on other states than the
    recording's: its own forward runs (announced), and the gradient is the one-by-one loop's on those states."""
    def change(run):
        sample = run.samples_batched_list[1]
        changed = sample["latents"].clone()
        changed[:, run.train_timesteps[2]] += 1e-3      # the second interior step's stored state
        sample["latents"] = changed

    together, c, notes = _below_min_sigma("mix_grpo", True, change)
    apart, ref, _ = _below_min_sigma("mix_grpo", False, change)
    assert any("has other inputs, so its own forward ran too" in n for n in notes), notes
    assert c["batched_interior_forwards"] == 2 and c["nograd_forwards"] == ref["nograd_forwards"] - 1 == 3, (c, ref)
    for a, b in zip(together, apart):
        assert rel_err(a, b) < 1e-5


def test_served_outputs_are_the_formula_computed_apart():
    """MixGRPO, σ order: the loop-visible outputs of the interior steps of the off-policy trajectory
    against recorded + (1 − λ)(v_a now − v_a then) + λ(v_b now − v_b then), each term computed here."""
    run = mg.setup(samples=2, gradient_accumulation_steps=1, stepwise=dict(window=4, weights="t",
                                                                            rollout_cache="first_order"))
    calls = []           # (grad enabled, hidden_states, timestep, output) of every call through the module

    def hook(module, args, kwargs, output):
        calls.append((torch.is_grad_enabled(), kwargs["hidden_states"].detach().clone(),
                      kwargs["timestep"].detach().clone(), output[0].detach().clone()))

    handle = run.transformer.register_forward_hook(hook, with_kwargs=True)
    snapshots, marks = [], []

    def after_step(optimizer, args, kwargs):
        snapshots.append(copy.deepcopy(run.transformer))
        marks.append(len(calls))

    run.optimizer.register_step_post_hook(after_step)
    rollouts.mix_grpo_epoch(run, seed=3)
    rollout = [c for c in calls if not c[0]]
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mg.train_jaggc(run)
    handle.remove()
    counts = jaggc.stepwise(run.transformer).counts
    assert counts.first_order_served == 2
    steps = run.train_timesteps
    second = calls[marks[0]:marks[1]]           # the off-policy trajectory's calls, in σ order
    assert len(second) == len(steps)
    model = snapshots[0]                        # the parameters the second trajectory ran at
    # a copy's forward is its class's (stepwise_install.py): the knots' outputs now, apart from jaggc
    jaggc_free = copy.deepcopy(model)

    def recorded(state):
        return next(out for _, z, _, out in rollout if torch.equal(z, state))

    (_, za, ta, _), (_, zb, tb, _) = second[0], second[-1]
    va_now, vb_now = _flux_call(jaggc_free, run, za, ta), _flux_call(jaggc_free, run, zb, tb)
    for _, zk, tk, served in second[1:-1]:
        lam = (tk.double() - ta.double()) / (tb.double() - ta.double())
        by_hand = (recorded(zk).double() + (1 - lam) * (va_now.double() - recorded(za).double())
                   + lam * (vb_now.double() - recorded(zb).double()))
        assert rel_err(served, by_hand) < 1e-5
    jaggc.stepwise(run.transformer).close()


def _flux_call(model, run, state, t):
    """The MixGRPO sampler's DiT call on ``state`` at ``t`` (the rollout's conditioning), no grad."""
    sample = run.samples_batched_list[0]
    with torch.no_grad():
        return model(hidden_states=state, encoder_hidden_states=sample["encoder_hidden_states"], timestep=t,
                     guidance=torch.tensor([3.5], dtype=torch.bfloat16), txt_ids=sample["text_ids"],
                     pooled_projections=sample["pooled_prompt_embeds"], img_ids=sample["image_ids"],
                     joint_attention_kwargs=None, return_dict=False)[0]


def _flow_grpo_two_halves(caches=("first_order", True), options=None, **where) -> tuple:
    """Flow-GRPO's loop under accelerate, CFG and the slice, two optimizer steps per epoch, with
    ``rollout_cache="first_order"`` and ``True``: ((grads at each step, counts) of each)."""
    config = fg.TrainConfig(gradient_accumulation_steps=1, max_grad_norm=1e12)
    out = {}
    for cache in caches:
        run = fg.setup(num_steps=6, batch=2, trajectories=2, config=config, **where,
                       stepwise=dict(window=4, weights="t", cfg_slice=True, rollout_cache=cache,
                                     **({} if options is None else dict(options=options))))
        model = run.accelerator.unwrap_model(run.transformer)
        seen = []
        run.optimizer.optimizer.register_step_pre_hook(lambda o, a, k, seen=seen, m=model: seen.append(grads(m).clone()))
        rollouts.flow_grpo_epoch(run, seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fg.train_jaggc(run)
        out[cache] = (seen, vars(jaggc.stepwise(run.transformer).counts).copy(), run.accelerator.mixed_precision)
        jaggc.stepwise(run.transformer).close()
    return tuple(out[c] for c in caches)


def test_flow_grpo_with_cfg_serves_its_second_half():
    """Flow-GRPO's loop under accelerate, CFG and the slice, two optimizer steps per epoch: the second
    minibatch's interior steps are served first-order."""
    (served, c, _), (forwarded, ref, _) = _flow_grpo_two_halves()
    # 2 interior forwards served, and the two knots' rows without grad (the slice's) run as one forward,
    # as their rows with grad do (serving.py)
    assert c["first_order_served"] == 2 and c["batched_knot_forwards"] == 1, c
    assert c["nograd_forwards"] == ref["nograd_forwards"] - 3 and c["grad_forwards"] == ref["grad_forwards"] - 1, (c, ref)
    assert torch.equal(served[0], forwarded[0]) and _cosine(served[1], forwarded[1]) > 0.9999


def test_knots_under_the_cfg_slice_forwarded_together_give_the_gradient_of_one_by_one():
    """Under the CFG slice an off-policy window's two knots run as two forwards (their rows without grad,
    then their rows with grad) instead of four; ``Options(batch_knots=False)`` runs them one by one: the same
    gradient up to fp32 summation order (as for MixGRPO and DanceGRPO above)."""
    (together, c, _), = _flow_grpo_two_halves(caches=("first_order",))
    (apart, ref, _), = _flow_grpo_two_halves(caches=("first_order",), options=jaggc.Options(batch_knots=False))
    assert c["batched_knot_forwards"] == 1 and ref["batched_knot_forwards"] == 0, (c, ref)
    assert c["first_order_served"] == ref["first_order_served"] == 2
    for a, b in zip(together, apart):                # (the on-policy half's knot re-runs batch, or not, too)
        assert rel_err(a, b) < 1e-5


def test_flow_grpo_in_bf16_under_a_live_cpu_autocast_serves_its_second_half():
    """The GPU form on the CPU: bf16 base weights, fp32 LoRA, accelerate's bf16 mixed precision (a live CPU
    autocast where Flow-GRPO's GPU run has a CUDA one), CFG and the slice; two optimizer steps per epoch.
    The rollout is recorded under the same autocast, so the second minibatch is served first-order."""
    from jaggc_studies.trainers.sizes import Where

    (served, c, precision), (forwarded, ref, _) = _flow_grpo_two_halves(where=Where("tiny", dtype=torch.bfloat16))
    assert precision == "bf16"
    assert c["first_order_served"] == 2 and c["nograd_forwards"] == ref["nograd_forwards"] - 3, (c, ref)
    assert torch.equal(served[0], forwarded[0])
    # measured 0.990 (fp32, the test above: > 0.9999): the correction is the difference of the knots' bf16
    # outputs now and then, each carrying bf16's rounding (docs/stepwise.md, "In bf16"); the bound says
    # serving keeps the gradient's direction, not that bf16 serving is as close as fp32's
    assert _cosine(served[1], forwarded[1]) > 0.98 and rel_err(served[1], forwarded[1]) > 0


def test_a_parameter_written_outside_an_optimizer_step_is_never_served():
    run, _ = _flux_run(mg, rollouts.mix_grpo_epoch, "first_order", samples=3, gradient_accumulation_steps=1)
    first = run.optimizer.step

    def step_then_write(*args, **kwargs):
        out = first(*args, **kwargs)
        with torch.no_grad():
            next(run.transformer.parameters()).mul_(1.0)       # an in-place write the optimizer did not make
        return out

    run.optimizer.step = step_then_write
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mg.train_jaggc(run)
    c = jaggc.stepwise(run.transformer).counts
    assert c.first_order_served == 0 and c.nograd_forwards == 4
    jaggc.stepwise(run.transformer).close()


def test_more_optimizer_steps_than_the_bound_are_not_served():
    run, _ = _flux_run(mg, rollouts.mix_grpo_epoch, jaggc.FirstOrder(max_optimizer_steps=1), samples=3,
                       gradient_accumulation_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mg.train_jaggc(run)
    c = jaggc.stepwise(run.transformer).counts
    # the second trajectory is 1 step after the rollout (served), the third 2 steps (forwarded)
    assert (c.first_order_served, c.nograd_forwards) == (2, 2)
    assert "at most 1 optimizer steps" in str(jaggc.stepwise(run.transformer).report)
    jaggc.stepwise(run.transformer).close()


def test_a_knot_called_on_other_inputs_runs_its_window_exactly():
    """The loop calls the knot it was forwarded for on other states than the recording's: announced,
    the window runs exactly (its served interior steps re-run with grad)."""
    run, _ = _flux_run(mg, rollouts.mix_grpo_epoch, "first_order", samples=2, gradient_accumulation_steps=1)
    last = run.train_timesteps[-1]
    sample = run.samples_batched_list[1]
    original = sample["latents"]
    changed = original.clone()
    changed[:, last] += 1e-3                   # the knot's stored state, not the one the sampler saw
    sample["latents"] = changed
    with pytest.warns(UserWarning, match="forwarded before the loop reached it"):
        mg.train_jaggc(run)
    c = jaggc.stepwise(run.transformer).counts
    assert c.fallbacks == 1 and c.first_order_served == 2
    jaggc.stepwise(run.transformer).close()


@pytest.mark.parametrize("cache", ["first_order", True])
def test_verl_omni_old_log_prob_pass_records(cache):
    """The old-log-prob pass (the same loop under no_grad, before the update) records; the update pass
    is served from it: every interior step, exactly (the parameters are the pass's)."""
    engines = {}
    for c in (cache, None):
        settings = dict(window=4, weights="t") if c is None else dict(window=4, weights="t", rollout_cache=c)
        engine, data = vo.setup(num_timesteps=4, batch=4, stepwise=settings)
        seen = []
        engine.optimizer.register_step_pre_hook(lambda o, a, k, seen=seen, m=engine.module: seen.append(grads(m).clone()))
        vo.train_batch(engine, data, vo.train_jaggc)
        engines[c] = (seen, vars(jaggc.stepwise(engine.module).counts).copy())
        jaggc.stepwise(engine.module).close()
    (got, counts), (ref, plain) = engines[cache], engines[None]
    assert counts["cached_forwards"] == 8 and counts["nograd_forwards"] == 0 and plain["nograd_forwards"] == 4
    # served interiors are the pass's outputs; the knots re-run batched in the window's backward: fp32 roundoff
    assert rel_err(got[0], ref[0]) < 1e-5


def _guarded_mix(max_served_error: float, on_drift: str = "adapt"):
    """MixGRPO, 4 samples, an optimizer step after each, the guard probing every second trajectory:
    trajectory 0 (on-policy) and 2 (two steps after the rollout) probed, 1 and 3 served where serving goes on."""
    guard = jaggc.Guard(every=2, on_drift=on_drift)
    run = mg.setup(samples=4, gradient_accumulation_steps=1, stepwise=dict(
        window=4, weights="t", rollout_cache=jaggc.FirstOrder(max_served_error=max_served_error), guard=guard))
    calls, marks = [], []        # (state, output) of every call through the module; calls before each step
    run.optimizer.register_step_post_hook(lambda o, a, k: marks.append(len(calls)))

    def hook(module, args, kwargs, output):
        calls.append((kwargs["hidden_states"].detach().clone(), output[0].detach().clone()))

    handle = run.transformer.register_forward_hook(hook, with_kwargs=True)
    rollouts.mix_grpo_epoch(run, seed=3)
    rollout = list(calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mg.train_jaggc(run)
    handle.remove()
    sw = jaggc.stepwise(run.transformer)
    out = dict(run=run, counts=vars(sw.counts).copy(), figures=list(sw.served_figures), report=str(sw.report),
               stopped=sw.first_order_stopped, rollout=rollout, calls=calls, marks=marks,
               warnings=[str(w.message) for w in caught])
    sw.close()
    return out


def test_the_guard_measures_what_serving_would_have_given():
    """A probed off-policy trajectory runs its interior forwards and measures the served outputs against
    them: the figure equals |served − true| / |true| computed here from the rollout's outputs and a copy
    of the model at the trajectory's parameters; unprobed off-policy trajectories are served."""
    r = _guarded_mix(max_served_error=0.05)
    assert r["counts"]["first_order_served"] == 4 and r["stopped"] is None      # trajectories 1 and 3
    (fig,) = r["figures"]
    assert fig.trajectory == 2 and fig.steps == 2
    run = r["run"]
    sample, steps = run.samples_batched_list[2], run.train_timesteps
    states = [sample["latents"][:, j] for j in steps]
    times = [sample["timesteps"][:, j] for j in steps]
    # the outputs the loop saw in trajectory 2 (a probed trajectory is not served: its forwards' outputs)
    seen = r["calls"][r["marks"][1]:r["marks"][2]]

    def output_of(state, calls):
        return next(out for z, out in calls if torch.equal(z, state)).double()

    recorded = [output_of(state, r["rollout"]) for state in states]
    now = [output_of(state, seen) for state in states]
    ta, tb = times[0].double(), times[-1].double()
    diff = norm = change = 0.0
    for k in (1, 2):
        lam = (times[k].double() - ta) / (tb - ta)
        served = recorded[k] + (1 - lam) * (now[0] - recorded[0]) + lam * (now[-1] - recorded[-1])
        diff += float((served - now[k]).pow(2).sum())
        norm += float(now[k].pow(2).sum())
        change += float((now[k] - recorded[k]).pow(2).sum())
    by_hand, change_by_hand = (diff / norm) ** 0.5, (diff / change) ** 0.5
    # fp32 outputs: |served − true| carries the outputs' roundoff, ~1e-7 |true|, against a figure ~1e-3
    assert 0 < fig.rel_error and abs(fig.rel_error - by_hand) <= 1e-3 * by_hand + 1e-6, (fig, by_hand)
    assert abs(fig.change_error - change_by_hand) <= 1e-3 * change_by_hand + 1e-6, (fig, change_by_hand)
    assert "serving measured by the guard on 1 probes" in r["report"]


def test_the_guard_stops_serving_above_its_bound():
    """``on_drift="adapt"``: a probe above ``max_served_error`` stops serving (announced), the later
    off-policy trajectory runs its forwards; ``"warn"`` warns and serves on."""
    r = _guarded_mix(max_served_error=1e-9)
    assert r["counts"]["first_order_served"] == 2 and r["stopped"] is not None      # trajectory 1 only
    assert "STOPPED" in r["report"] and any("off-policy serving stopped" in w for w in r["warnings"])
    w = _guarded_mix(max_served_error=1e-9, on_drift="warn")
    assert w["counts"]["first_order_served"] == 4 and w["stopped"] is None
    assert any("serving goes on" in m for m in w["warnings"])
