"""The shapes data set: procedurally generated 8x8 grey images of six shape classes.

Nothing is downloaded: every image is rendered from a seeded generator (4x4 supersampling per
pixel, so edges are anti-aliased), so a split is a pure function of its seed. Classes:

    0 filled square   1 hollow square   2 disc   3 ring   4 plus   5 diagonal bar

Each image has a random size, position (the shape always fits inside the 8x8 frame) and
foreground intensity in [0.45, 1]; the background is -1 and a pixel is -1 + 2 · intensity ·
coverage, so pixels lie in [-1, 1] like the digits. Shape (N, 1, 8, 8), the DiT works in pixel
space as for the digits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

IMAGE_SHAPE = (1, 8, 8)
NUM_CLASSES = 6
CLASS_NAMES = ("filled square", "hollow square", "disc", "ring", "plus", "diagonal bar")
SPLITS = {"train": (6000, 0), "test": (1200, 1)}   # split -> (size, seed)
_SUPER = 4   # sub-samples per pixel side


@dataclass(frozen=True)
class ShapesSplit:
    images: torch.Tensor  # (N, 1, 8, 8) float32 in [-1, 1]
    labels: torch.Tensor  # (N,) int64


def _grid(size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-pixel sample coordinates (y, x), each (size*_SUPER, size*_SUPER), in pixel units."""
    c = (torch.arange(size * _SUPER, dtype=torch.float64) + 0.5) / _SUPER
    return torch.meshgrid(c, c, indexing="ij")


def _coverage(label: int, u: torch.Tensor) -> torch.Tensor:
    """Fractional coverage (8, 8) of one shape of class ``label``; ``u`` (6,) uniforms set its
    size, position and orientation."""
    yy, xx = _grid()
    u = u.double()
    if label in (0, 1):                                  # squares: half side h
        h = 1.5 + 1.5 * u[0] if label == 0 else 2.5 + 1.4 * u[0]
        cy, cx = h + (8 - 2 * h) * u[1], h + (8 - 2 * h) * u[2]
        cheb = torch.maximum((yy - cy).abs(), (xx - cx).abs())
        mask = cheb <= h if label == 0 else (cheb <= h) & (cheb >= h - 1.0)
    elif label in (2, 3):                                # disc / ring: radius r
        r = 2.0 + 1.5 * u[0] if label == 2 else 2.6 + 1.35 * u[0]
        cy, cx = r + (8 - 2 * r) * u[1], r + (8 - 2 * r) * u[2]
        d = torch.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
        mask = d <= r if label == 2 else (d <= r) & (d >= r - 1.1)
    elif label == 4:                                     # plus: arm half-length L, width 1.2
        L = 2.5 + 1.45 * u[0]
        cy, cx = L + (8 - 2 * L) * u[1], L + (8 - 2 * L) * u[2]
        dy, dx = (yy - cy).abs(), (xx - cx).abs()
        mask = ((dy <= 0.6) & (dx <= L)) | ((dx <= 0.6) & (dy <= L))
    elif label == 5:                                     # diagonal bar, either diagonal
        L = 2.6 + 1.2 * u[0]                             # half-length along the bar
        ext = L / math.sqrt(2) + 0.5
        cy, cx = ext + (8 - 2 * ext) * u[1], ext + (8 - 2 * ext) * u[2]
        s = 1.0 if u[3] < 0.5 else -1.0
        along = ((xx - cx) + s * (yy - cy)) / math.sqrt(2)
        across = ((xx - cx) - s * (yy - cy)) / math.sqrt(2)
        mask = (along.abs() <= L) & (across.abs() <= 0.75)
    else:
        raise ValueError(f"label {label} not in 0..{NUM_CLASSES - 1}")
    return mask.double().view(8, _SUPER, 8, _SUPER).mean(dim=(1, 3))


def render(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Images (N, 1, 8, 8) in [-1, 1] for ``labels`` (N,), deterministic in ``generator``'s state."""
    labels = torch.as_tensor(labels, dtype=torch.int64)
    u = torch.rand(len(labels), 6, generator=generator, dtype=torch.float64)
    out = torch.empty(len(labels), 1, 8, 8, dtype=torch.float64)
    for i, label in enumerate(labels.tolist()):
        intensity = 0.45 + 0.55 * u[i, 5]
        out[i, 0] = -1.0 + 2.0 * intensity * _coverage(label, u[i])
    return out.float()


@lru_cache(maxsize=8)
def generate_balanced(render_fn, num_classes: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images of balanced, shuffled classes drawn by ``render_fn(labels, generator)``,
    deterministic in ``seed`` (cached: the classifiers and the bases load the same splits)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % num_classes
    labels = labels[torch.randperm(n, generator=g)]
    return render_fn(labels, g), labels


def load_shapes_split(split: str = "train") -> ShapesSplit:
    """The train (6000) or test (1200) split; balanced classes, deterministic (fixed seeds)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use 'train' or 'test'")
    images, labels = generate_balanced(render, NUM_CLASSES, *SPLITS[split])
    return ShapesSplit(images=images.clone(), labels=labels.clone())


__all__ = ["CLASS_NAMES", "IMAGE_SHAPE", "NUM_CLASSES", "SPLITS", "ShapesSplit", "load_shapes_split", "render"]
