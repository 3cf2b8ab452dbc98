"""Pretrain the textures base DiT (tiny Qwen-Image) with flow matching on the textures train split.

``python -m jaggc_studies.textures.train_base [--out PATH] [--steps N]``: the digits recipe
(``jaggc_studies.digits.train_base.train_base``) on ``load_textures_split("train")`` with ``build_dit`` /
``class_conditioning`` of ``jaggc_studies.textures.model``. One thread, deterministic. Writes fp16 weights
to ``studies/textures/weights/base_qwen.pt`` and prints the held-out classifier's accuracy on ODE
samples of the result (the classifiers come first: ``python -m jaggc_studies.textures.classifier``).
"""

from __future__ import annotations

import torch

from jaggc_studies.digits.sampling import DEFAULT_NUM_STEPS, DEFAULT_SHIFT, sample_ode
from jaggc_studies.digits.train_base import base_training_parser, run_base_training, train_base

from jaggc_studies.textures.data import IMAGE_SHAPE, NUM_CLASSES, load_textures_split
from jaggc_studies.textures.model import BASE_WEIGHTS, TEXTURES_CONFIG, build_dit, class_conditioning

DEFAULTS = dict(steps=3000, batch_size=64, lr=1e-3, seed=0, ema_decay=0.999, sigma_scheme="logit-normal")


def train_textures_base(*, steps: int = DEFAULTS["steps"], batch_size: int = DEFAULTS["batch_size"],
                        lr: float = DEFAULTS["lr"], seed: int = DEFAULTS["seed"],
                        ema_decay: float = DEFAULTS["ema_decay"], scheme: str = DEFAULTS["sigma_scheme"],
                        eval_every: int = 0, log_every: int = 250):
    """The EMA Qwen-Image DiT (eval mode) after ``steps`` flow-matching steps."""
    return train_base(steps=steps, batch_size=batch_size, lr=lr, seed=seed, ema_decay=ema_decay, scheme=scheme,
                      eval_every=eval_every, log_every=log_every, data=load_textures_split("train"),
                      dit=build_dit(seed=seed), conditioning=class_conditioning,
                      eval_fn=(lambda ema: f"eval accuracy {sample_accuracy(ema, per_class=20):.3f}") if eval_every
                      else None)


@torch.no_grad()
def sample_accuracy(dit, *, per_class: int = 50, seed: int = 0) -> float:
    """Held-out classifier accuracy on Euler-ODE samples of every class."""
    from jaggc_studies.textures.classifier import load_classifier

    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    images = sample_ode(dit, labels, num_steps=DEFAULT_NUM_STEPS, shift=DEFAULT_SHIFT,
                        generator=torch.Generator().manual_seed(seed), image_shape=IMAGE_SHAPE,
                        conditioning=class_conditioning).clamp(-1, 1)
    return (load_classifier("eval")(images).argmax(-1) == labels).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = base_training_parser(__doc__.splitlines()[0], DEFAULTS, BASE_WEIGHTS)
    args = parser.parse_args(argv)
    run_base_training(args, train_textures_base, TEXTURES_CONFIG)
    from jaggc_studies.textures.model import load_base

    print(f"held-out classifier accuracy on 300 ODE samples: {sample_accuracy(load_base(args.out)):.4f}")


if __name__ == "__main__":
    main()
