"""Helpers for testing a trainer's loss on a CPU the way it runs on a GPU.

Trainers write ``with torch.autocast("cuda", torch.bfloat16):`` around the DiT call (DanceGRPO,
MixGRPO, the JAGG author) or wrap the step in ``accelerator.autocast()``. On a machine without
CUDA such a block switches itself off (with a warning), so a CPU test of the trainer's loss runs in
fp32, takes other numbers, and sees another graph than the GPU run: a capture decision or a
dropped autocast that only happens on the GPU stays invisible.

``cuda_autocast_on_cpu()`` makes those blocks live on the CPU: inside it, ``torch.autocast("cuda",
...)`` (and ``torch.cuda.amp.autocast``) is a CPU autocast block with the same dtype, so the
trainer's own unmodified code computes in bf16 and any capture of it records the block, as on the
GPU. On a machine with CUDA it changes nothing.

    with jaggc.testing.cuda_autocast_on_cpu():
        loss = compiled(transformer, sample, ...)     # the block around the DiT call is live
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch


@contextlib.contextmanager
def cuda_autocast_on_cpu() -> Iterator[None]:
    """Run ``torch.autocast("cuda", dtype)`` blocks as CPU autocast blocks of that dtype while the
    context is open, when this machine has no CUDA (module docstring)."""
    if torch.cuda.is_available():
        yield
        return
    cls = torch.autocast
    original = cls.__init__

    @functools.wraps(original)
    def init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            # CUDA's default autocast dtype is float16; a block that names none keeps it
            device_type, dtype = "cpu", dtype if dtype is not None else torch.get_autocast_dtype("cuda")
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original
