"""Activation memory as autograd sees it: the live bytes of tensors saved for backward.

Process RSS on CPU is noisy (allocator caching, fragmentation) and CUDA's ``max_memory_allocated``
does not exist there; the tensors autograd saves for backward are exactly what a backward-mode
choice changes. ``track_saved_tensors`` counts each distinct storage once (many nodes save views
of one tensor) and leaves parameters out (they are alive anyway), and records the peak.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class SavedTensorStats:
    live_bytes: int = 0
    peak_bytes: int = 0
    _refs: dict = field(default_factory=dict)  # storage key -> [count, nbytes]


class _Saved:
    """What the pack hook stores instead of the tensor; its death is the tensor's release."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


@contextlib.contextmanager
def track_saved_tensors():
    """Yields SavedTensorStats updated while graphs built inside the context are alive."""
    stats = SavedTensorStats()

    def release(key):
        entry = stats._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            stats.live_bytes -= entry[1]
            del stats._refs[key]

    def pack(t: torch.Tensor):
        box = _Saved(t)
        # a parameter is not activation memory; a fake tensor (a capture tracing inside the
        # context) is no memory at all
        if (t.is_leaf and t.requires_grad) or type(t).__name__ == "FakeTensor":
            return box
        storage = t.untyped_storage()
        key = (t.device.type, storage.data_ptr())
        entry = stats._refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            stats.live_bytes += entry[1]
            stats.peak_bytes = max(stats.peak_bytes, stats.live_bytes)
        entry[0] += 1
        weakref.finalize(box, release, key)
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        yield stats
