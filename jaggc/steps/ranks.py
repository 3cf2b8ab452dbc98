"""The ranks of a DDP/FSDP run must run the same collectives: one trajectory plan for all of them.

Every DiT backward of a DDP or FSDP module is collective (an all-reduce per gradient bucket, a
reduce-scatter per FSDP unit), so every rank must make the same number of them, in the same order.
The unchanged per-step loop makes one per trained step. A stepwise trajectory makes one per JAGG
window and one per step of an exact window, and whether a window is exact depends on its steps'
noise levels (σ-aware placement): DanceGRPO draws each rank's subset of steps at random, so rank 0's
window 1 may reach σ < 0.5 while rank 1's does not, and the ranks' backward counts would differ (a
hang, or gradients paired with the wrong step). ``agree_on_plan`` makes the plans agree before the
first step: the ranks must declare the same number of steps (so the same windows), and a window is
exact on every rank if it is exact on any.

The step at which a window's backward runs must agree as well. In σ order (Flow-GRPO, MixGRPO)
window k completes at the same step on every rank; in a random order (DanceGRPO: each rank its own
permutation) it does not, and the loop's own per-step collectives (its ``all_reduce`` of the loss)
would pair with another rank's backward. Unless every rank declared its steps in σ order, the run
takes the deferred schedule (``run.py``): every window's backward, exact windows' included, runs in
the backward that brings the last declared step's gradient (at its end, after DDP's and FSDP's own
end of it), in window order: a clip and an optimizer step in that step's body (Flow-Factory's, at
accelerate's ``sync_gradients``) read the whole gradient. Three small all-reduces per trajectory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import JaggInputError
from .plan import PlannedWindow, TrajectoryPlan
from .slicing import RowSlice


def distributed(module) -> bool:
    """Whether ``module``'s backward passes are collective (DDP, FSDP or DeepSpeed in an initialized
    group: runtime/engines.py)."""
    from ..runtime.engines import engine_of

    return engine_of(module).collective_backward


def agree_on_plan(plan: TrajectoryPlan) -> list[int]:
    """Make ``plan``'s windows exact where any rank's are, and its σ order every rank's (module
    docstring); the windows changed."""
    sizes = torch.tensor([len(plan), -len(plan)], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    if int(sizes[0]) != -int(sizes[1]):
        raise JaggInputError(
            f"the ranks declared trajectories of different lengths ({-int(sizes[1])} to {int(sizes[0])} steps; this rank "
            f"{len(plan)}): every rank's DiT backward passes are collective, so every rank must train the same number "
            f"of steps per trajectory (DanceGRPO: the same timestep_fraction)")
    exact = torch.tensor([int(w.exact) for w in plan.windows], dtype=torch.int64)
    dist.all_reduce(exact, op=dist.ReduceOp.MAX)
    ordered = torch.tensor([int(plan.in_sigma_order)], dtype=torch.int64)
    dist.all_reduce(ordered, op=dist.ReduceOp.MIN)
    plan.in_sigma_order = bool(ordered)
    changed = []
    for w, flag in zip(list(plan.windows), exact.tolist()):
        if flag and not w.exact:
            agreed = PlannedWindow(w.index, w.steps, tuple(range(len(w.steps))), True,
                                   "another rank's window reaches the σ-aware threshold (ranks' backward passes must "
                                   "match)")
            plan.replace_window(agreed)
            changed.append(w.index)
    return changed


def agree_on_hit(hit: bool) -> bool:
    """True if every rank's rollout cache has its call (ranks make their DiT calls in step; a call
    served on one rank and run on another would pair one rank's collectives with nothing)."""
    flag = torch.tensor([int(hit)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


#: the most row blocks per call the ranks agree a CFG slice on (classifier-free guidance has 2)
MAX_SLICE_BLOCKS = 16


def agree_on_slice(learner) -> None:
    """Make the CFG slice (slicing.py) every rank's: a sliced call makes two forwards where the
    unsliced one makes one (FSDP gathers in each), so the ranks must slice alike. Each rank offers
    the slice it learned for this trajectory's declared batch (at most one call batch); a block runs
    without grad only if every rank learned it so, and ranks that learned different call batches
    slice nothing. One all-reduce."""
    rules = [(batch, r) for (batch, declared), r in learner.rules.items() if declared == learner.declared]
    offer = torch.zeros(2 + MAX_SLICE_BLOCKS, dtype=torch.int64)
    if len(rules) == 1 and rules[0][1].count <= MAX_SLICE_BLOCKS:
        batch, rule = rules[0]
        offer[0], offer[1] = batch, rule.count
        offer[2 + torch.tensor(rule.no_grad)] = 1
    both = torch.cat([offer, -offer])            # MAX of both: every rank's maximum and minimum
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[:len(offer)], -both[len(offer):]
    for key in [k for k in learner.rules if k[1] == learner.declared]:
        del learner.rules[key]
    if int(low[0]) == 0 or not torch.equal(high[:2], low[:2]):
        return
    batch, count = int(high[0]), int(high[1])
    no_grad = tuple(i for i in range(count) if int(low[2 + i]) == 1)
    if no_grad:
        learner.rules[(batch, learner.declared)] = RowSlice(learner.declared, count, no_grad)


__all__ = ["MAX_SLICE_BLOCKS", "agree_on_hit", "agree_on_plan", "agree_on_slice", "distributed"]
