"""``jaggc.stepwise`` under the trainers' distributed wrappers, 2 gloo ranks on the CPU.

* DanceGRPO's loop (each rank its own sample and its own random permutation of a random 60% of the
  steps, ``loss.backward()`` per step, no ``no_sync``) on FSDP1 (``use_orig_params`` False and True,
  FSDP1 with DanceGRPO's activation checkpointing), FSDP2 and plain DDP; unchanged, and with
  ``jaggc.stepwise(window=4)`` joint and low-memory, plain JAGG and the σ-aware default;
* Flow-GRPO's loop under accelerate (DDP, ``accumulate`` with ``no_sync`` until the trajectory's last
  step, ``optimizer.step()`` every step) at W=2 and W=4;
* MixGRPO's loop on plain DDP (every step's backward all-reduces).

Checked on every rank: ``.grad`` at each optimizer step (gathered) equals the ranks' average of each
rank's own reference (the exact per-step gradient for the unchanged loop, ``@jagg_compile``'s JAGG of
the rank's trajectory loss for stepwise, computed on an unwrapped copy), and the collectives:
reduce-scatters (FSDP) or all-reduced buckets (DDP) per trajectory are fewer than the unchanged
loop's (accelerate: the same, one sync per trajectory). The low-memory form's peak of saved
activations under FSDP1 is within 2.2x the unchanged loop's.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import jaggc
from helpers import reference_jagg
from jaggc.runtime.memory import track_saved_tensors
from jaggc.runtime.weights import DEFAULT_WEIGHTS
from jaggc_studies.bench.sharded import count_collectives, install_ddp_counter, parameter_storages, wrap_dit
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg
from ranks import run_ranks
from test_sharded import clean, full_grads

WORLD = 2
TIMEOUT_S = 600
WRAPPERS = ("fsdp1", "fsdp1_orig", "fsdp1_ckpt", "fsdp2", "ddp")
DANCE_CASES = [("unchanged", None), ("joint", "t"), ("lowmem", "t"), ("joint", "default")]

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _avg(named: dict) -> dict:
    out = {}
    for k in sorted(named):
        t = named[k].detach().double().clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out[k] = t
    return out


def _rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    fa = torch.cat([a[k].double().reshape(-1) for k in sorted(a)])
    fb = torch.cat([b[k].double().reshape(-1) for k in sorted(b)])
    return float((fa - fb).norm() / fb.norm())


def _named_grads(model) -> dict:
    return {clean(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _wrap(wrapper: str):
    def wrap(model):
        base = "fsdp1" if wrapper == "fsdp1_ckpt" else wrapper
        wrapped = wrap_dit(model, base, checkpointing=wrapper == "fsdp1_ckpt")
        if wrapper == "ddp":
            install_ddp_counter(wrapped)
        return wrapped
    return wrap


def full_params(model, wrapper: str) -> dict:
    """The gathered parameters by name (a collective)."""
    if wrapper == "fsdp2":
        return {clean(n): p.detach().full_tensor() for n, p in model.named_parameters()}
    if wrapper == "ddp":
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, writeback=False):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def reference_grad(model, params: dict, loss) -> dict:
    """``loss(copy)``'s gradient on a copy of the unwrapped ``model`` set to ``params``, by name."""
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in copy_.named_parameters():
            p.copy_(params[n])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss(copy_).backward()
    return _named_grads(copy_)


def dance_case(rank: int, world: int, wrapper: str, mode: str, weights: str | None) -> dict:
    """DanceGRPO's loop on ``wrapper``: at each optimizer step, the gathered .grad against the ranks'
    average of each rank's reference at the run's current parameters."""
    basis = "t" if weights == "t" else DEFAULT_WEIGHTS
    stepwise = None if mode == "unchanged" else dict(window=4, backward=mode, weights=basis)
    kwargs = dict(num_steps=10, samples=2, shard=(rank, world))
    run = dg.setup(**kwargs, wrap=_wrap(wrapper), stepwise=stepwise)
    plain = dg.setup(**kwargs)            # the same samples, an unwrapped model for the references
    kind = "fsdp1" if wrapper.startswith("fsdp1") else wrapper
    errors = []

    def check(opt, args, kwargs_):
        i = len(errors)
        got = full_grads(run.transformer, kind)
        params = full_params(run.transformer, kind)
        if mode == "unchanged":
            def loss(m):
                return dg.reference_loss(plain, i, m)
        else:
            def loss(m):
                compiled = jaggc.jagg_compile(lambda dit, r: dg.reference_loss(r, i, dit), dit=m, window=4,
                                              weights=basis, options=jaggc.Options(batch_knots=False))
                return compiled(m, plain)
        local = reference_grad(plain.transformer, params, loss)
        errors.append(_rel(got, _avg(local)))

    run.optimizer.register_step_pre_hook(check)
    ddp = run.transformer if wrapper == "ddp" else None
    with count_collectives(ddp) as counts, track_saved_tensors(parameter_storages(run.transformer)) as saved, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (dg.train_unchanged if mode == "unchanged" else dg.train_jaggc)(run)
    out = dict(errors=errors, collectives=dict(counts), peak=saved.peak_bytes)
    if mode != "unchanged":
        out["counts"] = vars(jaggc.stepwise(run.transformer).counts).copy()
        jaggc.stepwise(run.transformer).close()
    return out


def flow_case(rank: int, world: int, window: int, loop: str) -> dict:
    """Flow-GRPO's loop under accelerate (DDP over the ranks, accumulate over each trajectory's steps):
    per optimizer step the synced .grad against the ranks' average of each rank's reference."""
    run = fg.setup(num_steps=6, batch=2, trajectories=2, shard=(rank, world), config=fg.TrainConfig(max_grad_norm=1e12),
                   stepwise=dict(window=window, weights="t") if loop == "jaggc" else None)
    assert run.accelerator.distributed_type.name == "MULTI_CPU"
    model = run.accelerator.unwrap_model(run.transformer)
    buckets: list[int] = []
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting(state, bucket):
        buckets.append(1)
        return allreduce_hook(None, bucket)

    run.transformer.register_comm_hook(None, counting)
    errors = []

    def check(opt, args, kwargs_):
        sample = run.samples_batched[len(errors)]
        ref_model = copy.deepcopy(model)
        if loop == "unchanged":
            fg.reference_loss(run, sample, ref_model).backward()
            local = _named_grads(ref_model)
        else:
            _, flat = reference_jagg(lambda m: fg.reference_loss(run, sample, m), (ref_model,), ref_model, window)
            names = [n for n, p in ref_model.named_parameters()]
            sizes = [p.numel() for p in ref_model.parameters()]
            local = {clean(n): g.view_as(p) for n, g, p in zip(names, flat.split(sizes), ref_model.parameters())
                     if p.requires_grad}
        got = {clean(n): p.grad.detach() for n, p in model.named_parameters() if p.requires_grad}
        errors.append(_rel(got, _avg(local)))

    run.optimizer.optimizer.register_step_pre_hook(check)
    (fg.train_unchanged if loop == "unchanged" else fg.train_jaggc)(run)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if loop == "jaggc":
        jaggc.stepwise(run.transformer).close()
    return dict(errors=errors, buckets=len(buckets), params=params)


def mix_case(rank: int, world: int, loop: str, wrapper: str = "ddp", backward: str = "joint") -> dict:
    """MixGRPO's loop (steps in σ order) on ``wrapper``: on plain DDP every step's backward
    all-reduces, stepwise once per window; the gathered gradient at each step against the ranks'
    average of each rank's whole-loss JAGG at the run's parameters."""
    run = mg.setup(samples=2, shard=(rank, world), wrap=_wrap(wrapper),
                   stepwise=dict(window=4, weights="t", backward=backward) if loop == "jaggc" else None)
    plain = mg.setup(samples=2, shard=(rank, world))
    kind = "fsdp1" if wrapper.startswith("fsdp1") else wrapper
    errors = []

    def check(opt, args, kwargs_):
        i = len(errors)
        got, params = full_grads(run.transformer, kind), full_params(run.transformer, kind)

        def loss(m):
            if loop == "unchanged":
                return mg.reference_loss(plain, i, m)
            return jaggc.jagg_compile(lambda dit, r: mg.reference_loss(r, i, dit), dit=m, window=4, weights="t",
                                      options=jaggc.Options(batch_knots=False))(m, plain)
        errors.append(_rel(got, _avg(reference_grad(plain.transformer, params, loss))))

    run.optimizer.register_step_pre_hook(check)
    with count_collectives(run.transformer if wrapper == "ddp" else None) as counts:
        (mg.train_unchanged if loop == "unchanged" else mg.train_jaggc)(run)
    params = {clean(n): p.detach().clone() for n, p in run.transformer.named_parameters()}
    if loop == "jaggc":
        jaggc.stepwise(run.transformer).close()
    return dict(collectives=dict(counts), params=params, errors=errors)


def rank_body(rank: int, world: int) -> dict:
    results = {}
    for loop, window in (("unchanged", 4), ("jaggc", 2), ("jaggc", 4)):
        results[("flow", loop, window)] = flow_case(rank, world, window, loop)
    for loop in ("unchanged", "jaggc"):
        results[("mix", loop)] = mix_case(rank, world, loop)
    for wrapper in ("fsdp1", "fsdp2"):
        for backward in ("joint", "lowmem"):
            results[("mix", wrapper, backward)] = mix_case(rank, world, "jaggc", wrapper, backward)
    for wrapper in os.environ.get("JAGGC_STEPWISE_WRAPPERS", ",".join(WRAPPERS)).split(","):
        for mode, weights in DANCE_CASES:
            results[("dance", wrapper, mode, weights)] = dance_case(rank, world, wrapper, mode, weights)
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    dg.setup(num_steps=4, samples=1)      # warm the lazy imports before forking
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="stepwise", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("mode,weights", DANCE_CASES)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_dance_grpo_gradient_at_each_step(rank_results, wrapper, mode, weights):
    for res in rank_results:
        r = res[("dance", wrapper, mode, weights)]
        assert len(r["errors"]) == 2
        assert max(r["errors"]) <= 1e-6, r["errors"]


def test_flow_grpo_under_accelerate_ddp(rank_results):
    """W=2: the unchanged loop's parameters; W=4: each step's synced gradient is the ranks' average
    JAGG; one all-reduce per trajectory (its sync step) as the unchanged loop; both ranks alike."""
    for res in rank_results:
        unchanged, w2, w4 = res[("flow", "unchanged", 4)], res[("flow", "jaggc", 2)], res[("flow", "jaggc", 4)]
        assert len(unchanged["errors"]) == len(w4["errors"]) == 2
        assert max(unchanged["errors"]) <= 1e-6 and max(w4["errors"]) <= 1e-6, (unchanged["errors"], w4["errors"])
        assert _rel(w2["params"], unchanged["params"]) <= 1e-6
        assert w4["buckets"] == w2["buckets"] == unchanged["buckets"] > 0
    for key in [("flow", "jaggc", 4), ("flow", "unchanged", 4)]:
        assert all(torch.equal(rank_results[0][key]["params"][n], rank_results[1][key]["params"][n])
                   for n in rank_results[0][key]["params"])


def test_mix_grpo_on_plain_ddp_all_reduces_once_per_window(rank_results):
    for res in rank_results:
        unchanged, jagg = res[("mix", "unchanged")], res[("mix", "jaggc")]
        assert max(unchanged["errors"] + jagg["errors"]) <= 1e-6, (unchanged["errors"], jagg["errors"])
        # 2 samples x 4 steps, one backward each; stepwise: 2 samples x 1 window
        assert unchanged["collectives"]["allreduce_buckets"] == 4 * jagg["collectives"]["allreduce_buckets"] > 0
    assert all(torch.equal(rank_results[0][("mix", "jaggc")]["params"][n], rank_results[1][("mix", "jaggc")]["params"][n])
               for n in rank_results[0][("mix", "jaggc")]["params"])


@pytest.mark.parametrize("backward", ["joint", "lowmem"])
@pytest.mark.parametrize("wrapper", ["fsdp1", "fsdp2"])
def test_mix_grpo_in_sigma_order_on_fsdp(rank_results, wrapper, backward):
    """Steps in σ order: each window's backward at its last step, through the knots' held graphs."""
    for res in rank_results:
        r = res[("mix", wrapper, backward)]
        assert len(r["errors"]) == 2 and max(r["errors"]) <= 1e-6, r["errors"]


@pytest.mark.parametrize("wrapper", [w for w in WRAPPERS if w != "ddp"])
def test_fewer_reduce_scatters_than_the_unchanged_loop(rank_results, wrapper):
    for res in rank_results:
        unchanged = res[("dance", wrapper, "unchanged", None)]["collectives"]["reduce_scatter_single"]
        for mode, weights in DANCE_CASES[1:]:
            ours = res[("dance", wrapper, mode, weights)]
            assert ours["collectives"]["reduce_scatter_single"] < unchanged, (mode, weights, ours["collectives"], unchanged)


def test_dance_grpo_on_ddp_all_reduces_less(rank_results):
    for res in rank_results:
        unchanged = res[("dance", "ddp", "unchanged", None)]["collectives"]["allreduce_buckets"]
        assert res[("dance", "ddp", "joint", "t")]["collectives"]["allreduce_buckets"] < unchanged


def test_low_memory_form_under_fsdp1(rank_results):
    """lowmem's peak of saved activations within 2.2x the unchanged loop's (DanceGRPO's random order:
    the knots re-run in their windows' backward, one window at a time)."""
    for res in rank_results:
        unchanged = res[("dance", "fsdp1", "unchanged", None)]["peak"]
        assert 0 < res[("dance", "fsdp1", "lowmem", "t")]["peak"] <= 2.2 * unchanged
