"""``jaggc study fewsteps``: its arguments and entry point (registered by ``jaggc_studies.cli``)."""

from __future__ import annotations

import argparse

from jaggc_studies.fewsteps.bases import BASES
from jaggc_studies.fewsteps.schedules import DEFAULT_SCHEDULES, WIDE_SCHEDULES

QUICK = dict(budget=0.3, iterations=2, seeds=2, num_steps=6, group_size=4, eval_per_class=2, random_init=True,
             schedules=("exact", "fast1", "fast2+jagg2", "mix3+jagg3", "dance+jagg3"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default="digits", choices=list(BASES),
                   help="digits: the demo's DiT and bold-digits reward; shapes: the fidelity studies' Flux DiT with a "
                        "bold-shapes reward; digits-wide: the digits DiT widened 8x (its passes are the cost; derived at "
                        "first use, ~1 min, and cached)")
    p.add_argument("--trainable", default="attention", choices=["attention", "blocks"],
                   help="the trained set: attention (Flow-GRPO's LoRA targets, full rank) or blocks (every parameter of the "
                        "transformer blocks: full fine-tuning)")
    p.add_argument("--cfg", type=float, default=2.0,
                   help="modelled GPU cost: CFG's factor on the per-step GRPO schedules' passes (1: no CFG)")
    p.add_argument("--schedules", nargs="+", default=None, metavar="NAME",
                   help="schedules, space- or comma-separated: exact, dance, fastK (Flow-GRPO-Fast, K SDE steps), mixW "
                        "(MixGRPO's sliding window), each optionally +jaggW (trained through jaggc.stepwise(window=W)); nftK / awmK "
                        "(DiffusionNFT / AWM, K timesteps per sample). Default: " + " ".join(DEFAULT_SCHEDULES) +
                        "; on digits-wide " + " ".join(WIDE_SCHEDULES))
    p.add_argument("--budget", type=float, default=10.0, help="training CPU seconds per schedule (rollout included)")
    p.add_argument("--iterations", type=int, default=25,
                   help="and at least this many iterations per schedule (the equal-iteration view)")
    p.add_argument("--seeds", type=int, default=3, help="runs with rollout seeds seed, seed+1, ...")
    p.add_argument("--seed", type=int, default=0, help="first rollout seed")
    p.add_argument("--num-steps", type=int, default=10, help="sampling steps T (T-1 trainable)")
    p.add_argument("--group-size", type=int, default=16, help="samples per class (the GRPO group)")
    p.add_argument("--eval-per-class", type=int, default=12, help="evaluation samples per class")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: an untrained digits DiT, T=6, 5 schedules, 2 seeds x 2 iterations (well under a minute)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: stable on shared CPUs)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument("--out", default="jaggc-fewsteps", help="folder for the picture (PNG)")
    p.add_argument("--no-pictures", action="store_true", help="write no PNG")
    p.add_argument("--json", default=None, help="write the numbers to this JSON file")


def main(args) -> int:
    import torch

    from jaggc_studies.fewsteps.study import FewStepsOptions, main_fewsteps

    torch.set_num_threads(args.threads)
    if args.schedules is None:
        schedules = WIDE_SCHEDULES if args.base == "digits-wide" else DEFAULT_SCHEDULES
    else:
        schedules = tuple(n for text in args.schedules for n in text.split(",") if n)
    given = dict(base=args.base, trainable=args.trainable, cfg=args.cfg, budget=args.budget, iterations=args.iterations, seeds=args.seeds, seed=args.seed,
                 num_steps=args.num_steps, group_size=args.group_size, eval_per_class=args.eval_per_class,
                 schedules=schedules, progress=not args.no_progress)
    if args.quick:
        given.update(QUICK, base=args.base)
    main_fewsteps(FewStepsOptions(**given), json_path=args.json, out=None if args.no_pictures else args.out)
    return 0


__all__ = ["QUICK", "add_arguments", "main"]
