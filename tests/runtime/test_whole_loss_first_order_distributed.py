"""The whole-loss path's rollout cache under DDP, 2 gloo ranks: on-policy hits and off-policy serving.

``jagg_compile(grpo_loss)`` on the digits base wrapped in DDP, each rank its own samples, the rollout
recorded through the DDP module; the first call on-policy (the cache's hits), one AdamW step, then the
same samples again (the JAGG window's interior steps served first-order, runtime/first_order.py).
A forward under DDP may be collective (buffers broadcast; under FSDP every forward gathers), so the
ranks serve a window from their caches only where every rank can:

* both ranks record: both serve the on-policy window and then the off-policy one; the gradient with
  served outputs has cosine > 0.9999 to the plain cache's (which forwards off-policy), the ranks'
  gradients are equal (DDP's average);
* rank 1's recording dropped after the rollout: neither rank serves either call (every rank forwards),
  and the gradients equal the plain cache run's where that one forwarded too.

A disagreement would leave a rank in a collective its peer never makes: the harness's timeout fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import jaggc
from jaggc_studies.digits import trainer as tr
from jaggc_studies.digits.model import load_base
from ranks import run_ranks

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

T = 9
WORLD = 2


def _case(rank: int, first_order: bool, drop_on_rank1: bool = False) -> dict:
    torch.manual_seed(0)
    dit = load_base()
    tr.trainable_parameters(dit, "attention")
    ddp = torch.nn.parallel.DistributedDataParallel(dit)
    config = tr.TrainerConfig(num_steps=T, group_size=4, classes_per_iter=2, clip_range=1e-2)
    params = [p for p in dit.parameters() if p.requires_grad]
    cache = jaggc.RolloutCache(ddp, first_order=first_order)
    loss_fn = jaggc.jagg_compile(tr.grpo_loss, window=4, options=jaggc.Options(rollout_cache=cache))
    g = torch.Generator().manual_seed(5 + rank)
    with cache.record(), torch.no_grad():
        batch = tr.rollout(ddp, torch.tensor([3 + rank] * 4 + [7] * 4), config, g)
    if drop_on_rank1 and rank == 1:
        cache.clear()
    adv = torch.randn(8, generator=g)
    batch["advantages"] = (adv - adv.mean()) / adv.std()
    batch["train_steps"] = tuple(range(T - 1))
    opt = torch.optim.AdamW(params, lr=3e-4)
    out = dict(grads=[], hits=[], served=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in range(2):            # on-policy, then one optimizer step later
            hits = cache.stats.hits
            loss, _ = loss_fn(ddp, batch)
            loss.backward()
            out["grads"].append(torch.cat([p.grad.flatten() for p in params]).clone())
            out["hits"].append(cache.stats.hits - hits)
            out["served"].append(cache.stats.first_order_served)
            opt.step()
            opt.zero_grad()
    return out


def rank_body(rank: int, world: int) -> dict:
    return {"first_order": _case(rank, True), "plain": _case(rank, False),
            "dropped": _case(rank, True, drop_on_rank1=True)}


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    load_base()
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="whole_loss_first_order", timeout_s=300)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))


def test_every_rank_serves_on_and_off_policy(rank_results):
    for res in rank_results:
        fo, plain = res["first_order"], res["plain"]
        assert fo["hits"][0] == plain["hits"][0] == 2, (fo, plain)       # the JAGG window's 2 interior steps
        assert fo["served"] == [0, 2] and plain["served"] == [0, 0], (fo["served"], plain["served"])
        assert torch.equal(fo["grads"][0], plain["grads"][0])
        assert _cos(fo["grads"][1], plain["grads"][1]) > 0.9999 and not torch.equal(fo["grads"][1], plain["grads"][1])
    for key in ("first_order", "plain"):
        for a, b in zip(rank_results[0][key]["grads"], rank_results[1][key]["grads"]):
            assert torch.equal(a, b)


def test_a_rank_without_the_recording_makes_every_rank_forward(rank_results):
    for res in rank_results:
        dropped = res["dropped"]
        assert dropped["hits"] == [0, 0] and dropped["served"] == [0, 0], dropped
    a, b = rank_results[0]["dropped"]["grads"], rank_results[1]["dropped"]["grads"]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
