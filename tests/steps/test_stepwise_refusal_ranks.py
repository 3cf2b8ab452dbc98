"""A refusal on one rank raises there, at once, also under the guard: 2 gloo ranks, DDP.

Both ranks declare a trajectory in σ order (so the ranks agree to run each window's backward at the
step its last step comes), with ``jaggc.Guard(every=1)``: the trajectory is probed. Rank 1 then
visits step 2 before step 1, which breaks that agreement: jaggc refuses the step (run.py). Dropping
the refused trajectory drops its probe, and that must make no collective: rank 0 never joins one
there (it is in its window's backward, a DDP all-reduce), so a rank that waited for its peers
there would hang with its error unraised (issue 55). Checked: rank 1's error is a jaggc error naming
the step and the rank; rank 0 then fails on its broken group (rank 1 left it), and no rank hangs (the
harness kills the ranks after ``TIMEOUT_S`` and reports them as not finished: a failure here).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import jaggc
from jaggc import models
from ranks import run_ranks

WORLD = 2
TIMEOUT_S = 40
B, T = 1, 6

pytestmark = [pytest.mark.usefixtures("one_thread")]


def refusing_body(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    dit = models.sd3("tiny")
    ddp = DDP(dit)
    cond = models.sd3_conditioning(dit, B, seed=1).kwargs
    shape = models.sd3_latent_shape(dit, B)
    g = torch.Generator().manual_seed(10 + rank)
    ts = 1000 * torch.linspace(1.0, 0.55, T)[None, :].expand(B, T)
    zs = [torch.randn(shape, generator=g) for _ in range(T)]
    sw = jaggc.stepwise(ddp, window=4, weights="t", guard=jaggc.Guard(every=1))
    order = list(range(T)) if rank == 0 else [0, 2, 1, 3, 4, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with sw.trajectory(ts):
            for j in order:
                out = ddp(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
                out.square().mean().backward()


def test_a_refusal_on_one_rank_raises_there_under_the_guard(tmp_path_factory):
    with pytest.raises(pytest.fail.Exception) as failed:
        run_ranks(refusing_body, WORLD, tmp_path_factory, name="refusal_one_rank", timeout_s=TIMEOUT_S)
    message = str(failed.value)
    assert "did not finish" not in message, message
    rank1 = message.split("--- rank 1")[1]
    assert "jaggc.errors.Jagg" in rank1, rank1
    assert "step 2 came out of the declared order" in rank1, rank1
    assert "rank 1 of 2" in rank1, rank1
