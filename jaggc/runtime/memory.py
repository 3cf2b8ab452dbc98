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
from typing import Callable, Iterable

import torch

from .._compat import local_shard


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
def track_saved_tensors(parameter_storages: Callable[[], Iterable[torch.Tensor]] | None = None):
    """Yields SavedTensorStats updated while graphs built inside the context are alive.

    ``parameter_storages``: called at each save, tensors whose storage holds parameters that are
    not autograd leaves (FSDP1 computes with views of its unsharded FlatParameter, which it frees
    after the forward whatever autograd saved): a saved view of one is not activation memory."""
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
        if parameter_storages is not None and storage.data_ptr() in {
                p.untyped_storage().data_ptr() for p in parameter_storages()}:
            return box
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


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard): what
    they take in memory, where several can be views of one allocation (FSDP2's reduce-scatter
    output holds a whole parameter group's gradient shards)."""
    seen: dict = {}
    for t in tensors:
        if t is None:
            continue
        local = local_shard(t)
        storage = local.untyped_storage()
        seen[(local.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
