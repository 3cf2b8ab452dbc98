"""The cost shape of a study base: the DiT's share of an iteration's CPU time and its backward/forward
cost ratio for a trainable set, both measured in one run of the study's own trainer.

A ``FewStepTrainer(timed=True)`` runs ``iterations`` iterations (after ``warmup``) of ``schedule`` at the
study's batch; its ``PassTimer`` sums the process CPU time inside the DiT's forward calls (the rollout's
no-grad ones included) and inside the loop's ``backward()`` calls. ``dit_share`` = (forwards + backwards)
/ the iteration's CPU time (rollout, reward, advantages, SDE arithmetic, optimizer steps and Python are
the rest); ``bwd_fwd`` = backward time / the time of the forwards with grad they belong to (same
minibatch rows, same steps).

    python -m jaggc_studies.fewsteps.cost_shape --base digits-wide --trainable attention blocks
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from jaggc_studies.digits.trainer import TrainerConfig
from jaggc_studies.fewsteps.schedules import parse_schedule
from jaggc_studies.fewsteps.trainer import FewStepTrainer


def measure_cost_shape(dit, kwargs: dict, *, trainable: str = "attention", schedule: str = "exact",
                       iterations: int = 3, warmup: int = 1, num_steps: int = 10, classes_per_iter: int = 2,
                       group_size: int = 16, seed: int = 0) -> dict:
    """``dit_share`` and ``bwd_fwd`` (module docstring) of ``dit`` (a copy is trained), medians over
    ``iterations`` iterations, with the per-iteration seconds they come from."""
    config = TrainerConfig(num_steps=num_steps, classes_per_iter=classes_per_iter, group_size=group_size,
                           lr=3e-4, seed=seed, trainable=trainable)
    trainer = FewStepTrainer(copy.deepcopy(dit), config, schedule=parse_schedule(schedule), timed=True, **kwargs)
    logs = [trainer.step() for _ in range(warmup + iterations)][warmup:]
    trainer.close()
    shares = [(h["passes"]["forward_s"] + h["passes"]["backward_s"]) / h["cpu_s"] for h in logs]
    ratios = [h["passes"]["backward_s"] / h["passes"]["grad_forward_s"] for h in logs]
    return dict(trainable=trainable, schedule=schedule, trained_params=sum(p.numel() for p in trainer.params),
                params=sum(p.numel() for p in trainer.dit.parameters()),
                dit_share=statistics.median(shares), bwd_fwd=statistics.median(ratios),
                cpu_s=statistics.median(h["cpu_s"] for h in logs),
                forward_s=statistics.median(h["passes"]["forward_s"] for h in logs),
                grad_forward_s=statistics.median(h["passes"]["grad_forward_s"] for h in logs),
                backward_s=statistics.median(h["passes"]["backward_s"] for h in logs))


def main(argv=None) -> None:
    from jaggc_studies.fewsteps.bases import BASES, load_base

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="digits-wide", choices=list(BASES))
    p.add_argument("--trainable", nargs="+", default=["attention", "blocks"])
    p.add_argument("--schedules", nargs="+", default=["exact", "fast2"])
    p.add_argument("--iterations", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dit, kwargs, _ = load_base(args.base)
    kwargs = {k: v for k, v in kwargs.items()}
    for trainable in args.trainable:
        for schedule in args.schedules:
            out = measure_cost_shape(dit, kwargs, trainable=trainable, schedule=schedule, iterations=args.iterations)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)


if __name__ == "__main__":
    main()
