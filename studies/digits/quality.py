"""Judge the digits base model: per-class accuracy of its ODE samples under the held-out classifier.

``python -m jaggc_studies.digits.quality [--out docs/digits_samples.png] [--json PATH]`` samples N images
per class with the shipped base model, prints per-class and mean accuracy of the ``eval``
classifier, the ``reward`` classifier's mean p(target class), and writes a grid (rows = classes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from jaggc_studies.digits.data import NUM_CLASSES
from jaggc_studies.digits.sampling import DEFAULT_NUM_STEPS, DEFAULT_SHIFT, sample_ode


@torch.no_grad()
def sample_quality(dit, *, per_class: int = 32, num_steps: int = DEFAULT_NUM_STEPS,
                   shift: float = DEFAULT_SHIFT, seed: int = 0, eval_clf=None, reward_clf=None) -> dict:
    """Samples ``per_class`` images of every class and scores them; returns numbers and images."""
    from jaggc_studies.digits.classifier import load_classifier

    eval_clf = eval_clf if eval_clf is not None else load_classifier("eval")
    reward_clf = reward_clf if reward_clf is not None else load_classifier("reward")
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    # Clamped to the data range the classifiers were trained on (as the GRPO rewards do).
    images = sample_ode(dit, labels, num_steps=num_steps, shift=shift,
                        generator=torch.Generator().manual_seed(seed)).clamp(-1, 1)
    correct = (eval_clf(images).argmax(-1) == labels).float()
    p_target = reward_clf(images).softmax(-1).gather(1, labels[:, None]).squeeze(1)
    per_class_acc = correct.view(NUM_CLASSES, per_class).mean(1)
    return dict(per_class_eval_accuracy=[round(a, 4) for a in per_class_acc.tolist()],
                mean_eval_accuracy=per_class_acc.mean().item(),
                min_eval_accuracy=per_class_acc.min().item(),
                mean_reward_p_target=p_target.mean().item(),
                per_class=per_class, num_steps=num_steps, shift=shift, seed=seed, images=images)


def save_grid(images: torch.Tensor, per_class: int, path: Path, columns: int = 16,
              num_classes: int = NUM_CLASSES) -> None:
    """A PNG grid: one row per class, the first ``columns`` samples of it, 8x8 pixels upscaled
    (the digits' and the other 8x8 bases' samples alike)."""
    from PIL import Image

    columns = min(columns, per_class)
    grid = images.view(num_classes, per_class, 8, 8)[:, :columns]
    grid = torch.nn.functional.pad(grid, (1, 1, 1, 1), value=-1.0)           # 1-pixel black border
    grid = grid.permute(0, 2, 1, 3).reshape(num_classes * 10, columns * 10)
    pixels = ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).resize((columns * 40, num_classes * 40), Image.NEAREST).save(path)


def format_report(result: dict) -> str:
    lines = [f"base model ODE samples: {result['per_class']} per class, {result['num_steps']} Euler steps, "
             f"shift {result['shift']}, seed {result['seed']}"]
    lines += [f"  class {c}: eval-classifier accuracy {a:.3f}"
              for c, a in enumerate(result["per_class_eval_accuracy"])]
    lines.append(f"  mean eval accuracy {result['mean_eval_accuracy']:.4f} (min class {result['min_eval_accuracy']:.3f}); "
                 f"reward classifier mean p(target) {result['mean_reward_p_target']:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from jaggc_studies.digits.model import load_base

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/digits_samples.png"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--per-class", type=int, default=50)
    parser.add_argument("--steps", type=int, default=DEFAULT_NUM_STEPS)
    parser.add_argument("--shift", type=float, default=DEFAULT_SHIFT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = sample_quality(load_base(), per_class=args.per_class, num_steps=args.steps,
                            shift=args.shift, seed=args.seed)
    print(format_report(result))
    save_grid(result["images"], args.per_class, args.out)
    print(f"sample grid -> {args.out}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({k: v for k, v in result.items() if k != "images"}, indent=2))
        print(f"numbers -> {args.json}")


if __name__ == "__main__":
    main()
