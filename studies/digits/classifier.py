"""Two small CNN digit classifiers for the digits example: ``reward`` and ``eval``.

* ``reward`` scores GRPO rollouts (reward = p(target class)).
* ``eval`` is held out: a different architecture, seed and augmentation, used only to judge
  sample quality, so a policy that hacks the reward classifier shows up as a gap between the two.

Both map (B, 1, 8, 8) images in [-1, 1] to logits over 10 classes. Train and ship them with
``python -m jaggc_studies.digits.classifier`` (writes ``weights/classifier_{reward,eval}.pt``, fp16).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from jaggc_studies.digits.data import NUM_CLASSES, load_digits_split
from jaggc_studies.digits.model import WEIGHTS_DIR, load_shipped, save_fp16_state

CLASSIFIER_KINDS = ("reward", "eval")
CLASSIFIER_REGEN_COMMAND = "python -m jaggc_studies.digits.classifier"


class RewardCNN(nn.Module):
    """Three 3x3 convs, one pool, global average pool: small and smooth (a well-behaved reward)."""

    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 8x8 -> 4x4
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class EvalCNN(nn.Module):
    """A different design (GELU, two pools, dense head with dropout) so its errors differ."""

    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),   # 8x8 -> 4x4
            nn.Conv2d(32, 64, 3, padding=1), nn.GELU(), nn.MaxPool2d(2))   # 4x4 -> 2x2
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(256, 128), nn.GELU(),
                                  nn.Linear(128, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


# Per kind: architecture, seed, whether to train with augmentation (+-1 pixel shifts, mild
# pixel noise). The eval classifier is augmented so that it judges digits, not sklearn's exact
# stroke statistics; the reward classifier is not, so the two differ in what they are sensitive to.
_SPECS = {"reward": (RewardCNN, 1, False), "eval": (EvalCNN, 2, True)}


def classifier_path(kind: str) -> Path:
    return WEIGHTS_DIR / f"classifier_{kind}.pt"


def _check_kind(kind: str) -> None:
    if kind not in CLASSIFIER_KINDS:
        raise ValueError(f"kind={kind!r}: use one of {CLASSIFIER_KINDS}")


def _augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random +-1 pixel shift (background -1 fills the border) and N(0, 0.1) pixel noise."""
    shifts = torch.randint(-1, 2, (2,), generator=g).tolist()
    padded = F.pad(x, (1, 1, 1, 1), value=-1.0)
    x = padded[:, :, 1 + shifts[0]:9 + shifts[0], 1 + shifts[1]:9 + shifts[1]]
    return x + 0.1 * torch.randn(x.shape, generator=g)


def train_classifier(kind: str, *, epochs: int = 40, batch_size: int = 64, lr: float = 2e-3,
                     data=None, num_classes: int = NUM_CLASSES) -> nn.Module:
    """Train one classifier on the train split (deterministic in its seed). Defaults: the digits;
    another 8x8 data set passes its ``data`` (``.images``, ``.labels``) and ``num_classes``."""
    _check_kind(kind)
    cls, seed, augment = _SPECS[kind]
    torch.manual_seed(seed)
    model = cls(num_classes)
    data = load_digits_split("train") if data is None else data
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ((len(data.labels) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(data.labels), generator=g)
        for i in range(0, len(perm), batch_size):
            idx = perm[i:i + batch_size]
            x = data.images[idx]
            if augment:
                x = _augment(x, g)
            loss = F.cross_entropy(model(x), data.labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, split: str = "test") -> float:
    data = load_digits_split(split)
    return (model(data.images).argmax(-1) == data.labels).float().mean().item()


def load_classifier(kind: str = "reward", path: str | Path | None = None) -> nn.Module:
    """The shipped ``reward`` or ``eval`` classifier: eval mode, float32, logits (B, 10)."""
    _check_kind(kind)
    return load_shipped(_SPECS[kind][0](), Path(path) if path is not None else classifier_path(kind),
                        CLASSIFIER_REGEN_COMMAND)


def train_and_ship(argv: list[str] | None, description: str, *, default_epochs: int, out_dir: Path,
                   train: Callable[..., nn.Module], accuracy: Callable[[nn.Module, str], float],
                   load: Callable[[str, Path], nn.Module]) -> None:
    """The command line of a base's classifiers (digits and shapes): train each kind, ship it as
    fp16 and report the test accuracy of what ships (fp16 weights loaded back to fp32)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kinds", nargs="+", default=list(CLASSIFIER_KINDS), choices=CLASSIFIER_KINDS)
    parser.add_argument("--epochs", type=int, default=default_epochs)
    parser.add_argument("--out-dir", type=Path, default=out_dir)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # shared CPU; also keeps float reductions reproducible
    for kind in args.kinds:
        model = train(kind, epochs=args.epochs)
        acc = accuracy(model, "test")
        path = args.out_dir / f"classifier_{kind}.pt"
        save_fp16_state(model, path, kind=kind, test_accuracy=acc)
        shipped = accuracy(load(kind, path), "test")
        print(f"{kind}: test accuracy {acc:.4f} (fp32), {shipped:.4f} (shipped fp16) -> {path}")


def main(argv: list[str] | None = None) -> None:
    train_and_ship(argv, __doc__.splitlines()[0], default_epochs=40, out_dir=WEIGHTS_DIR, train=train_classifier,
                   accuracy=accuracy, load=load_classifier)


if __name__ == "__main__":
    main()
