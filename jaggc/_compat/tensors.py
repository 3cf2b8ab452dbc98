"""Tensor and op internals: a tensor's in-place version counter, the arguments an aten op's schema
marks as written, and the base class of a Python dispatch mode."""

from __future__ import annotations

import operator

import torch


def dispatch_mode_base():
    """The base class of a Python dispatch mode (sees every aten op run on real tensors)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def written_arguments(func, args: tuple, kwargs: dict) -> list:
    """The tensors an aten op (as a dispatch mode sees it) writes in place: the arguments its
    schema marks as written (``Tensor(a!)``: ``self`` of ``add_``, ``out=``, each of a written
    list). The intercept path saves an input before the loss's first write into it. The schema is
    only reachable as ``OpOverload._schema``."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor))
    return out


def version_counter(t) -> int:
    """A tensor's in-place version counter, bumped by every in-place write (optimizer steps
    included): the rollout cache's cheap test that the parameters are still the recording's.
    ``Tensor._version`` is what autograd's "modified by an inplace operation" check reads; torch
    exposes it under no public name."""
    return t._version


def version_counters(tensors) -> list[int]:
    """``version_counter`` of each tensor, read in C (``operator.attrgetter``): the ledger reads every
    parameter's once per step."""
    return list(map(_VERSION, tensors))


_VERSION = operator.attrgetter("_version")


def storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors (views included) refer to ``t``'s storage: 1 when ``t`` is its only holder.
    The guard's FlatBuffers reuse a flat vector only then (runtime/flat_buffers.py). A storage's
    reference count has no public name; ``untyped_storage()`` itself holds one more while it is read.
    None where this torch lacks it (the caller then treats every storage as shared)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return use_count(t.untyped_storage()._cdata) - 1
