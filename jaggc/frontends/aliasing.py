"""Which of a call's input tensors share storage: what a graph that writes into its inputs assumes.

The effects analysis (passes/effects.py) orders an in-place write into a loss input against the
reads of every input that shares its storage, as the traced call's inputs did. A later call whose
inputs share storage differently (the states and the written buffer now views of one tensor)
would make that order wrong, so a graph that writes into its inputs is only reused for calls with
the traced aliasing: the FX cache treats another aliasing as a miss (a new trace), and the Dynamo
path refuses the call (``capture="auto"`` falls back to the intercept path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat import tree_flatten


def storage_of(t: torch.Tensor) -> StorageWeakRef:
    """A hashable handle of ``t``'s storage (equal for tensors that share it, fake ones included)."""
    return StorageWeakRef(t.untyped_storage())


def storage_groups(values: Any) -> tuple[int, ...]:
    """For each tensor leaf of ``values`` in flattening order, the index of the first tensor leaf
    that shares its storage (its own index if none does)."""
    first: dict[StorageWeakRef, int] = {}
    out = []
    tensors = [x for x in tree_flatten(values)[0] if isinstance(x, torch.Tensor)]
    for i, t in enumerate(tensors):
        out.append(first.setdefault(storage_of(t), i))
    return tuple(out)
