"""The guard where the trainers train: 2 gloo ranks, FSDP1 (both ``use_orig_params``), FSDP2, DDP.

* DanceGRPO's loop (each rank its own random order: the deferred schedule) on FSDP1 and FSDP2 and
  MixGRPO's (σ order) on FSDP2, with ``jaggc.stepwise(..., guard=Guard(every=1))``: each probe's
  cosine and relative error equal the single-process figures of the same gradients (the ranks'
  average of each rank's JAGG against the ranks' average of each rank's exact gradient, computed on
  unwrapped copies at the gathered parameters) to 1e-6 in fp32; both ranks' figures and decisions
  are the same; ``.grad`` is the unguarded run's.
* Flow-GRPO under accelerate (DDP, ``accumulate``): likewise.
* The whole-loss guard (``jagg_compile(..., guard=...)``) under FSDP1 and FSDP2, which refused before:
  its figures against the same single-process computation.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import jaggc
from helpers import grads, reference_jagg
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg
from ranks import run_ranks
from test_sharded import clean, full_grads
from test_guard_ranks import _same
from test_stepwise_distributed import _avg, _named_grads, _wrap, full_params, reference_grad

WORLD = 2
TIMEOUT_S = 600

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _figures(jagg: dict, exact: dict) -> tuple[float, float]:
    j = torch.cat([jagg[k].reshape(-1) for k in sorted(jagg)])
    x = torch.cat([exact[k].reshape(-1) for k in sorted(exact)])
    return float(j @ x / (j.norm() * x.norm())), float((j - x).norm() / x.norm())


def flux_case(rank: int, world: int, name: str, wrapper: str, whole_loss: bool = False) -> dict:
    module = dg if name == "dance" else mg
    kwargs = dict(samples=2, shard=(rank, world), **(dict(num_steps=10) if name == "dance" else {}))
    results = []
    guard = jaggc.Guard(every=1, probes=2, on_probe=results.append)
    run = module.setup(**kwargs, wrap=_wrap(wrapper),
                       stepwise=None if whole_loss else dict(window=4, weights="t", guard=guard))
    plain = module.setup(**kwargs)
    kind = "fsdp1" if wrapper.startswith("fsdp1") else wrapper
    expected, seen = [], []

    def loss_jagg(i):
        def loss(m):
            return jaggc.jagg_compile(lambda dit, r: module.reference_loss(r, i, dit), dit=m, window=4, weights="t",
                                      options=jaggc.Options(batch_knots=False))(m, plain)
        return loss

    def check(opt, args, kwargs_):
        i = len(expected)
        params = full_params(run.transformer, kind)
        seen.append(full_grads(run.transformer, kind))
        jagg = _avg(reference_grad(plain.transformer, params, loss_jagg(i)))
        exact = _avg(reference_grad(plain.transformer, params, lambda m: module.reference_loss(plain, i, m)))
        expected.append(_figures(jagg, exact))

    run.optimizer.register_step_pre_hook(check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if whole_loss:
            compiled = jaggc.jagg_compile(lambda dit, r, i: module.reference_loss(r, i, dit), dit=run.transformer,
                                          window=4, weights="t", guard=guard)
            for i in range(len(run.samples_batched_list)):
                compiled(run.transformer, run, i).backward()
                run.optimizer.step()
                run.optimizer.zero_grad()
        else:
            module.train_jaggc(run)
            jaggc.stepwise(run.transformer).close()
    figures = [(r.cosine, r.rel_error) for r in results]
    return dict(expected=expected, figures=figures, history=[h["figures"]["cosine_mean"] for h in guard.history],
                blocks=[h["figures"] for h in guard.history], log=guard.log())


def flow_case(rank: int, world: int) -> dict:
    results = []
    guard = jaggc.Guard(every=1, probes=2, on_probe=results.append)
    run = fg.setup(num_steps=6, batch=2, trajectories=2, shard=(rank, world), config=fg.TrainConfig(max_grad_norm=1e12),
                   stepwise=dict(window=4, weights="t", guard=guard))
    model = run.accelerator.unwrap_model(run.transformer)
    expected = []

    def check(opt, args, kwargs_):
        sample = run.samples_batched[len(expected)]
        ref = copy.deepcopy(model)
        _, flat = reference_jagg(lambda m: fg.reference_loss(run, sample, m), (ref,), ref, 4)
        names = [n for n, _ in ref.named_parameters()]
        jagg = {clean(n): g.view_as(p) for n, g, p in zip(names, flat.split([p.numel() for p in ref.parameters()]),
                                                           ref.parameters()) if p.requires_grad}
        ex = copy.deepcopy(model)
        fg.reference_loss(run, sample, ex).backward()
        exact = {clean(n): p.grad for n, p in ex.named_parameters() if p.requires_grad}
        expected.append(_figures(_avg(jagg), _avg(exact)))

    run.optimizer.optimizer.register_step_pre_hook(check)
    fg.train_jaggc(run)
    jaggc.stepwise(run.transformer).close()
    return dict(expected=expected, figures=[(r.cosine, r.rel_error) for r in results],
                history=[h["figures"]["cosine_mean"] for h in guard.history],
                blocks=[h["figures"] for h in guard.history], log=guard.log())


CASES = [("dance", "fsdp1"), ("dance", "fsdp1_orig"), ("dance", "fsdp2"), ("mix", "fsdp2")]
WHOLE = [("mix", "fsdp1"), ("mix", "fsdp2")]


def rank_body(rank: int, world: int) -> dict:
    out = {("flow", "ddp"): flow_case(rank, world)}
    for name, wrapper in CASES:
        out[(name, wrapper)] = flux_case(rank, world, name, wrapper)
    for name, wrapper in WHOLE:
        out[("whole", name, wrapper)] = flux_case(rank, world, name, wrapper, whole_loss=True)
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    dg.setup(num_steps=4, samples=1)      # warm the lazy imports before forking
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="stepwise_guard", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("key", [("flow", "ddp")] + CASES + [("whole",) + c for c in WHOLE])
def test_probe_figures_are_the_single_process_figures(rank_results, key):
    for res in rank_results:
        r = res[key]
        assert len(r["figures"]) == len(r["expected"]) == 2, r
        for (cos, rel), (cos_ref, rel_ref) in zip(r["figures"], r["expected"]):
            assert abs(cos - cos_ref) <= 1e-6 and abs(rel - rel_ref) <= 1e-6 * max(1.0, rel_ref), (cos, cos_ref, rel, rel_ref)
            assert rel_ref > 1e-4 and not math.isnan(cos)
    a, b = (res[key] for res in rank_results)
    assert a["figures"] == b["figures"] and a["history"] == b["history"] and len(a["history"]) == 1
    # every figure of the decided block (per σ range and per window too) and the log: the same on every rank
    assert _same(a["blocks"], b["blocks"]) and _same(a["log"], b["log"]), (a["blocks"], b["blocks"])
