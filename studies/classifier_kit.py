"""The reward and eval classifiers of a base trained on generated images (shapes, textures).

Each such base ships two classifiers with the digits' architectures and recipe
(``jaggc_studies.digits.classifier``: RewardCNN / EvalCNN, the eval one trained with pixel shifts and
noise): ``reward`` scores GRPO rollouts (reward = p(target class)), the held-out ``eval`` judges
sample quality. ``ClassifierKit`` is that pair for one base: where its weights live, its data and
class count, and the command that regenerates them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from jaggc_studies.digits.classifier import _SPECS, _check_kind, train_and_ship, train_classifier
from jaggc_studies.digits.model import load_shipped


class ClassifierKit:
    def __init__(self, *, weights_dir: Path, num_classes: int, load_split: Callable, regen_command: str,
                 default_epochs: int = 12):
        self.weights_dir, self.num_classes, self.load_split = weights_dir, num_classes, load_split
        self.regen_command, self.default_epochs = regen_command, default_epochs
        self._cache: dict[str, nn.Module] = {}

    def classifier_path(self, kind: str) -> Path:
        return self.weights_dir / f"classifier_{kind}.pt"

    def train(self, kind: str, *, epochs: int | None = None) -> nn.Module:
        return train_classifier(kind, epochs=epochs or self.default_epochs, data=self.load_split("train"),
                                num_classes=self.num_classes)

    @torch.no_grad()
    def accuracy(self, model: nn.Module, split: str = "test") -> float:
        data = self.load_split(split)
        return (model(data.images).argmax(-1) == data.labels).float().mean().item()

    def load_classifier(self, kind: str = "reward", path: str | Path | None = None) -> nn.Module:
        """The shipped ``reward`` or ``eval`` classifier: eval mode, float32, logits (B, classes)."""
        _check_kind(kind)
        return load_shipped(_SPECS[kind][0](self.num_classes), Path(path) if path is not None else
                            self.classifier_path(kind), self.regen_command, weights_dir=self.weights_dir)

    def classifier_reward(self, images: torch.Tensor, labels: torch.Tensor, *, which: str = "reward") -> torch.Tensor:
        """p(target class | image) under classifier ``which`` (images in [-1, 1], clamped)."""
        if which not in self._cache:
            self._cache[which] = self.load_classifier(which)
        labels = torch.as_tensor(labels, dtype=torch.int64)
        with torch.no_grad():
            probs = torch.softmax(self._cache[which](images.detach().float().clamp(-1, 1)), dim=-1)
        return probs.gather(1, labels[:, None]).squeeze(1).float()

    def main(self, argv: list[str] | None, description: str) -> None:
        train_and_ship(argv, description, default_epochs=self.default_epochs, out_dir=self.weights_dir,
                       train=self.train, accuracy=self.accuracy, load=self.load_classifier)
