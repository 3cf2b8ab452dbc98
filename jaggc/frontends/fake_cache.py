"""Reuse the DiT's fake-tensor output across identical opaque calls of one Dynamo trace.

Dynamo learns the output of each opaque DiT call by running the DiT on fake tensors: a full
forward's worth of Python dispatch per call, most of a capture's time (a 50-step loss = 50 fake
DiT forwards). Every step of a GRPO loss calls the DiT with inputs of the same shapes, so the
output's metadata (shape, stride, dtype, device, requires_grad) is the same for every call: it is
a function of the input metadata, the non-tensor arguments, grad/autocast mode and the module,
and the module is fixed during one trace. The first call of each signature runs for real; later
ones get fresh fake tensors with the recorded metadata.

The cache lives on the trace's FakeTensorMode, so it never outlives one trace: a later trace (the
model cast to another dtype, new parameters, a retrace after a guard failure) starts empty.
Calls whose signature cannot be keyed exactly (symbolic shapes, unhashable arguments) are never
cached.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .._compat import detect_fake_mode, tree_flatten, tree_unflatten

# fake mode -> {(module id, signature): recorded output}
_CACHES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "_TensorMeta":
        return _TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)

    def fresh(self) -> torch.Tensor:
        """A new fake tensor like the recorded one (called inside the trace's fake mode)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        # a non-leaf, as the real DiT output is (Dynamo treats leaves requiring grad as inputs)
        return t.requires_grad_(True).clone() if self.requires_grad else t


def _concrete(values) -> bool:
    return all(type(v) is int for v in values)


def signature(module: torch.nn.Module, args: tuple, kwargs: dict):
    """A hashable key of everything that decides the output's metadata, or None if the call
    cannot be keyed exactly."""
    leaves, spec = tree_flatten((args, kwargs))
    key = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not (_concrete(leaf.shape) and _concrete(leaf.stride())):
                return None   # symbolic shapes: the output shape is an expression, not a value
            key.append(("T", type(leaf).__name__, _TensorMeta.of(leaf)))
        elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype, torch.device)):
            key.append((type(leaf).__name__, leaf))
        else:
            return None
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (id(module), str(spec), tuple(key), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            autocast)


def cached_fake_call(module: torch.nn.Module, run: Callable, args: tuple, kwargs: dict):
    """``run(*args, **kwargs)`` on fake inputs, or the recorded output of an identical earlier call."""
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, FakeTensor)]
    mode = detect_fake_mode(leaves)
    key = signature(module, args, kwargs) if mode is not None else None
    if key is None:
        return run(*args, **kwargs)
    cache = _CACHES.setdefault(mode, {})
    recorded = cache.get(key)
    if recorded is None:
        out = run(*args, **kwargs)
        out_leaves, out_spec = tree_flatten(out)
        if not all(not isinstance(x, torch.Tensor) or (_concrete(x.shape) and _concrete(x.stride()))
                   for x in out_leaves):
            return out
        cache[key] = (out_spec, [_TensorMeta.of(x) if isinstance(x, torch.Tensor) else x for x in out_leaves])
        return out
    out_spec, metas = recorded
    return tree_unflatten([m.fresh() if isinstance(m, _TensorMeta) else m for m in metas], out_spec)
