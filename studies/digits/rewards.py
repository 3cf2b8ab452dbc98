"""Offline rewards for the digits GRPO example: p(target class) under a classifier, bold strokes
(a property the base was never trained for), and JPEG compressibility exactly as Flow-GRPO
computes it.

Every reward takes images (B, 1, 8, 8) in [-1, 1] (the DiT's pixel space) and the target labels
(B,) and returns a float32 tensor (B,); higher is better.
"""

from __future__ import annotations

import io
from typing import Callable

import numpy as np
import torch

from jaggc.errors import JaggInputError

JPEG_SIZE = 64      # pixels per side the 8x8 digits are upsampled to before JPEG coding
JPEG_QUALITY = 95   # Flow-GRPO's quality setting
JPEG_SCALE = 500.0  # Flow-GRPO returns -size_kb / 500
# Bold strokes: the mean ink (pixel intensity in [0, 1]) of sklearn's digits is 0.31 (10-90%
# of images: 0.26-0.35) and the base's SDE samples match it (median 0.325, 90th percentile 0.359),
# so an ink level of 0.45 is one the base meets rarely: its mean bold reward is about 0.02.
BOLD_INK = 0.45
BOLD_WIDTH = 0.03


def _check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        raise JaggInputError(f"input 'images' must be a (B, C, H, W) tensor in [-1, 1], got "
                             f"{getattr(images, 'shape', type(images))}")


def to_uint8_rgb(images: torch.Tensor, size: int = JPEG_SIZE) -> np.ndarray:
    """(B, 1, 8, 8) in [-1, 1] -> (B, size, size, 3) uint8, nearest upsampling.

    Flow-GRPO scores decoded RGB images in [0, 1]: ``(images * 255).round().clamp(0, 255)`` to
    uint8, NCHW -> NHWC. The grey digits are repeated over three channels so the JPEG coder sees
    what it sees there (an RGB image); at 8x8 a JPEG is nearly all header, hence the upsampling.
    """
    _check_images(images)
    x = ((images.detach().float().cpu() + 1) / 2).clamp(0, 1)
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="nearest")
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = (x * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    return x.transpose(0, 2, 3, 1)


def jpeg_reward(images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Flow-GRPO ``jpeg_compressibility`` (yifan123/flow_grpo, flow_grpo/rewards.py):
    JPEG at quality 95 through PIL, size in kB (bytes / 1000), reward = -size / 500.

    ``labels`` is accepted for a uniform reward signature and ignored.
    """
    from PIL import Image

    sizes = []
    for array in to_uint8_rgb(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=JPEG_QUALITY)
        sizes.append(buffer.tell() / 1000)
    return -torch.tensor(sizes, dtype=torch.float32) / JPEG_SCALE


def classifier_reward(images: torch.Tensor, labels: torch.Tensor, *, which: str = "reward") -> torch.Tensor:
    """p(target class | image) under the digits classifier ``which`` ("reward" for training,
    "eval" for a held-out check that the policy did not just fool the reward classifier)."""
    _check_images(images)
    from jaggc_studies.digits.classifier import load_classifier

    model = _cached_classifier(which, load_classifier)
    labels = torch.as_tensor(labels, dtype=torch.int64)
    with torch.no_grad():
        probs = torch.softmax(model(images.detach().float().clamp(-1, 1)), dim=-1)
    return probs.gather(1, labels[:, None]).squeeze(1).float()


def ink(images: torch.Tensor) -> torch.Tensor:
    """Mean pixel intensity in [0, 1] per image (B,): how much of the 8x8 canvas is inked."""
    _check_images(images)
    return ((images.detach().float().clamp(-1, 1) + 1) / 2).mean(dim=(1, 2, 3))


def bold_reward(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Bold digits, in [0, 1]: p(target class) x sigmoid((ink - BOLD_INK) / BOLD_WIDTH).

    The ink term asks for heavier strokes than any digit in the training data; the classifier term
    keeps them the right digit, so a blob of ink scores nothing."""
    return classifier_reward(images, labels) * torch.sigmoid((ink(images) - BOLD_INK) / BOLD_WIDTH)


_CLASSIFIERS: dict[str, torch.nn.Module] = {}


def _cached_classifier(which: str, load: Callable) -> torch.nn.Module:
    # loaded once per process: the trainer scores every iteration
    if which not in _CLASSIFIERS:
        model = load(which)
        model.eval()
        _CLASSIFIERS[which] = model
    return _CLASSIFIERS[which]


REWARDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bold": bold_reward,
    "classifier": classifier_reward,
    "classifier_eval": lambda images, labels: classifier_reward(images, labels, which="eval"),
    "jpeg": jpeg_reward,
}


def classifier_available() -> bool:
    """True when the trained digits classifiers can be imported and loaded."""
    try:
        from jaggc_studies.digits.classifier import load_classifier

        _cached_classifier("reward", load_classifier)
        return True
    except Exception:  # noqa: BLE001 - missing module or weights: fall back to another reward
        return False


def get_reward(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The reward function ``name`` (one of REWARDS): ``fn(images, labels) -> (B,)``."""
    if name not in REWARDS:
        raise JaggInputError(f"reward={name!r} is not known; choose one of {sorted(REWARDS)}")
    return REWARDS[name]


__all__ = ["BOLD_INK", "BOLD_WIDTH", "JPEG_QUALITY", "JPEG_SCALE", "JPEG_SIZE", "REWARDS", "bold_reward",
           "classifier_available", "classifier_reward", "get_reward", "ink", "jpeg_reward", "to_uint8_rgb"]
