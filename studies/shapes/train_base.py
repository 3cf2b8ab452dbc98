"""Pretrain the shapes base DiT (tiny Flux) with flow matching on the shapes train split.

``python -m jaggc_studies.shapes.train_base [--out PATH] [--steps N]``: the digits recipe
(``jaggc_studies.digits.train_base.train_base``: rectified-flow objective, logit-normal sigma, AdamW with
warmup + cosine decay, gradient clipping 1, EMA of the parameters) on ``load_shapes_split("train")``
with ``build_dit`` / ``class_conditioning`` of ``jaggc_studies.shapes.model``. One thread, deterministic.
Writes fp16 weights to ``studies/shapes/weights/base_flux.pt`` and, when the shapes classifiers
exist, prints the held-out classifier's accuracy on ODE samples of the result.
"""

from __future__ import annotations

from jaggc_studies.digits.train_base import base_training_parser, run_base_training, train_base

from jaggc_studies.shapes.data import load_shapes_split
from jaggc_studies.shapes.model import BASE_WEIGHTS, SHAPES_CONFIG, build_dit, class_conditioning

DEFAULTS = dict(steps=2500, batch_size=64, lr=1e-3, seed=0, ema_decay=0.999, sigma_scheme="logit-normal")


def train_shapes_base(*, steps: int = DEFAULTS["steps"], batch_size: int = DEFAULTS["batch_size"],
                      lr: float = DEFAULTS["lr"], seed: int = DEFAULTS["seed"],
                      ema_decay: float = DEFAULTS["ema_decay"], scheme: str = DEFAULTS["sigma_scheme"],
                      eval_every: int = 0, log_every: int = 250):
    """The EMA Flux DiT (eval mode) after ``steps`` flow-matching steps."""
    def sample_eval(ema):
        from jaggc_studies.shapes.quality import sample_quality

        r = sample_quality(ema, per_class=20, seed=123)
        return (f"mean eval acc {r['mean_eval_accuracy']:.3f} (min {r['min_eval_accuracy']:.2f}), "
                f"reward p {r['mean_reward_p_target']:.3f}")

    eval_fn = sample_eval if eval_every else None
    return train_base(steps=steps, batch_size=batch_size, lr=lr, seed=seed, ema_decay=ema_decay, scheme=scheme,
                      eval_every=eval_every, log_every=log_every, data=load_shapes_split("train"),
                      dit=build_dit(seed=seed), conditioning=class_conditioning, eval_fn=eval_fn)


def main(argv: list[str] | None = None) -> None:
    parser = base_training_parser(__doc__.splitlines()[0], DEFAULTS, BASE_WEIGHTS)
    parser.add_argument("--check-per-class", type=int, default=50,
                        help="ODE samples per class for the final accuracy check (0: skip it)")
    args = parser.parse_args(argv)
    run_base_training(args, train_shapes_base, SHAPES_CONFIG)
    if not args.check_per_class:
        return
    try:
        from jaggc_studies.shapes.model import load_base
        from jaggc_studies.shapes.quality import format_report, sample_quality

        print(format_report(sample_quality(load_base(args.out), per_class=args.check_per_class, seed=0)))
    except FileNotFoundError as exc:   # classifiers not trained yet
        print(f"(no sample check: {exc})")


if __name__ == "__main__":
    main()
