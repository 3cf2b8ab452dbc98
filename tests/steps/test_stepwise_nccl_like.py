"""``jaggc.stepwise`` on a process group that serves one non-CPU device type only, as NCCL does.

Every DDP/FSDP run of the stepwise path makes collectives of its own: the ranks agree on each
trajectory's plan (steps/ranks.py), on the CFG slice and its recovered rows, on each rollout-cache
hit, on each guard probe (runtime/guard_ranks.py) and average the probe's figures. Under NCCL each must
hold a CUDA tensor, whatever the parameters' placement. ``nccl_like`` (tests/nccl_like.py) makes the
gloo ranks' group serve only the stand-in accelerator for jaggc's collectives, raising NCCL's own
error for a CPU tensor. Checked on 2 ranks: DanceGRPO's loop on DDP, FSDP1 and FSDP2 with the guard
probing every trajectory, and Flow-GRPO's accelerate loop with CFG, the CFG slice and the guard,
each run with and without the emulation: the same gradients and parameters, bit for bit (the
agreements carry flags and counts, not the gradient), and jaggc's collectives ran on the stand-in.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import jaggc
from jaggc_studies.bench.sharded import wrap_dit
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg
from nccl_like import nccl_like
from ranks import run_ranks
from test_sharded import clean

pytestmark = [pytest.mark.usefixtures("one_thread")]

WORLD = 2
ENGINES = ("ddp", "fsdp1", "fsdp2")


def _params(model, engine: str) -> dict:
    if engine == "fsdp2":
        return {clean(n): p.detach().full_tensor() for n, p in model.named_parameters()}
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {clean(n): p.detach().clone() for n, p in model.named_parameters()}
    return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def _dance(rank: int, world: int, engine: str, emulated: bool) -> dict:
    guard = jaggc.Guard(every=1)
    run = dg.setup(num_steps=10, samples=2, shard=(rank, world), wrap=lambda m: wrap_dit(m, engine, checkpointing=False),
                   stepwise=dict(window=4, weights="t", guard=guard))
    context = nccl_like() if emulated else _no_calls()
    with context as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dg.train_jaggc(run)
    stepwise = jaggc.stepwise(run.transformer)
    out = dict(params=_params(run.transformer, engine), calls=dict(calls), probed=guard.probed,
               figures=guard.last_figures)
    stepwise.close()
    return out


def _flow(rank: int, world: int, emulated: bool) -> dict:
    guard = jaggc.Guard(every=1)
    run = fg.setup(num_steps=6, batch=2, trajectories=2, shard=(rank, world),
                   config=fg.TrainConfig(cfg=True, max_grad_norm=1e12),
                   stepwise=dict(window=4, weights="t", cfg_slice=True, guard=guard))
    context = nccl_like() if emulated else _no_calls()
    with context as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fg.train_jaggc(run)
    model = run.accelerator.unwrap_model(run.transformer)
    stepwise = jaggc.stepwise(run.transformer)
    out = dict(params={n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
               calls=dict(calls), sliced=stepwise.counts.sliced_steps, probed=guard.probed, figures=guard.last_figures)
    stepwise.close()
    return out


class _no_calls:
    def __enter__(self):
        return {}

    def __exit__(self, *exc):
        return False


def _body(rank: int, world: int) -> dict:
    out = {}
    for engine in ENGINES:
        for emulated in (False, True):
            out[("dance", engine, emulated)] = _dance(rank, world, engine, emulated)
    for emulated in (False, True):
        out[("flow", "accelerate", emulated)] = _flow(rank, world, emulated)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_body, WORLD, tmp_path_factory, name="nccl_like", timeout_s=600)


@pytest.mark.parametrize("case", [("dance", e) for e in ENGINES] + [("flow", "accelerate")], ids=lambda c: "-".join(c))
def test_jaggc_collectives_run_on_the_served_device(ranks, case):
    for results in ranks:
        plain, emulated = results[(*case, False)], results[(*case, True)]
        # jaggc's agreements ran, each on the stand-in device (a CPU tensor raised NCCL's error)
        assert emulated["calls"].get("all_reduce", 0) > 0, emulated["calls"]
        assert sorted(plain["params"]) == sorted(emulated["params"])
        for name in plain["params"]:
            assert torch.equal(plain["params"][name], emulated["params"][name]), name
        assert plain["probed"] == emulated["probed"] > 0
        assert plain["figures"] == emulated["figures"]
        if case[0] == "flow":
            assert plain["sliced"] == emulated["sliced"] > 0       # the CFG slice's agreements ran too
