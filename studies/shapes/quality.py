"""Judge the shapes base: per-class accuracy of its ODE samples under the held-out classifier.

``python -m jaggc_studies.shapes.quality [--out docs/shapes_samples.png] [--per-class 50]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from jaggc_studies.digits.quality import save_grid
from jaggc_studies.digits.sampling import DEFAULT_NUM_STEPS, DEFAULT_SHIFT, sample_ode

from jaggc_studies.shapes.data import CLASS_NAMES, IMAGE_SHAPE, NUM_CLASSES
from jaggc_studies.shapes.model import class_conditioning


@torch.no_grad()
def sample_images(dit, labels, *, num_steps: int = DEFAULT_NUM_STEPS, shift: float = DEFAULT_SHIFT,
                  seed: int = 0) -> torch.Tensor:
    """Euler-ODE samples (B, 1, 8, 8) of the shapes DiT, clamped to [-1, 1]."""
    return sample_ode(dit, labels, num_steps=num_steps, shift=shift, generator=torch.Generator().manual_seed(seed),
                      image_shape=IMAGE_SHAPE, conditioning=class_conditioning).clamp(-1, 1)


@torch.no_grad()
def sample_quality(dit, *, per_class: int = 32, num_steps: int = DEFAULT_NUM_STEPS, shift: float = DEFAULT_SHIFT,
                   seed: int = 0, eval_clf=None, reward_clf=None) -> dict:
    from jaggc_studies.shapes.classifier import load_classifier

    eval_clf = eval_clf if eval_clf is not None else load_classifier("eval")
    reward_clf = reward_clf if reward_clf is not None else load_classifier("reward")
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    images = sample_images(dit, labels, num_steps=num_steps, shift=shift, seed=seed)
    correct = (eval_clf(images).argmax(-1) == labels).float()
    reward_correct = (reward_clf(images).argmax(-1) == labels).float()
    p_target = reward_clf(images).softmax(-1).gather(1, labels[:, None]).squeeze(1)
    per_class_acc = correct.view(NUM_CLASSES, per_class).mean(1)
    return dict(per_class_eval_accuracy=[round(a, 4) for a in per_class_acc.tolist()],
                mean_eval_accuracy=per_class_acc.mean().item(), min_eval_accuracy=per_class_acc.min().item(),
                mean_reward_accuracy=reward_correct.mean().item(), mean_reward_p_target=p_target.mean().item(),
                per_class=per_class, num_steps=num_steps, shift=shift, seed=seed, images=images)


def format_report(result: dict) -> str:
    lines = [f"shapes base ODE samples: {result['per_class']} per class, {result['num_steps']} Euler steps, "
             f"shift {result['shift']}, seed {result['seed']}"]
    lines += [f"  {CLASS_NAMES[c]:>13}: eval-classifier accuracy {a:.3f}"
              for c, a in enumerate(result["per_class_eval_accuracy"])]
    lines.append(f"  mean eval accuracy {result['mean_eval_accuracy']:.4f} (min class {result['min_eval_accuracy']:.3f}); "
                 f"reward classifier accuracy {result['mean_reward_accuracy']:.4f}, "
                 f"mean p(target) {result['mean_reward_p_target']:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from jaggc_studies.shapes.model import load_base

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--per-class", type=int, default=50)
    parser.add_argument("--steps", type=int, default=DEFAULT_NUM_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = sample_quality(load_base(), per_class=args.per_class, num_steps=args.steps, seed=args.seed)
    print(format_report(result))
    if args.out is not None:
        save_grid(result["images"], args.per_class, args.out, num_classes=NUM_CLASSES)
        print(f"sample grid -> {args.out}")


if __name__ == "__main__":
    main()
