"""JAGG windows under DistributedDataParallel (2 processes, gloo, CPU).

Each rank holds half of a global batch of GLOBAL_B samples and runs its windows through the DDP
module (``ddp(...)``), then ONE ``loss.backward()`` over its summed loss. DDP averages gradients
over ranks, so with the GRPO normalisation "mean over the global batch" the per-rank loss is

    L_r = world_size / GLOBAL_B * Σ_{samples of r} Σ_k <v_k, g_k>,

and avg_r ∇L_r = 1/GLOBAL_B * Σ_{all samples} Σ_k J_kᵀ g_k (JAGG-aggregated): the single-process
JAGG gradient of the full batch with loss L = 1/GLOBAL_B * Σ_{all samples} Σ_k <v_k, g_k>.
(Samples are independent in a DiT and the JAGG weights are per sample, so the JAGG gradient of a
batch is the sum of its samples' JAGG gradients.)

Negative controls document the silent-desync traps of spec §4: running the window through
``ddp.module`` (no DDP forward, hence no all-reduce) and two separate ``backward()`` calls after two
DDP forwards both finish without error and leave wrong, rank-dependent gradients.

The ranks are forked from the test process by ``ranks.run_ranks`` (the test process has torch and
diffusers imported already: a cold ``import diffusers`` costs 10-20 s per process on a 2-core
machine); they write their gradients, or their traceback, to a temporary folder.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from jaggc import models
from jaggc.runtime import WindowOptions, count_dit_passes, jagg_calls, run_window

from helpers import rel_err
from ranks import GLOBAL_B, assert_grads_match, global_inputs, loss_of, run_ranks, shard, window_slices

WORLD = 2
SCENARIOS = ("w4", "w3", "traj", "traj_pw", "traj_pw_ungrouped", "traj_lowmem", "nosync", "two_backward")
PER_WINDOW = WindowOptions(backward="per_window")
TIMEOUT_S = 240


# --------------------------------------------------------------------------- shared inputs
# global_inputs, shard, loss_of, window_slices: tests/ranks.py (test_fsdp.py uses the same)


def compiled_loss(dit, zs, ts, cond, gs, scale: float):
    """The same trajectory loss written as a loop for @jagg_compile (a sum of per-step terms)."""
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(hidden_states=zs[k], timestep=ts[k], return_dict=False, **cond)[0]
        total = total + (v * gs[k]).sum()
    return total * scale


def as_batch(calls, gs):
    return (torch.stack([c.kwargs["hidden_states"] for c in calls]), torch.stack([c.kwargs["timestep"] for c in calls]),
            {k: v for k, v in calls[0].kwargs.items() if k not in ("hidden_states", "timestep", "return_dict")},
            torch.stack(gs))


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- rank process


def run_rank(rank: int, world: int) -> dict:
    model = models.sd3(seed=0)
    ddp = DDP(model)
    allreduces = [0]

    def counting_allreduce(state, bucket):
        allreduces[0] += 1
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    calls, gs = shard(*global_inputs(model), rank, world)
    results: dict = {}

    for name, sl in window_slices().items():
        ddp.zero_grad(set_to_none=True)
        with count_dit_passes(ddp) as counts:
            outs = run_window(ddp, calls[sl])
            loss_of(outs, gs[sl], world).backward()
        results[name] = grads_of(model)
        results[name + "_counts"] = (counts.grad_forward_batches, counts.nograd_forward_batches,
                                     counts.backward_batches)

    # a whole trajectory: two windows (W=4 and W=3), two knot forwards through DDP, ONE backward
    ddp.zero_grad(set_to_none=True)
    allreduces[0] = 0
    outs = jagg_calls(ddp, calls, window=4)
    loss_of(outs, gs, world).backward()
    results["traj"] = grads_of(model)
    results["traj_allreduces"] = allreduces[0]

    # per-window backward mode: each window's knot forward+backward runs inside loss.backward();
    # all but the last are no_sync'd, so the trajectory still syncs once
    ddp.zero_grad(set_to_none=True)
    allreduces[0] = 0
    outs = jagg_calls(ddp, calls, window=4, options=PER_WINDOW)
    loss_of(outs, gs, world).backward()
    results["traj_pw"] = grads_of(model)
    results["traj_pw_allreduces"] = allreduces[0]

    # the same windows run one by one (no shared group): every window syncs, and the result is
    # still right, since each all-reduce averages that window's own contribution
    ddp.zero_grad(set_to_none=True)
    allreduces[0] = 0
    outs = [o for sl in window_slices().values() for o in run_window(ddp, calls[sl], options=PER_WINDOW)]
    loss_of(outs, gs, world).backward()
    results["traj_pw_ungrouped"] = grads_of(model)
    results["traj_pw_ungrouped_allreduces"] = allreduces[0]

    # low-memory mode: each window's backward but the last runs inside the loss's forward (its knot
    # forward no_sync'd), into a buffer that loss.backward() hands to the parameters with the last
    # window's backward: one all-reduce, as in the joint mode
    import jaggc

    lowmem = jaggc.jagg_compile(compiled_loss, dit=ddp, window=4, backward="lowmem")
    ddp.zero_grad(set_to_none=True)
    allreduces[0] = 0
    lowmem(ddp, *as_batch(calls, gs), world / GLOBAL_B).backward()
    results["traj_lowmem"] = grads_of(model)
    results["traj_lowmem_allreduces"] = allreduces[0]
    results["traj_lowmem_path"] = lowmem.report.path

    # negative control 1: the window bypasses DDP's forward, so nothing is all-reduced
    ddp.zero_grad(set_to_none=True)
    sl = window_slices()["w4"]
    outs = run_window(ddp.module, calls[sl])
    loss_of(outs, gs[sl], world).backward()
    results["nosync"] = grads_of(model)

    # negative control 2 (spec §4): two DDP forwards, then two separate backward calls
    ddp.zero_grad(set_to_none=True)
    losses = []
    for sl in window_slices().values():
        losses.append(loss_of(run_window(ddp, calls[sl]), gs[sl], world))
    for loss in losses:
        loss.backward()
    results["two_backward"] = grads_of(model)

    return results


# --------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    # build a model once here so the forked ranks inherit every lazily imported diffusers module
    models.sd3(seed=0)
    return run_ranks(run_rank, WORLD, tmp_path_factory, name="DDP", timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference():
    """Single-process JAGG gradients on the full global batch (same model, same inputs)."""
    model = models.sd3(seed=0)
    calls, gs = global_inputs(model)
    ref = {}
    for name, sl in window_slices().items():
        model.zero_grad(set_to_none=True)
        loss_of(run_window(model, calls[sl]), gs[sl], 1).backward()
        ref[name] = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss_of(jagg_calls(model, calls, window=4), gs, 1).backward()
    ref["traj"] = grads_of(model)
    # the sum of both windows' gradients: what two correctly synced backward calls would give
    ref["w4+w3"] = {n: ref["w4"][n] + ref["w3"][n] for n in ref["w4"]}
    return ref


@pytest.mark.parametrize("name", ["w4", "w3", "traj", "traj_pw", "traj_pw_ungrouped", "traj_lowmem"])
def test_ddp_jagg_gradient_equals_single_process(rank_results, reference, name):
    for r, res in enumerate(rank_results):
        assert_grads_match(res[name], reference[name.split("_")[0]])
    # DDP left every rank with the same (all-reduced) gradient
    for n in rank_results[0][name]:
        torch.testing.assert_close(rank_results[0][name][n], rank_results[1][name][n], rtol=0, atol=0)


@pytest.mark.parametrize("name,W", [("w4", 4), ("w3", 3)])
def test_ddp_one_joint_backward_per_window(rank_results, name, W):
    b = GLOBAL_B // WORLD
    for res in rank_results:
        grad_fw, nograd_fw, bw = res[name + "_counts"]
        assert grad_fw == [2 * b] and bw == [2 * b] and nograd_fw == [(W - 2) * b]


def test_ddp_negative_control_module_bypass_desyncs(rank_results, reference):
    """Calling ``ddp.module`` skips DDP's all-reduce: each rank keeps its own half-batch gradient,
    silently. The ranks disagree and neither matches the global gradient; their mean does."""
    r0, r1 = (res["nosync"] for res in rank_results)
    assert rel_err(r0, reference["w4"]) > 0.05
    assert rel_err(r1, reference["w4"]) > 0.05
    assert rel_err(r0, r1) > 0.05
    mean = {n: (r0[n] + r1[n]) / WORLD for n in r0}
    assert_grads_match(mean, reference["w4"])


def test_ddp_negative_control_two_backward_calls(rank_results, reference):
    """Spec §4: two DDP forwards followed by two ``backward()`` calls runs without error but does
    not give the synced sum of both windows' gradients (one backward over the summed loss does,
    see test_ddp_jagg_gradient_equals_single_process[traj])."""
    r0, r1 = (res["two_backward"] for res in rank_results)
    assert rel_err(r0, reference["w4+w3"]) > 1e-3
    assert rel_err(r1, reference["w4+w3"]) > 1e-3
    assert rel_err(r0, r1) > 1e-3  # and the replicas have silently diverged
    assert_grads_match(reference["traj"], reference["w4+w3"])



def test_ddp_per_window_mode_syncs_once_per_loss(rank_results):
    """Per-window mode runs two knot backwards inside one loss.backward(); grouped, DDP all-reduces
    once (as many buckets as the joint mode), ungrouped once per window."""
    for res in rank_results:
        buckets = res["traj_allreduces"]
        assert buckets >= 1
        assert res["traj_pw_allreduces"] == buckets
        assert res["traj_pw_ungrouped_allreduces"] == 2 * buckets


def test_ddp_lowmem_mode_syncs_once_per_loss(rank_results):
    """Low-memory mode runs the first window's backward inside the forward (no_sync'd, into a
    buffer) and hands it to DDP's one backward: as many all-reduces as the joint mode."""
    for res in rank_results:
        assert res["traj_lowmem_path"] == "fx"
        assert res["traj_lowmem_allreduces"] == res["traj_allreduces"] >= 1
