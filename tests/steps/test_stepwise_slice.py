"""The CFG slice of ``jaggc.stepwise`` (``cfg_slice=True``, jaggc/steps/slicing.py).

Flow-GRPO's loop (accelerate, peft LoRA, CFG on ``[neg; pos]`` with the uncond half detached, the KL
reference) learns in its first trajectory that the uncond rows' cotangent is zero, and from the
second on runs them without grad: the knots' and exact steps' calls become a no-grad call on the
uncond rows and a call with grad on the cond rows. Checked:

  * W=2: the gradient and every value are bit for bit those of a plain loop that splits its CFG call
    by hand as the slice does (fp32); against the unchanged loop the only difference is the split
    batch's roundoff (a half-size call's rows may round differently): the parameters after every
    optimizer step within 1e-6 (measured: equal bit for bit on one CPU, 1e-8 apart on another),
    every log-prob and ratio within 1e-6 and the loss within 1e-7 (measured up to 1.2e-7 and
    1.5e-8), under accelerate's bf16 forward and fp16 GradScaler too;
  * W=4: ``.grad`` at each optimizer step equals the same loop without the slice (float64 <= 1e-12)
    and ``@jagg_compile`` on the trajectory's whole loss with the same windows (fp32 <= 5e-6: the
    sums run in another order; measured 1e-6 to 2e-6 on this machine's CPU, less on another), for
    every backward form, in σ order and in a random order;
  * a row block learned zero whose cotangent is NOT zero later (the loop stops detaching the uncond
    half) is recovered exactly: counted, warned once, ``.grad`` equal to the unsliced run's; the
    next trajectory is unsliced again;
  * live dropout turns the slice off, with a note.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jaggc
from helpers import grads, rel_err
from jaggc import models
from jaggc_studies import example_losses as el
from jaggc_studies.loops import flow_grpo as fg

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]

FLOW = dict(num_steps=6, batch=2, trajectories=3)


def flow_model(run):
    return run.accelerator.unwrap_model(run.transformer)


def trained_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def on_each_step(optimizer, fn):
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: fn())


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_window_two_with_the_slice_is_the_unchanged_loop(precision):
    a = fg.setup(**FLOW, mixed_precision=precision)
    b = fg.setup(**FLOW, mixed_precision=precision, stepwise=dict(window=2, cfg_slice=True))
    fg.train_unchanged(a)
    fg.train_jaggc(b)
    assert rel_err(trained_params(flow_model(b)), trained_params(flow_model(a))) <= 1e-6
    assert len(a.seen) == len(b.seen) == 18
    # after the first optimizer step the fp32 parameters are 1e-8 apart (the split batch's roundoff):
    # log-prob and ratio (both ~1) then differ by an ulp or two; the loss, a mean of advantage x
    # (ratio - 1)-sized terms, inherits that absolute error (1e-8 on values of 1e-7 after cancellation)
    worst_logprob_ratio = max(float((x - y).abs().max()) for sa, sb in zip(a.seen, b.seen) for x, y in zip(sa[:2], sb[:2]))
    worst_loss = max(float((sa[2] - sb[2]).abs()) for sa, sb in zip(a.seen, b.seen))
    assert worst_logprob_ratio <= 1e-6 and worst_loss <= 1e-7, (worst_logprob_ratio, worst_loss)
    c = jaggc.stepwise(b.transformer).counts
    # the first trajectory learns, the next two run every step sliced (W=2: every window exact)
    assert (c.sliced_steps, c.recoveries, c.exact_steps, c.backwards) == (12, 0, 18, 18)
    assert "row block(s) [0] of 2 without grad" in str(jaggc.stepwise(b.transformer).report)
    jaggc.stepwise(b.transformer).close()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-6), (torch.float64, 1e-12)])
def test_window_four_with_the_slice_is_jagg(dtype, tol):
    """Each trajectory's .grad at its optimizer step: against the loop without the slice and
    against jagg_compile on its whole loss (each knot its own call, as the loop makes it)."""
    config = fg.TrainConfig(max_grad_norm=1e12)
    runs = {s: fg.setup(**FLOW, dtype=dtype, config=config, stepwise=dict(window=4, weights="t", cfg_slice=s))
            for s in (False, True)}
    seen = {s: [] for s in runs}
    compiled = []
    for s, run in runs.items():
        on_each_step(run.optimizer.optimizer, lambda s=s, run=run: seen[s].append(grads(flow_model(run)).clone()))

    def against_compiled():
        run = runs[True]
        sample = run.samples_batched[len(compiled)]
        m = copy.deepcopy(flow_model(run))
        for p in m.parameters():
            p.grad = None
        jaggc.jagg_compile(lambda mm, smp: fg.reference_loss(run, smp, mm), dit=m, window=4, weights="t",
                           options=jaggc.Options(split_batches=False, batch_knots=False))(m, sample).backward()
        compiled.append(rel_err(grads(flow_model(run)), grads(m)))

    on_each_step(runs[True].optimizer.optimizer, against_compiled)
    for run in runs.values():
        fg.train_jaggc(run)
    assert len(seen[True]) == len(seen[False]) == 3
    assert max(rel_err(a, b) for a, b in zip(seen[True], seen[False])) <= tol
    assert max(compiled) <= max(tol, 5e-6), compiled
    c = jaggc.stepwise(runs[True].transformer).counts
    # windows of 4 (knots 0 and 3) and 2 (exact): 4 sliced calls per trajectory after the first
    assert (c.sliced_steps, c.recoveries, c.jagg_windows) == (8, 0, 3)
    for run in runs.values():
        jaggc.stepwise(run.transformer).close()


# --- a CFG loop written here: the loop decides per trajectory whether the uncond half is detached ----

T = 8
RANDOM_ORDER = [5, 2, 7, 0, 3, 6, 1, 4]


@pytest.fixture(scope="module")
def problem():
    ex = el.build_example("flow_grpo_sd3", num_steps=T, batch=2, seed=0)
    model = ex.model.double()
    batch = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in ex.batch.items()}
    g = torch.Generator().manual_seed(3)
    batch["neg_embeds"] = torch.randn(batch["prompt_embeds"].shape, generator=g, dtype=torch.float64)
    batch["neg_pooled"] = torch.randn(batch["pooled_prompt_embeds"].shape, generator=g, dtype=torch.float64)
    return model, batch


def cfg_step_loss(dit, batch, j, detach_uncond=True):
    latents = batch["latents"][:, j]
    out = dit(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([batch["timesteps"][:, j]] * 2),
              encoder_hidden_states=torch.cat([batch["neg_embeds"], batch["prompt_embeds"]]),
              pooled_projections=torch.cat([batch["neg_pooled"], batch["pooled_prompt_embeds"]]), return_dict=False)[0]
    uncond, cond = out.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    noise_pred = uncond + 4.5 * (cond - uncond)
    _, log_prob, _, _ = el.sde_step_with_logprob(noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                                 batch["next_latents"][:, j], batch["sigma_max"])
    return el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])


def split_by_hand(dit):
    """The DiT with its CFG call split as the slice splits it: the uncond rows without grad, the
    cond rows with grad, put back together in row order (a plain loop a user could write)."""
    def call(**kw):
        halves = [{k: v.chunk(2)[i] if torch.is_tensor(v) else v for k, v in kw.items()} for i in range(2)]
        with torch.no_grad():
            uncond = dit(**halves[0])[0]
        return (torch.cat([uncond, dit(**halves[1])[0]]),)
    return call


def cfg_loop(dit, batch, order, jagg=None, detach_uncond=True, call=None):
    for p in dit.parameters():
        p.grad = None
    steps = order if jagg is None else jagg.steps(order, batch["timesteps"])
    values = {}
    for j in steps:
        loss = cfg_step_loss(dit if call is None else call, batch, j, detach_uncond)
        values[j] = loss.detach()
        loss.backward()
    return grads(dit).clone(), values


def test_window_two_with_the_slice_is_the_loop_split_by_hand_bit_for_bit(problem):
    """fp32: the slice's only change to the values is the split batch (a half-size call's rows may
    round differently from the full call's: on a 3M SD3 LoRA 1.8e-7, which an optimizer step carries
    into the parameters). A plain loop that splits the CFG call by hand, as the slice does, makes the
    same calls: W=2 (every window exact) then gives jaggc's gradient and values bit for bit."""
    model, batch = problem
    model = copy.deepcopy(model).float()
    batch = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in batch.items()}
    by_hand, sliced = copy.deepcopy(model), copy.deepcopy(model)
    jagg = jaggc.stepwise(sliced, window=2, cfg_slice=True)
    steps = list(range(T))
    first, _ = cfg_loop(by_hand, batch, steps)                 # the slice is learned in the first trajectory
    assert torch.equal(cfg_loop(sliced, batch, steps, jagg)[0], first)
    ref, ref_values = cfg_loop(by_hand, batch, steps, call=split_by_hand(by_hand))
    got, values = cfg_loop(sliced, batch, steps, jagg)
    assert jagg.counts.sliced_steps == T
    assert torch.equal(got, ref)
    assert all(torch.equal(values[j], ref_values[j]) for j in steps)
    jagg.close()


@pytest.mark.parametrize("order", ["sigma", "random"])
@pytest.mark.parametrize("backward", ["joint", "lowmem", "per_window"])
def test_every_backward_form_and_order(problem, backward, order):
    model, batch = problem
    steps = RANDOM_ORDER if order == "random" else list(range(T))
    plain, sliced = copy.deepcopy(model), copy.deepcopy(model)
    jaggs = {m: jaggc.stepwise(m, window=4, weights="t", backward=backward, cfg_slice=m is sliced)
             for m in (plain, sliced)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # lowmem out of order announces its re-runs
        for _ in range(2):                     # the first trajectory learns the slice
            ref, ref_values = cfg_loop(plain, batch, steps, jaggs[plain])
            got, values = cfg_loop(sliced, batch, steps, jaggs[sliced])
    assert rel_err(got, ref) <= 1e-12
    assert max(float((values[j] - ref_values[j]).abs() / ref_values[j].abs()) for j in range(T)) <= 1e-12
    c = jaggs[sliced].counts
    assert c.sliced_steps > 0 and c.recoveries == 0
    # a sliced re-run computes only the rows with grad: no more forwards than the plain run's
    assert c.reruns == jaggs[plain].counts.reruns
    for jagg in jaggs.values():
        jagg.close()


@pytest.mark.parametrize("window", [2, 4])
def test_a_row_learned_zero_that_carries_gradient_is_recovered(problem, window):
    """Trajectory 1 detaches the uncond half (learned: no gradient there); trajectory 2 does not:
    its sliced knots and exact steps get a nonzero cotangent on rows run without grad, which re-run
    with grad in the step's or window's backward. .grad equals the unsliced run's (W=2: the unchanged
    loop's), one warning, counted; trajectory 3 (still not detaching) runs unsliced."""
    model, batch = problem
    plain, sliced = copy.deepcopy(model), copy.deepcopy(model)
    jagg_plain = jaggc.stepwise(plain, window=window, weights="t")
    jagg = jaggc.stepwise(sliced, window=window, weights="t", cfg_slice=True)
    steps = list(range(T))
    cfg_loop(sliced, batch, steps, jagg)
    before = jagg.counts.sliced_steps
    assert before == 0 and jagg.report.cfg_slice                  # learned, not used yet
    with pytest.warns(UserWarning, match="re-ran with grad, so the gradient is exact"):
        got, values = cfg_loop(sliced, batch, steps, jagg, detach_uncond=False)
    ref, ref_values = cfg_loop(plain, batch, steps, jagg_plain, detach_uncond=False)
    assert rel_err(got, ref) <= 1e-12
    if window == 2:
        unchanged, _ = cfg_loop(copy.deepcopy(model), batch, steps, detach_uncond=False)
        assert rel_err(got, unchanged) <= 1e-12
    c = jagg.counts
    knots_and_exact = T if window == 2 else 4
    assert c.sliced_steps == c.recoveries == knots_and_exact
    assert jagg.report.cfg_slice == []                             # relearned: every row carries gradient
    cfg_loop(sliced, batch, steps, jagg, detach_uncond=False)
    assert jagg.counts.sliced_steps == knots_and_exact            # the third trajectory ran unsliced
    jagg.close()
    jagg_plain.close()


def test_live_dropout_turns_the_slice_off(problem):
    model, batch = problem
    m = copy.deepcopy(model)
    m.transformer_blocks[0].attn.to_out[1].p = 0.1        # a dropout with p > 0, in train mode
    m.train()
    jagg = jaggc.stepwise(m, window=4, weights="t", cfg_slice=True)
    cfg_loop(m, batch, list(range(T)), jagg)
    with pytest.warns(UserWarning, match="the CFG slice is off while the DiT has live dropout"):
        cfg_loop(m, batch, list(range(T)), jagg)
    assert jagg.counts.sliced_steps == 0
    jagg.close()


def test_a_call_of_the_declared_batch_is_never_sliced(problem):
    """No CFG (the call's batch is the declared one): nothing to learn, nothing sliced."""
    model, batch = problem
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4, weights="t", cfg_slice=True)
    for _ in range(2):
        for j in jagg.steps(range(T), batch["timesteps"]):
            out = m(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                    encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"],
                    return_dict=False)[0]
            (out ** 2).mean().backward()
    assert jagg.counts.sliced_steps == 0 and jagg.report.cfg_slice == []
    jagg.close()


def test_the_slice_on_a_real_sd3_call_keeps_its_output_structure():
    """A sliced call's output, put back together, has the DiT's structure: return_dict=True gives a
    Transformer2DModelOutput whose .sample is the whole batch."""
    model = models.sd3("tiny", seed=0)
    cond = models.sd3_conditioning(model, 2).kwargs
    z = torch.randn(models.sd3_latent_shape(model, 2))
    t = torch.tensor([700.0, 700.0])
    jagg = jaggc.stepwise(model, window=2, cfg_slice=True)
    kw = {k: torch.cat([v, v]) for k, v in cond.items()}
    outs = []
    for _ in range(2):
        for _j in jagg.steps([0], t[:, None]):
            out = model(hidden_states=torch.cat([z, z]), timestep=torch.cat([t, t]), **kw)
            outs.append(out.sample.detach())
            out.sample[2:].pow(2).mean().backward()
    assert type(out).__name__ == "Transformer2DModelOutput" and out.sample.shape[0] == 4
    assert jagg.counts.sliced_steps == 1
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    jagg.close()
