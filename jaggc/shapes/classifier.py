"""Two shape classifiers, ``reward`` (scores GRPO rollouts: reward = p(target class)) and a held-out
``eval`` (judges sample quality), with the digits' architectures and recipe
(``jaggc.digits.classifier``: RewardCNN / EvalCNN, seeds 1 / 2, the eval one trained with +-1 pixel
shifts and pixel noise) at 6 classes on the shapes train split.

``python -m jaggc.shapes.classifier`` trains both and writes ``weights/classifier_{reward,eval}.pt`` (fp16).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from jaggc.digits.classifier import _SPECS, _check_kind, train_and_ship, train_classifier
from jaggc.digits.model import load_shipped

from .data import NUM_CLASSES, load_shapes_split
from .model import WEIGHTS_DIR

CLASSIFIER_REGEN_COMMAND = "python -m jaggc.shapes.classifier"
DEFAULT_EPOCHS = 12


def classifier_path(kind: str) -> Path:
    return WEIGHTS_DIR / f"classifier_{kind}.pt"


def train_shapes_classifier(kind: str, *, epochs: int = DEFAULT_EPOCHS) -> nn.Module:
    return train_classifier(kind, epochs=epochs, data=load_shapes_split("train"), num_classes=NUM_CLASSES)


@torch.no_grad()
def accuracy(model: nn.Module, split: str = "test") -> float:
    data = load_shapes_split(split)
    return (model(data.images).argmax(-1) == data.labels).float().mean().item()


def load_classifier(kind: str = "reward", path: str | Path | None = None) -> nn.Module:
    """The shipped shapes ``reward`` or ``eval`` classifier: eval mode, float32, logits (B, 6)."""
    _check_kind(kind)
    return load_shipped(_SPECS[kind][0](NUM_CLASSES), Path(path) if path is not None else classifier_path(kind),
                        CLASSIFIER_REGEN_COMMAND, weights_dir=WEIGHTS_DIR)


_CACHE: dict[str, nn.Module] = {}


def classifier_reward(images: torch.Tensor, labels: torch.Tensor, *, which: str = "reward") -> torch.Tensor:
    """p(target class | image) under the shapes classifier ``which`` (images in [-1, 1], clamped)."""
    if which not in _CACHE:
        _CACHE[which] = load_classifier(which)
    labels = torch.as_tensor(labels, dtype=torch.int64)
    with torch.no_grad():
        probs = torch.softmax(_CACHE[which](images.detach().float().clamp(-1, 1)), dim=-1)
    return probs.gather(1, labels[:, None]).squeeze(1).float()


def main(argv: list[str] | None = None) -> None:
    train_and_ship(argv, __doc__.splitlines()[0], default_epochs=DEFAULT_EPOCHS, out_dir=WEIGHTS_DIR,
                   train=train_shapes_classifier, accuracy=accuracy, load=load_classifier)


if __name__ == "__main__":
    main()
