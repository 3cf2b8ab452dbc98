"""Off-policy serving (``rollout_cache="first_order"``) under DDP, FSDP1 and FSDP2, 2 gloo ranks.

A forward under DDP or FSDP is collective (FSDP all-gathers in each, DDP may broadcast buffers), so
the ranks must make the same forwards in the same order, the early knot forwards of serving included:
an interior step is served only where every rank can serve it (one agreement per interior call),
and a rank that cannot makes every rank run the forward. MixGRPO's loop, each rank its own samples,
an optimizer step after every sample (the second sample's trajectory one step after the rollout):

* both ranks serve the off-policy trajectory's interior steps, forward none of them, and forward
  its second knot early; the gradient of the on-policy first trajectory equals the plain cache's
  (``rollout_cache=True``), the off-policy one's is close to it (cosine > 0.9999: the served outputs
  move the upstream gradients only at second order, as in one process), and the ranks' parameters
  stay equal;
* rank 1's recording dropped after the rollout: neither rank serves, both run the forwards (the
  same counts on both ranks), and the gradients equal the plain cache's;
* every window below ``min_sigma``: the off-policy window's two interior forwards run as one on both ranks
  (agreed), the gradients those of the plain cache's forwards one by one (fp32 summation order);
* the guard probing every second trajectory: the probed off-policy one measures serving over both
  ranks (the same figures on both), the others are served.

A mismatch of the ranks' agreements would hang a rank in a collective its peer never joins: the
harness's timeout fails the test then.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import jaggc
from jaggc_studies.loops import mix_grpo as mg, rollouts
from ranks import run_ranks
from test_sharded import full_grads
from test_stepwise_distributed import _wrap, full_params

WORLD = 2
TIMEOUT_S = 300

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def mix_case(rank: int, world: int, wrapper: str, cache, one_rank_unrecorded: bool = False) -> dict:
    run = mg.setup(samples=2, gradient_accumulation_steps=1, shard=(rank, world), wrap=_wrap(wrapper),
                   stepwise=dict(window=4, weights="t", rollout_cache=cache))
    seen = []
    run.optimizer.register_step_pre_hook(lambda o, a, k: seen.append(full_grads(run.transformer, wrapper)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rollouts.mix_grpo_epoch(run, seed=7 + rank)
        if one_rank_unrecorded and rank == 1:
            jaggc.stepwise(run.transformer).cache.clear()
        mg.train_jaggc(run)
    params = full_params(run.transformer, wrapper)
    counts = vars(jaggc.stepwise(run.transformer).counts).copy()
    jaggc.stepwise(run.transformer).close()
    return dict(grads=seen, counts=counts, params=params)


def guarded_case(rank: int, world: int, wrapper: str) -> dict:
    """4 samples, the guard probing trajectories 0 and 2: 2 is measured, 1 and 3 served."""
    run = mg.setup(samples=4, gradient_accumulation_steps=1, shard=(rank, world), wrap=_wrap(wrapper),
                   stepwise=dict(window=4, weights="t", rollout_cache="first_order", guard=jaggc.Guard(every=2)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rollouts.mix_grpo_epoch(run, seed=7 + rank)
        mg.train_jaggc(run)
    sw = jaggc.stepwise(run.transformer)
    out = dict(counts=vars(sw.counts).copy(), figures=[tuple(vars(f).values()) for f in sw.served_figures])
    sw.close()
    return out


def rank_body(rank: int, world: int) -> dict:
    out = {}
    for wrapper in ("ddp", "fsdp1", "fsdp2"):
        for cache in ("first_order", True):
            out[(wrapper, cache)] = mix_case(rank, world, wrapper, cache)
    out["unrecorded"] = mix_case(rank, world, "ddp", "first_order", one_rank_unrecorded=True)
    for wrapper in ("ddp", "fsdp2"):
        out[("below", wrapper)] = mix_case(rank, world, wrapper, jaggc.FirstOrder(min_sigma=1.0))
    for wrapper in ("ddp", "fsdp2"):
        out[("guarded", wrapper)] = guarded_case(rank, world, wrapper)
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    mg.setup(samples=1)      # warm the lazy imports before forking
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="first_order_ranks", timeout_s=TIMEOUT_S)


def _cosine(a: dict, b: dict) -> float:
    x = torch.cat([a[n].double().flatten() for n in sorted(a)])
    y = torch.cat([b[n].double().flatten() for n in sorted(b)])
    return torch.nn.functional.cosine_similarity(x, y, 0).item()


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[n].double() - b[n].double()).norm() ** 2) for n in a) ** 0.5
    return num / max(sum(float(b[n].double().norm() ** 2) for n in b) ** 0.5, 1e-30)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp1", "fsdp2"])
def test_every_rank_serves_the_off_policy_trajectory(rank_results, wrapper):
    for res in rank_results:
        served, forwarded = res[(wrapper, "first_order")], res[(wrapper, True)]
        c, ref = served["counts"], forwarded["counts"]
        # the first trajectory on-policy from the cache; the second's 2 interior steps served, not forwarded
        assert c["cached_forwards"] == ref["cached_forwards"] == 2, (c, ref)
        assert (c["first_order_served"], c["nograd_forwards"], c["first_order_missed"]) == (2, 0, 0), c
        assert ref["first_order_served"] == 0 and ref["nograd_forwards"] == 2, ref
        # the off-policy window's two knots ran as one forward, on both ranks (serving.py)
        assert c["prefetched_knots"] == 1 and c["batched_knot_forwards"] == 1, c
        assert c["grad_forwards"] == ref["grad_forwards"] - 1, (c, ref)
        assert len(served["grads"]) == len(forwarded["grads"]) == 2
        # on-policy: the same computation (one summation order) in both runs
        assert _rel(served["grads"][0], forwarded["grads"][0]) <= 1e-6
        assert _cosine(served["grads"][1], forwarded["grads"][1]) > 0.9999
        assert _rel(served["grads"][1], forwarded["grads"][1]) > 0      # first-order: close, not equal
    a, b = rank_results[0][(wrapper, "first_order")]["params"], rank_results[1][(wrapper, "first_order")]["params"]
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_rank_that_cannot_serve_makes_every_rank_forward(rank_results):
    for rank, res in enumerate(rank_results):
        c, ref = res["unrecorded"]["counts"], res[("ddp", True)]["counts"]
        assert c["first_order_served"] == 0 and c["prefetched_knots"] == c["batched_knot_forwards"] == 0, c
        # every rank runs the interior forwards of both trajectories (rank 1's cache is empty, so the
        # on-policy lookups miss on every rank too)
        assert c["nograd_forwards"] == 4 and c["cached_forwards"] == 0, c
    for a, b in zip(rank_results[0]["unrecorded"]["grads"], rank_results[1]["unrecorded"]["grads"]):
        assert _rel(a, b) == 0


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_every_rank_runs_the_interior_forwards_below_min_sigma_together(rank_results, wrapper):
    for res in rank_results:
        below, forwarded = res[("below", wrapper)], res[(wrapper, True)]
        c, ref = below["counts"], forwarded["counts"]
        assert (c["first_order_served"], c["batched_interior_forwards"], c["nograd_forwards"]) == (0, 1, 1), c
        assert ref["nograd_forwards"] == 2, ref
        for a, b in zip(below["grads"], forwarded["grads"]):
            assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_the_guards_measure_of_serving_is_the_ranks(rank_results, wrapper):
    """The probed off-policy trajectory measures serving over both ranks' interior steps (one all-reduce):
    the same figures on both ranks; the unprobed ones are served."""
    a, b = (res[("guarded", wrapper)] for res in rank_results)
    assert a["figures"] == b["figures"] and len(a["figures"]) == 1, (a["figures"], b["figures"])
    trajectory, steps, rel_error, change_error = a["figures"][0]
    assert trajectory == 2 and steps == 4 and 0 < rel_error < 0.25 and 0 < change_error
    for r in (a, b):
        assert r["counts"]["first_order_served"] == 4 and r["counts"]["first_order_missed"] == 0, r["counts"]
