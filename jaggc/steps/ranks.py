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
accelerate's ``sync_gradients``) read the whole gradient. Two small all-reduces per trajectory, on
the device the engine's process group serves (runtime/collectives.py: NCCL takes CUDA tensors only).
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import JaggInputError
from ..runtime.collectives import agree
from .plan import PlannedWindow, TrajectoryPlan
from .slicing import RowSlice


def distributed(module) -> bool:
    """Whether ``module``'s backward passes are collective (DDP, FSDP or DeepSpeed in an initialized
    group: runtime/engines.py)."""
    from ..runtime.engines import engine_of

    return engine_of(module).collective_backward


def agree_on_plan(plan: TrajectoryPlan, *, group=None) -> list[int]:
    """Make ``plan``'s windows exact where any rank's are, and its σ order every rank's (module
    docstring); the windows changed. ``group``: the engine's process group (None: the default)."""
    high, low = len(plan), -len(plan)
    sizes = agree([high, low], dist.ReduceOp.MAX, group=group)
    if sizes[0] != -sizes[1]:
        raise JaggInputError(
            f"the ranks declared trajectories of different lengths ({-sizes[1]} to {sizes[0]} steps; this rank "
            f"{len(plan)}): every rank's DiT backward passes are collective, so every rank must train the same number "
            f"of steps per trajectory (DanceGRPO: the same timestep_fraction)")
    # MAX of the exact flags (exact on any rank) and of the negated σ-order flag (in order on every rank)
    agreed = agree([int(w.exact) for w in plan.windows] + [-int(plan.in_sigma_order)], dist.ReduceOp.MAX,
                   group=group)
    exact, plan.in_sigma_order = agreed[:-1], agreed[-1] == -1
    changed = []
    for w, flag in zip(list(plan.windows), exact):
        if flag and not w.exact:
            agreed = PlannedWindow(w.index, w.steps, tuple(range(len(w.steps))), True,
                                   "another rank's window reaches the σ-aware threshold (ranks' backward passes must "
                                   "match)")
            plan.replace_window(agreed)
            changed.append(w.index)
    return changed


def agree_on_hit(hit: bool, *, group=None) -> bool:
    """True if every rank's rollout cache has its call (ranks make their DiT calls in step; a call
    served on one rank and run on another would pair one rank's collectives with nothing)."""
    return agree([int(hit)], dist.ReduceOp.MIN, group=group)[0] == 1


#: the most row blocks per call the ranks agree a CFG slice on (classifier-free guidance has 2)
MAX_SLICE_BLOCKS = 16


def agree_on_slice(learner, *, group=None) -> None:
    """Make the CFG slice (slicing.py) every rank's: a sliced call makes two forwards where the
    unsliced one makes one (FSDP gathers in each), so the ranks must slice alike. Each rank offers
    the slice it learned for this trajectory's declared batch (at most one call batch); a block runs
    without grad only if every rank learned it so, and ranks that learned different call batches
    slice nothing. One all-reduce."""
    rules = [(batch, r) for (batch, declared), r in learner.rules.items() if declared == learner.declared]
    offer = [0] * (2 + MAX_SLICE_BLOCKS)
    if len(rules) == 1 and rules[0][1].count <= MAX_SLICE_BLOCKS:
        batch, rule = rules[0]
        offer[0], offer[1] = batch, rule.count
        for i in rule.no_grad:
            offer[2 + i] = 1
    # MAX of both: every rank's maximum and minimum
    both = agree(offer + [-v for v in offer], dist.ReduceOp.MAX, group=group)
    high, low = both[:len(offer)], [-v for v in both[len(offer):]]
    for key in [k for k in learner.rules if k[1] == learner.declared]:
        del learner.rules[key]
    if low[0] == 0 or high[:2] != low[:2]:
        return
    batch, count = high[0], high[1]
    no_grad = tuple(i for i in range(count) if low[2 + i] == 1)
    if no_grad:
        learner.rules[(batch, learner.declared)] = RowSlice(learner.declared, count, no_grad)


__all__ = ["MAX_SLICE_BLOCKS", "agree_on_hit", "agree_on_plan", "agree_on_slice", "distributed"]
