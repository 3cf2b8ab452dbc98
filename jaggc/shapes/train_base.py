"""Pretrain the shapes base DiT (tiny Flux) with flow matching on the shapes train split.

``python -m jaggc.shapes.train_base [--out PATH] [--steps N]``: the digits recipe
(``jaggc.digits.train_base.train_base``: rectified-flow objective, logit-normal sigma, AdamW with
warmup + cosine decay, gradient clipping 1, EMA of the parameters) on ``load_shapes_split("train")``
with ``build_dit`` / ``class_conditioning`` of ``jaggc.shapes.model``. One thread, deterministic.
Writes fp16 weights to ``jaggc/shapes/weights/base_flux.pt`` and, when the shapes classifiers
exist, prints the held-out classifier's accuracy on ODE samples of the result.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from jaggc.digits.model import save_fp16_state
from jaggc.digits.train_base import train_base

from .data import load_shapes_split
from .model import BASE_WEIGHTS, SHAPES_CONFIG, build_dit, class_conditioning

DEFAULTS = dict(steps=2500, batch_size=64, lr=1e-3, seed=0, ema_decay=0.999, sigma_scheme="logit-normal")


def train_shapes_base(*, steps: int = DEFAULTS["steps"], batch_size: int = DEFAULTS["batch_size"],
                      lr: float = DEFAULTS["lr"], seed: int = DEFAULTS["seed"],
                      ema_decay: float = DEFAULTS["ema_decay"], scheme: str = DEFAULTS["sigma_scheme"],
                      eval_every: int = 0, log_every: int = 250):
    """The EMA Flux DiT (eval mode) after ``steps`` flow-matching steps."""
    def sample_eval(ema):
        from .quality import sample_quality

        r = sample_quality(ema, per_class=20, seed=123)
        return (f"mean eval acc {r['mean_eval_accuracy']:.3f} (min {r['min_eval_accuracy']:.2f}), "
                f"reward p {r['mean_reward_p_target']:.3f}")

    eval_fn = sample_eval if eval_every else None
    return train_base(steps=steps, batch_size=batch_size, lr=lr, seed=seed, ema_decay=ema_decay, scheme=scheme,
                      eval_every=eval_every, log_every=log_every, data=load_shapes_split("train"),
                      dit=build_dit(seed=seed), conditioning=class_conditioning, eval_fn=eval_fn)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BASE_WEIGHTS)
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument("--ema-decay", type=float, default=DEFAULTS["ema_decay"])
    parser.add_argument("--sigma-scheme", choices=["logit-normal", "uniform"], default=DEFAULTS["sigma_scheme"])
    parser.add_argument("--eval-every", type=int, default=0, help="print EMA sample accuracy every N steps")
    parser.add_argument("--check-per-class", type=int, default=50,
                        help="ODE samples per class for the final accuracy check (0: skip it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # shared CPU; one thread also makes the run bit-reproducible
    start = time.time()
    ema = train_shapes_base(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                            ema_decay=args.ema_decay, scheme=args.sigma_scheme, eval_every=args.eval_every)
    save_fp16_state(ema, args.out, config=SHAPES_CONFIG,
                    train_args=dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                    ema_decay=args.ema_decay, sigma_scheme=args.sigma_scheme))
    print(f"trained {args.steps} steps in {time.time() - start:.0f}s -> {args.out}")
    if not args.check_per_class:
        return
    try:
        from .model import load_base
        from .quality import format_report, sample_quality

        print(format_report(sample_quality(load_base(args.out), per_class=args.check_per_class, seed=0)))
    except FileNotFoundError as exc:   # classifiers not trained yet
        print(f"(no sample check: {exc})")


if __name__ == "__main__":
    main()
