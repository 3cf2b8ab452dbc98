"""Host syncs of ``jaggc.stepwise`` per DiT call (issue 52), counted on the device stand-in.

Every read of a device value on the host (``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``,
``nonzero``) stops the CPU until the GPU has caught up, so the next step's kernels cannot be queued
meanwhile. ``tests/device_standin.py`` runs the tiny SD3 with tensors that claim a device and hold
CPU data, and counts the reads made by jaggc's own frames. Flow-GRPO's loop, W=4, T=8 (two JAGG
windows, weights="t"), per trajectory:

  * timesteps passed as views of the declared tensor (``sample["timesteps"][:, j]``): 3 reads (the
    declaration, read once to plan the windows; one read of the inputs' finiteness flags per
    window): 0.375 per call;
  * timesteps passed as fresh tensors (``.clone()``, CFG's ``torch.cat``): the first trajectory
    reads each call's timestep (8 + 3); from the second on the steps are predicted in σ order and
    checked on the device: 3 again;
  * with the rollout cache: each of the 8 lookups reads its matching rows (one read, which carries
    every pending flag; the first carries the declaration too): 8 per 8 trained calls (the 8
    rollout calls recorded read nothing);
  * with the CFG slice (second trajectory on): the declaration, one read per window (its recovery
    flags with the pending ones), the slice learner's one: 4.

Before (the same harness, views): 10 per trajectory (each call's timestep, the declaration, the
ledger's canaries); issue 52 measured 2.1 per call, 6.1 with the cache (every input copied to the host
per lookup and recording). A probed trajectory of ``Guard(every=1)``: 5 (its statistics' 2 reads). ``.grad`` is the one of the same loop on plain CPU
tensors: fp32, the stand-in runs each aten op on its own (decompositions and the attention kernel
differ from the CPU's fused paths), measured 2e-7 to 6e-7 relative; bound 1e-5.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

import jaggc
from device_standin import counting_host_reads, on_standin_device, standin, standin_module, to_cpu
from jaggc_studies import example_losses as el

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]

T, W = 8, 4
PACKAGE = Path(jaggc.__file__).parent


@pytest.fixture(scope="module")
def problem():
    ex = el.build_example("flow_grpo_sd3", num_steps=T, batch=2, seed=0)
    batch = dict(ex.batch)
    g = torch.Generator().manual_seed(3)
    batch["neg_embeds"] = torch.randn(batch["prompt_embeds"].shape, generator=g)
    batch["neg_pooled"] = torch.randn(batch["pooled_prompt_embeds"].shape, generator=g)
    return ex.model, batch


def step_loss(dit, batch, j, mode):
    latents = batch["latents"][:, j]
    if mode == "cfg":
        out = dit(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([batch["timesteps"][:, j]] * 2),
                  encoder_hidden_states=torch.cat([batch["neg_embeds"], batch["prompt_embeds"]]),
                  pooled_projections=torch.cat([batch["neg_pooled"], batch["pooled_prompt_embeds"]]),
                  return_dict=False)[0]
        uncond, cond = out.chunk(2)
        noise_pred = uncond.detach() + 4.5 * (cond - uncond.detach())
    else:
        t = batch["timesteps"][:, j]
        noise_pred = dit(hidden_states=latents, timestep=t.clone() if mode == "fresh" else t,
                         encoder_hidden_states=batch["prompt_embeds"],
                         pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
    _, log_prob, _, _ = el.sde_step_with_logprob(noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                                 batch["next_latents"][:, j], batch["sigma_max"])
    return el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])


def rollout(dit, batch):
    with torch.no_grad():
        for j in range(T):
            dit(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"],
                return_dict=False)


def trajectory(dit, batch, jagg, mode, order=range(T)):
    for p in dit.parameters():
        p.grad = None
    if jagg.cache is not None:
        rollout(dit, batch)
    for j in jagg.steps(order, batch["timesteps"]):
        step_loss(dit, batch, j, mode).backward()


def grads(dit) -> torch.Tensor:
    return torch.cat([to_cpu(p.grad).flatten() for p in dit.parameters() if p.grad is not None])


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


def counted(problem, modes, **settings):
    """Host reads per trajectory on the stand-in, one trajectory per mode; and .grad after the last
    one against the same trajectories on plain CPU tensors."""
    model, batch = problem
    settings = dict(window=W, weights="t", **settings)
    dit = standin_module(copy.deepcopy(model))
    on_device = {k: (standin(v) if torch.is_tensor(v) else v) for k, v in batch.items()}
    reads = []
    with on_standin_device(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jagg = jaggc.stepwise(dit, **settings)
        for mode in modes:
            with counting_host_reads(PACKAGE) as r:
                trajectory(dit, on_device, jagg, mode)
            reads.append(dict(r.sites))
        got = grads(dit)
    plain = copy.deepcopy(model)
    ref_jagg = jaggc.stepwise(plain, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in modes:
            trajectory(plain, batch, ref_jagg, mode)
    assert rel_err(got, grads(plain)) <= 1e-5
    assert jagg.counts == ref_jagg.counts
    return reads, jagg


def total(sites: dict) -> int:
    return sum(sites.values())


def test_flow_grpo_reads_once_per_window(problem):
    reads, jagg = counted(problem, ["fresh", "fresh", "view"])
    first, predicted, views = reads
    # the first trajectory reads each call's timestep; then the steps are predicted (checked on the
    # device) or found by their place in the declared tensor: the declaration + one read per window
    assert total(first) == T + 3
    assert total(predicted) == total(views) == 3, (predicted, views)
    assert total(predicted) / T <= 1 and total(views) / T <= 1
    assert jagg.counts.jagg_windows == 6 and jagg.counts.fallbacks == 0


def test_rollout_cache_reads_once_per_lookup(problem):
    reads, jagg = counted(problem, ["view"], rollout_cache=True)
    (sites,) = reads
    # 8 lookups (interior steps and knots), each one read of its matching rows; the declaration is
    # read with the first lookup (plan.py: lazy), so the trajectory's reads are its calls'
    assert total(sites) == T, sites
    assert jagg.counts.cached_forwards == T and jagg.counts.nograd_forwards == 0
    assert total(sites) / T <= 1


def test_cfg_slice_reads_once_per_window(problem):
    reads, jagg = counted(problem, ["cfg", "cfg"], cfg_slice=True)
    learned, sliced = reads
    # the declaration, one read per window (the slice's recovery flags with the pending ones), the
    # slice learner's at the end
    assert total(sliced) == 4, sliced
    assert total(sliced) / T <= 1
    assert jagg.counts.sliced_steps == 4 and jagg.counts.recoveries == 0


# --- a wrong prediction is never silent (plain CPU tensors) ---------------------------------------

def test_a_loop_that_leaves_sigma_order_is_re_read_before_the_window_backward(problem):
    """The first trajectory visits in σ order, the second in another: its predicted steps are checked
    before the window's backward and re-read on the host; each visit goes under its own step (the knot
    taken for an interior step re-runs in the window's backward), so .grad is the JAGG of a loop
    read on the host all along. The third trajectory (after one out of order) predicts nothing."""
    model, batch = problem
    dit = copy.deepcopy(model)
    jagg = jaggc.stepwise(dit, window=W, weights="t")
    trajectory(dit, batch, jagg, "fresh")
    order = [1, 0, 2, 3, 5, 4, 6, 7]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trajectory(dit, batch, jagg, "fresh", order)
    ref = copy.deepcopy(model)
    read_on_host = jaggc.stepwise(ref, window=W, weights="t")
    trajectory(ref, batch, read_on_host, "fresh", order)
    assert rel_err(grads(dit), grads(ref)) <= 1e-6
    assert jagg.counts.fallbacks == 0 and jagg.counts.jagg_windows == 4 and jagg.counts.reruns == 1
    trajectory(dit, batch, jagg, "fresh", order)
    assert jagg.counts.reruns == 1 and rel_err(grads(dit), grads(ref)) <= 1e-6
    jagg.close()
    read_on_host.close()


def test_steps_taken_for_a_jagg_window_that_are_an_exact_one_run_exactly(problem):
    """σ-aware placement (the default): window 1 (σ < 0.5) runs exactly. A second trajectory that
    visits window 1 first: its calls, taken for window 0's steps, are re-read before window 0's
    backward and go under their own (exact) steps, each through its own graph; .grad is that of the
    same order read on the host, with no fallback."""
    model, batch = problem
    dit = copy.deepcopy(model)
    jagg = jaggc.stepwise(dit, window=W)
    trajectory(dit, batch, jagg, "fresh")
    order = [4, 5, 6, 7, 0, 1, 2, 3]
    trajectory(dit, batch, jagg, "fresh", order)
    ref = copy.deepcopy(model)
    read_on_host = jaggc.stepwise(ref, window=W)
    trajectory(ref, batch, read_on_host, "fresh", order)
    assert [w.exact for w in read_on_host._last.plan.windows] == [False, True]
    assert rel_err(grads(dit), grads(ref)) <= 1e-6
    assert jagg.counts.fallbacks == 0
    jagg.close()
    read_on_host.close()


def test_an_undeclared_timestep_in_a_predicted_trajectory_is_refused(problem):
    model, batch = problem
    dit = copy.deepcopy(model)
    jagg = jaggc.stepwise(dit, window=W, weights="t")
    trajectory(dit, batch, jagg, "fresh")
    shifted = dict(batch, timesteps=batch["timesteps"] + 7.0)        # step 2 called at no declared timestep
    with pytest.raises(jaggc.JaggError, match="none of this trajectory's declared steps"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(dit, shifted if j == 2 else batch, j, "fresh").backward()
    jagg.close()


def test_nonfinite_inputs_are_refused_before_the_window_backward(problem):
    model, batch = problem
    dit = copy.deepcopy(model)
    jagg = jaggc.stepwise(dit, window=W, weights="t")
    bad = dict(batch, prompt_embeds=batch["prompt_embeds"].clone())
    bad["prompt_embeds"][0, 0, 0] = float("nan")
    with pytest.raises(jaggc.JaggError, match="NaN or Inf"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(dit, bad if j == 1 else batch, j, "view").backward()
    assert all(p.grad is None or not p.grad.isnan().any() for p in dit.parameters())
    jagg.close()


def test_a_declaration_read_with_the_first_lookup_is_still_checked(problem):
    """With the rollout cache the declaration on the device is read with the first call's lookup
    (plan.py: lazy): a NaN in it is refused at that call, before any output reaches the loop, and the
    plan's warnings still come."""
    model, batch = problem
    dit = standin_module(copy.deepcopy(model))
    on_device = {k: (standin(v) if torch.is_tensor(v) else v) for k, v in batch.items()}
    with on_standin_device():
        jagg = jaggc.stepwise(dit, window=W, weights="t", rollout_cache=True)
        rollout(dit, on_device)
        bad = on_device["timesteps"].clone()
        bad[0, 3] = float("nan")
        handle = jagg.trajectory(bad)
        assert handle is not None and jagg._run.plan.needs_read         # nothing read at the declaration
        with pytest.raises(jaggc.JaggError, match="NaN or Inf"):
            step_loss(dit, on_device, 0, "view")
        jagg.close()
        # two declared steps: every window exact, said when the plan is read
        jagg = jaggc.stepwise(dit, window=W, weights="t", rollout_cache=True)
        rollout(dit, on_device)
        with pytest.warns(UserWarning, match="no window of the declared trajectory runs JAGG"):
            for j in jagg.steps(range(2), on_device["timesteps"][:, :2]):
                step_loss(dit, on_device, j, "fresh").backward()
        jagg.close()
