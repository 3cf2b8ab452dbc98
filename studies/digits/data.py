"""The shipped data set: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes).

Images are scaled from sklearn's 0..16 grey levels to [-1, 1] and shaped (N, 1, 8, 8): the DiT
works directly in pixel space (the "latents" of this example are the pixels). The split is fixed
(stratified, seeded) so the base model, the classifiers and the held-out evaluation never mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IMAGE_SHAPE = (1, 8, 8)
NUM_CLASSES = 10


@dataclass(frozen=True)
class DigitsSplit:
    images: torch.Tensor  # (N, 1, 8, 8) float32 in [-1, 1]
    labels: torch.Tensor  # (N,) int64


def load_digits_split(split: str = "train", *, test_fraction: float = 0.25, seed: int = 0) -> DigitsSplit:
    """The train or held-out test split of sklearn's digits (stratified, deterministic)."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: use 'train' or 'test'")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.images, data.target, test_size=test_fraction, random_state=seed, stratify=data.target)
    x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
    images = torch.as_tensor(x, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    return DigitsSplit(images=images.contiguous(), labels=torch.as_tensor(y, dtype=torch.int64))
