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

The ranks are forked from the test process (which has torch and diffusers imported already: a cold
``import diffusers`` costs 10-20 s per process on a 2-core machine); they write their gradients,
or their traceback, to a temporary folder.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from jaggc import models
from jaggc.runtime import DitCall, WindowOptions, count_dit_passes, jagg_calls, run_window

from multiproc import run_ranks

WORLD = 2
GLOBAL_B = 4
T = 7  # steps 0..3 are a W=4 window, 4..6 a W=3 window
START = 3
OFFSETS = (0, 1, 0, 2)  # per-sample schedule offset: per-sample timesteps, hence per-sample α
SCENARIOS = ("w4", "w3", "traj", "traj_pw", "traj_pw_ungrouped", "traj_lowmem", "nosync", "two_backward")
PER_WINDOW = WindowOptions(backward="per_window")
TIMEOUT_S = 240


# --------------------------------------------------------------------------- shared inputs


def _sigmas() -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(16)
    return sched.sigmas.to(torch.float32)


def global_inputs(model):
    """T DiT calls on stored states of the full global batch, and the upstream signals g_k."""
    sigmas = _sigmas()
    cond = models.sd3_conditioning(model, GLOBAL_B, seed=1).kwargs
    shape = models.sd3_latent_shape(model, GLOBAL_B)
    g = torch.Generator().manual_seed(2)
    calls = []
    for k in range(T):
        t = torch.stack([sigmas[START + off + k] for off in OFFSETS]) * 1000.0
        calls.append(DitCall((), dict(hidden_states=torch.randn(shape, generator=g), timestep=t,
                                      return_dict=False, **cond)))
    gs = [torch.randn(shape, generator=g) for _ in range(T)]
    return calls, gs


def shard(calls, gs, rank: int, world: int):
    """The rank's contiguous half of every batched input (conditioning included)."""
    per = GLOBAL_B // world
    sl = slice(rank * per, (rank + 1) * per)

    def cut(v):
        return v[sl] if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == GLOBAL_B else v

    return ([DitCall(c.args, {k: cut(v) for k, v in c.kwargs.items()}) for c in calls],
            [g[sl] for g in gs])


def loss_of(outs, gs, world: int) -> torch.Tensor:
    """world/GLOBAL_B * Σ <v_k, g_k>: DDP's average over ranks gives the global-batch mean."""
    return sum((o[0] * g).sum() for o, g in zip(outs, gs)) * (world / GLOBAL_B)


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


def window_slices():
    return {"w4": slice(0, 4), "w3": slice(4, 7)}


# --------------------------------------------------------------------------- rank process


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
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

        dist.barrier()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


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


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for _, g in sorted(grads.items())])


def rel_err(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    fa, fb = _flat(a), _flat(b)
    return float((fa - fb).norm() / fb.norm())


def assert_grads_match(got: dict, want: dict, tol: float = 1e-5):
    assert rel_err(got, want) < tol, f"relative error {rel_err(got, want):.3g}"
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=tol, atol=tol * float(want[n].abs().max()) + 1e-12,
                                   msg=n)


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
