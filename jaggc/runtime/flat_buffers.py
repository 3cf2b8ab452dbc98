"""Flat vectors the guard reuses from one probe to the next.

A probe works on a few flat vectors the size of the trainable parameters: the gradient before and
after the probed unit, each window's error, the exact gradient, and the block's running sums. Made
fresh each time, every one costs its page faults on the CPU, which has no caching allocator: at 9M
parameters a new vector costs 5.4x a copy into a held one (``python -m jaggc_studies.bench.flat_vectors``),
and such vectors were most of what a probe added beyond its backward passes
(``python -m jaggc_studies.loops.speed guard``).

The guard holds up to ``limit`` of them and hands one out again only when nothing else refers to its
storage (``_compat.storage_refs``): a ProbeResult an ``on_probe`` callback kept, the guard's last
result, a view of either, a state_dict taken from the block. Such a vector is never written; the
guard then takes a fresh one, as it did before. Only on the CPU: an accelerator's caching allocator
already reuses freed memory, for anything, where a held vector would pin it for the guard alone.
"""

from __future__ import annotations

import warnings

import torch

from .._compat import storage_refs


class FlatBuffers:
    """A small pool of flat vectors (module docstring)."""

    def __init__(self, limit: int = 16):
        self.limit = limit
        self._held: list[torch.Tensor] = []
        self._unknown_said = False

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised flat vector nothing else refers to."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        for held in self._held:
            if held.numel() == numel and held.dtype == dtype and held.device == device and self._free(held):
                return held.view(-1)
        fresh = torch.empty(numel, dtype=dtype, device=device)
        if len(self._held) < self.limit:
            self._held.append(fresh)
        # always a new alias: its reference to the storage is what marks the buffer taken (the held
        # tensor's own is the one reference a free buffer has)
        return fresh.view(-1)

    def _free(self, held: torch.Tensor) -> bool:
        refs = storage_refs(held)
        if refs is None and not self._unknown_said:
            self._unknown_said = True
            warnings.warn("jaggc guard: this torch has no storage reference count (_compat.storage_refs), so "
                          "the guard cannot tell a free flat vector from one still referred to: every probe takes "
                          "fresh ones, which costs page faults on the CPU (runtime/flat_buffers.py)", stacklevel=3)
        return refs == 1

    def like(self, t: torch.Tensor) -> torch.Tensor:
        return self.empty(t.numel(), t.dtype, t.device)

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        """``t.clone()`` (flattened) into a held vector."""
        return self.like(t).copy_(t.reshape(-1))

    @property
    def held(self) -> list[torch.Tensor]:
        return list(self._held)


__all__ = ["FlatBuffers"]
