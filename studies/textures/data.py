"""The textures data set: procedurally generated 8x8 grey images of six texture classes.

A third kind of image, after digits (strokes) and shapes (objects): periodic and smooth patterns
that fill the frame. Every image is rendered from a seeded generator, so a split is a pure function
of its seed; nothing is downloaded. Classes:

    0 horizontal stripes   1 vertical stripes   2 diagonal stripes (/)   3 diagonal stripes (\\)
    4 checkerboard         5 radial blob (bright centre, dark rim)

Each image has a random period (2.5 to 4 pixels), phase, contrast in [0.5, 1] and brightness
offset; pixels lie in [-1, 1] like the digits. Shape (N, 1, 8, 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jaggc_studies.shapes.data import generate_balanced

IMAGE_SHAPE = (1, 8, 8)
NUM_CLASSES = 6
CLASS_NAMES = ("horizontal stripes", "vertical stripes", "diagonal /", "diagonal \\", "checkerboard", "radial blob")
SPLITS = {"train": (6000, 10), "test": (1200, 11)}   # split -> (size, seed)


@dataclass(frozen=True)
class TexturesSplit:
    images: torch.Tensor  # (N, 1, 8, 8) float32 in [-1, 1]
    labels: torch.Tensor  # (N,) int64


def _pattern(label: int, u: torch.Tensor) -> torch.Tensor:
    """A pattern (8, 8) in [-1, 1] of class ``label``; ``u`` (5,) uniforms set period, phase, centre."""
    c = torch.arange(8, dtype=torch.float64) + 0.5
    yy, xx = torch.meshgrid(c, c, indexing="ij")
    period = 2.5 + 1.5 * float(u[0])
    phase = 2 * math.pi * float(u[1])
    k = 2 * math.pi / period
    if label == 0:
        return torch.sin(k * yy + phase)
    if label == 1:
        return torch.sin(k * xx + phase)
    if label == 2:
        return torch.sin(k * (xx + yy) / math.sqrt(2) + phase)
    if label == 3:
        return torch.sin(k * (xx - yy) / math.sqrt(2) + phase)
    if label == 4:
        return torch.sin(k * xx + phase) * torch.sin(k * yy + phase)
    if label == 5:
        cy, cx = 2.5 + 3 * float(u[2]), 2.5 + 3 * float(u[3])
        r2 = (yy - cy) ** 2 + (xx - cx) ** 2
        return 2 * torch.exp(-r2 / (2 * (1.2 + 0.8 * float(u[0])) ** 2)) - 1
    raise ValueError(f"label {label} not in 0..{NUM_CLASSES - 1}")


def render(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Images (N, 1, 8, 8) in [-1, 1] for ``labels`` (N,), deterministic in ``generator``'s state."""
    labels = torch.as_tensor(labels, dtype=torch.int64)
    u = torch.rand(len(labels), 6, generator=generator, dtype=torch.float64)
    out = torch.empty(len(labels), 1, 8, 8, dtype=torch.float64)
    for i, label in enumerate(labels.tolist()):
        contrast = 0.5 + 0.5 * float(u[i, 4])
        offset = (1 - contrast) * (2 * float(u[i, 5]) - 1)
        out[i, 0] = (contrast * _pattern(label, u[i]) + offset).clamp(-1, 1)
    return out.float()


def load_textures_split(split: str = "train") -> TexturesSplit:
    """The train (6000) or test (1200) split; balanced classes, deterministic (fixed seeds)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use 'train' or 'test'")
    images, labels = generate_balanced(render, NUM_CLASSES, *SPLITS[split])
    return TexturesSplit(images=images.clone(), labels=labels.clone())
