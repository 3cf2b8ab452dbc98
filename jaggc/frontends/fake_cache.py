"""Reuse the DiT's fake-tensor output across identical opaque calls of one trace.

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
cached. The FX frontend caches the example values of the loss's own ops the same way
(``example_values``): every step repeats the previous step's ops on tensors of the same shapes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._compat import detect_fake_mode, is_fake, tree_flatten, tree_unflatten
from ..runtime.autocast import autocast_cache_disabled

# fake mode -> {(module id, signature): recorded output}
_CACHES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's metadata; answers the metadata questions a loss asks (``x.ndim``, ``x.size(1)``)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(torch.Size(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)

    def fresh(self) -> torch.Tensor:
        """A new fake tensor like the recorded one (called inside the trace's fake mode)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        # a non-leaf, as the real DiT output is (Dynamo treats leaves requiring grad as inputs)
        return t.requires_grad_(True).clone() if self.requires_grad else t

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]


def _concrete(values) -> bool:
    return all(type(v) is int for v in values)


_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _constant_key(leaf):
    if leaf is None or leaf is Ellipsis or isinstance(leaf, _CONSTANTS):
        return (type(leaf).__name__, leaf)
    if isinstance(leaf, slice):   # x[:, j]; slices are unhashable before Python 3.12
        parts = (leaf.start, leaf.stop, leaf.step)
        return ("slice", parts) if all(p is None or type(p) is int for p in parts) else None
    return None


def signature(owner, args: tuple, kwargs: dict):
    """A hashable key of everything that decides the output's metadata, or None if the call
    cannot be keyed exactly. ``owner`` is the module (keyed by identity) or the op."""
    leaves, spec = tree_flatten((args, kwargs))
    key = []
    for leaf in leaves:
        if isinstance(leaf, TensorMeta):
            key.append(("T", "FakeTensor", leaf))
        elif isinstance(leaf, torch.Tensor):
            if not (_concrete(leaf.shape) and _concrete(leaf.stride())):
                return None   # symbolic shapes: the output shape is an expression, not a value
            key.append(("T", type(leaf).__name__, TensorMeta.of(leaf)))
        else:
            constant = _constant_key(leaf)
            if constant is None:
                return None
            key.append(constant)
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    owner_key = id(owner) if isinstance(owner, torch.nn.Module) else owner
    return (owner_key, str(spec), tuple(key), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            autocast)


def cached_fake_call(owner, run: Callable, args: tuple, kwargs: dict, *, mode=None, as_metadata: bool = False):
    """``run(*args, **kwargs)`` on fake inputs, or the recorded output of an identical earlier call
    of ``owner`` (a module, or an op whose output metadata is a function of its inputs').

    ``mode``: the fake mode whose cache to use (default: the inputs'). ``as_metadata``: a recorded
    output is returned as ``TensorMeta`` leaves instead of fresh fake tensors (the FX frontend's
    example values; ``run`` then receives ``TensorMeta`` leaves as they are and materialises them).
    """
    if mode is None:
        mode = detect_fake_mode([x for x in tree_flatten((args, kwargs))[0] if is_fake(x)])
    if mode is None:
        return run(*args, **kwargs)     # a real call (the opaque slot at run time): nothing to cache
    key = signature(owner, args, kwargs)
    if key is None:
        with autocast_cache_disabled():
            return run(*args, **kwargs)
    cache = _CACHES.setdefault(mode, {})
    recorded = cache.get(key)
    if recorded is None:
        # a fake run under the loss's autocast would leave fake casts of the real parameters in
        # autocast's weight-cast cache, where the next real op of the region finds them
        with autocast_cache_disabled():
            out = run(*args, **kwargs)
        out_leaves, out_spec = tree_flatten(out)
        if not all(not isinstance(x, torch.Tensor) or (_concrete(x.shape) and _concrete(x.stride()))
                   for x in out_leaves):
            return out
        cache[key] = (out_spec, [TensorMeta.of(x) if isinstance(x, torch.Tensor) else x for x in out_leaves])
        return out
    out_spec, metas = recorded
    if as_metadata:
        return tree_unflatten(list(metas), out_spec)
    return tree_unflatten([m.fresh() if isinstance(m, TensorMeta) else m for m in metas], out_spec)
