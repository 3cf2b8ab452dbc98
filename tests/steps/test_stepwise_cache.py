"""The rollout cache of ``jaggc.stepwise`` (``rollout_cache=True``): the trainers' on-policy epochs.

The rollout is the trainer's own sampling phase (``jaggc_studies.loops.rollouts``: Flow-GRPO through
``pipeline.transformer``, the peft model inside the prepared module, in ``eval()``, ``[neg; pos]``
batches, the samples shuffled and re-batched for training; DanceGRPO and MixGRPO one sample at a time
through the module they train). The install line records it; the loop is the trainer's, unchanged.
Checked:

  * interior steps (and, with the CFG slice, the uncond rows of knots and exact steps) are served from
    the rollout: the forwards counted, the on-policy ratio of every cached step exactly 1;
  * ``.grad`` at each optimizer step equals the same loop without the cache (float64 <= 1e-12; fp32
    <= 5e-6 once an epoch's roundoff moved the parameters) and at W=2 the unchanged loop's (fp32 <= 5e-6:
    the sliced calls' split batch rounds otherwise; measured 1.9e-6 on this machine's CPU);
  * never a stale velocity: an optimizer step, a parameter written, an adapter toggled, train/eval
    of a module with live dropout, autocast changed between rollout and training, a sample missing
    from the rollout: each misses (the forward runs) and the gradient stays right; train/eval of a
    model whose function does not change with it still hits;
  * the bound (``rollout_cache=<bytes>``) holds, is announced when reached, and the bytes per
    sample-step are reported.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import jaggc
from helpers import grads, rel_err
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg, rollouts

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]

FLOW = dict(num_steps=6, batch=2, trajectories=2)
# one optimizer step per epoch: the whole epoch trains on the rollout's parameters
ON_POLICY = fg.TrainConfig(gradient_accumulation_steps=2, max_grad_norm=1e12)


def flow_model(run):
    return run.accelerator.unwrap_model(run.transformer)


def on_each_step(optimizer, fn):
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: fn())


def flow_epoch(run, seed=1, *, between=None):
    """One Flow-GRPO epoch: sampling (recorded), ``between(run)``, training; .grad at each step."""
    seen = []
    on_each_step(run.optimizer.optimizer, lambda: seen.append(grads(flow_model(run)).clone()))
    rollouts.flow_grpo_epoch(run, seed=seed)
    if between is not None:
        between(run)
    fg.train_jaggc(run)
    return seen


def flow_runs(dtype=torch.float32, window=4, **cache):
    settings = dict(window=window, weights="t", cfg_slice=True)
    return (fg.setup(**FLOW, dtype=dtype, config=ON_POLICY, stepwise=dict(settings, rollout_cache=True, **cache)),
            fg.setup(**FLOW, dtype=dtype, config=ON_POLICY, stepwise=settings))


# fp32: the second epoch starts from parameters the first epoch's roundoff moved (measured up to 1.8e-6
# on this machine's CPU); float64 is the exactness check
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-6), (torch.float64, 1e-12)])
def test_flow_grpo_on_policy_epoch_from_the_rollout(dtype, tol):
    cached, plain = flow_runs(dtype)
    for epoch in range(2):        # the second epoch: the slice learned, the rollout at the new parameters
        got, ref = flow_epoch(cached, seed=epoch), flow_epoch(plain, seed=epoch)
        assert len(got) == len(ref) == 1
        assert rel_err(got[0], ref[0]) <= tol
    c = jaggc.stepwise(cached.transformer).counts
    # per trajectory: window [0..3] (its 2 interior steps, and its 2 knots whole: they re-run in the
    # window's backward), window [4, 5] exact; from the second trajectory on (the slice learned) also
    # the uncond rows of the exact steps: every no-grad forward is served
    assert (c.cached_forwards, c.nograd_forwards, c.sliced_steps) == (4 + 3 * (4 + 2), 0, 3 * 4)
    assert jaggc.stepwise(plain.transformer).counts.cached_forwards == 0
    # the loop computes the log-prob as the sampler did: every step served whole is on-policy exactly
    interior = [k for k, (_, ratio, _) in enumerate(cached.seen) if k % 6 in (1, 2)]
    assert all(torch.equal(cached.seen[k][1], torch.ones_like(cached.seen[k][1])) for k in interior)
    report = str(jaggc.stepwise(cached.transformer).report)
    assert "rollout cache: 22 forwards served" in report and "KiB per sample-step" in report
    for run in (cached, plain):
        jaggc.stepwise(run.transformer).close()


def test_window_two_with_the_cache_and_the_slice_is_the_unchanged_loop():
    cached = fg.setup(**FLOW, config=ON_POLICY, stepwise=dict(window=2, cfg_slice=True, rollout_cache=True))
    unchanged = fg.setup(**FLOW, config=ON_POLICY)
    for epoch in range(2):
        got = flow_epoch(cached, seed=epoch)
        seen = []
        on_each_step(unchanged.optimizer.optimizer, lambda: seen.append(grads(flow_model(unchanged)).clone()))
        rollouts.flow_grpo_epoch(unchanged, seed=epoch)
        fg.train_unchanged(unchanged)
        # fp32: the sliced calls' split batch rounds otherwise (measured 1.9e-6 on this machine's CPU)
        assert rel_err(got[0], seen[0]) <= 5e-6
    # W=2: no interior step; the uncond rows of every sliced step are served (the slice learned in
    # the first trajectory: 3 trajectories of 6 steps after it)
    assert jaggc.stepwise(cached.transformer).counts.cached_forwards == 18
    jaggc.stepwise(cached.transformer).close()


def test_the_sampler_in_eval_answers_the_loop_in_train():
    """Flow-GRPO samples in eval() and trains in train(); SD3 and its LoRA have no module whose
    output depends on the mode, so the rows recorded in eval() are the training calls' velocities."""
    cached, _ = flow_runs()
    rollouts.flow_grpo_epoch(cached, seed=0)
    assert flow_model(cached).training          # the sampler's epoch hands the module back in train()
    fg.train_jaggc(cached)
    # two interior steps and two knots per trajectory, and the second trajectory's 2 sliced uncond rows
    assert jaggc.stepwise(cached.transformer).counts.cached_forwards == 4 + 4 + 2
    jaggc.stepwise(cached.transformer).close()


# --- never a stale velocity -----------------------------------------------------------------------

def _optimizer_step(run):
    model = flow_model(run)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 1e-3)
    run.optimizer.optimizer.step()
    run.optimizer.optimizer.zero_grad()


def _write_parameter(run):
    with torch.no_grad():
        next(p for p in flow_model(run).parameters() if p.requires_grad).mul_(1.0)   # same values, but written


def _live_dropout(run):
    for m in flow_model(run).modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1                  # train() in the loop makes them draw


def _training_calls_recorded(run, context):
    """The cache made of the training calls themselves, called as a rollout (no grad, outside a
    trajectory) in ``context``: the same inputs, recorded in another state (or, with a null
    context, in the loop's: the control)."""
    model = flow_model(run)
    jaggc.stepwise(run.transformer).cache.clear()
    with torch.no_grad(), context:
        for sample in run.samples_batched:
            embeds = torch.cat([run.train_neg_prompt_embeds[:run.batch], sample["prompt_embeds"]])
            pooled = torch.cat([run.train_neg_pooled_prompt_embeds[:run.batch], sample["pooled_prompt_embeds"]])
            for j in range(run.num_train_timesteps):
                model(hidden_states=torch.cat([sample["latents"][:, j]] * 2),
                      timestep=torch.cat([sample["timesteps"][:, j]] * 2), encoder_hidden_states=embeds,
                      pooled_projections=pooled, return_dict=False)


def _missing_sample(run):
    # the first training batch's second sample never came out of this rollout
    other = fg.setup(**FLOW, dtype=torch.float64, config=ON_POLICY, seed=5)
    rollouts.flow_grpo_epoch(other, seed=9)
    for key in run.samples_batched[0]:
        run.samples_batched[0][key][1] = other.samples_batched[0][key][1]


STALE = {
    "optimizer step": (_optimizer_step, 0),
    "parameter written": (_write_parameter, 0),
    "live dropout in train": (_live_dropout, 0),
    # the second batch only: its 2 interior steps and 2 knots, and its 2 sliced exact steps' uncond rows
    "sample missing": (_missing_sample, 4 + 2),
    "adapter toggled": (lambda run: _training_calls_recorded(run, flow_model(run).disable_adapter()), 0),
    "autocast changed": (lambda run: _training_calls_recorded(run, torch.autocast("cpu", torch.bfloat16)), 0),
    "control: the same calls recorded": (lambda run: _training_calls_recorded(run, contextlib.nullcontext()), 4 + 4 + 2),
}


@pytest.mark.parametrize("case", sorted(STALE))
def test_no_stale_velocity(case):
    """Each change between the rollout and training makes the cache miss (the control, the training
    calls recorded in the loop's own state, hits); .grad equals the same loop without the cache,
    at the parameters the training ran at."""
    change, hits = STALE[case]
    cached, plain = flow_runs(torch.float64)
    for run in (cached, plain):
        rollouts.flow_grpo_epoch(run, seed=0)
    if case == "sample missing":
        _missing_sample(cached)
        plain.samples_batched = [dict(s) for s in cached.samples_batched]
    else:
        change(cached)
        if case in ("optimizer step", "parameter written", "live dropout in train"):
            change(plain)
    seen = {}
    for name, run in (("cached", cached), ("plain", plain)):
        seen[name] = []
        on_each_step(run.optimizer.optimizer, lambda name=name, run=run: seen[name].append(grads(flow_model(run)).clone()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # live dropout turns the slice off, with a note
            fg.train_jaggc(run)
    assert jaggc.stepwise(cached.transformer).counts.cached_forwards == hits, case
    if case != "live dropout in train":          # dropout draws: no two runs compare
        assert rel_err(seen["cached"][0], seen["plain"][0]) <= 1e-12
    for run in (cached, plain):
        jaggc.stepwise(run.transformer).close()


def test_the_bound_holds_and_is_announced():
    row = None
    probe = fg.setup(**FLOW, config=ON_POLICY, stepwise=dict(window=4, weights="t", rollout_cache=True))
    rollouts.flow_grpo_epoch(probe, seed=0)
    cache = jaggc.stepwise(probe.transformer).cache
    row = cache.stats.bytes_per_row
    assert cache.nbytes == len(cache) * row > 0
    # CFG: two rows per sample-step; the rollout of 2 batches x 2 samples x 7 sampling steps
    assert len(cache) == 2 * 2 * 2 * 7
    jaggc.stepwise(probe.transformer).close()
    bound = 10 * 4 * row                      # 10 calls of 4 rows of 7 x 2 batches
    small = fg.setup(**FLOW, config=ON_POLICY, stepwise=dict(window=4, weights="t", rollout_cache=bound))
    with pytest.warns(UserWarning, match="the rollout cache is full"):
        rollouts.flow_grpo_epoch(small, seed=0)
    cache = jaggc.stepwise(small.transformer).cache
    assert cache.nbytes <= bound and cache.stats.skipped_rows == 2 * 2 * 2 * 7 - len(cache)
    fg.train_jaggc(small)
    figures = jaggc.stepwise(small.transformer).report.cache
    assert figures["bytes_per_sample_step"] == 2 * row and figures["max_bytes"] == bound
    jaggc.stepwise(small.transformer).close()


def test_bad_bound_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(jaggc.JaggInputError, match="rollout_cache=-1"):
        jaggc.stepwise(model, rollout_cache=-1)
    with pytest.raises(jaggc.JaggInputError, match="stepwise\\(rollout_cache=True\\) records the rollout itself"):
        jaggc.stepwise(model, options=jaggc.Options(rollout_cache=jaggc.RolloutCache(model)))


# --- DanceGRPO and MixGRPO: one sample at a time, the module they train ------------------------------

FLUX_LOOPS = {"dance_grpo": (dg, rollouts.dance_grpo_epoch, dict(num_steps=10, samples=2, gradient_accumulation_steps=2)),
              "mix_grpo": (mg, rollouts.mix_grpo_epoch, dict(samples=2, gradient_accumulation_steps=2))}


@pytest.mark.parametrize("name", sorted(FLUX_LOOPS))
def test_flux_loops_on_policy_from_the_rollout(name):
    module, epoch, kwargs = FLUX_LOOPS[name]
    runs = {c: module.setup(**kwargs, stepwise=dict(window=4, weights="t", rollout_cache=c)) for c in (True, False)}
    seen = {c: [] for c in runs}
    for c, run in runs.items():
        on_each_step(run.optimizer, lambda c=c, run=run: seen[c].append(grads(run.transformer).clone()))
        epoch(run, seed=3)
        module.train_jaggc(run)
    assert len(seen[True]) == 1 and rel_err(seen[True][0], seen[False][0]) <= 1e-6
    c = jaggc.stepwise(runs[True].transformer).counts
    assert c.cached_forwards == 2 * (2 + 2) and jaggc.stepwise(runs[False].transformer).counts.cached_forwards == 0
    assert all(torch.equal(r, torch.ones_like(r)) for _, r, _ in runs[True].seen)      # on-policy: exactly 1
    for run in runs.values():
        jaggc.stepwise(run.transformer).close()
