"""A write of FSDP2's sharded ``.grad`` that no version shows, seen where it happens.

torch's ``clip_grad_norm_`` (and the optimizers' foreach ``zero_grad``) on DTensor gradients reaches the
local shards through DTensor's ``__torch_dispatch__``, below autograd's in-place bookkeeping: neither the
DTensor's version nor its shard's moves (torch 2.13), and where the gradient is still zero, or the clip's
factor is 1, no value does either. So while a step's gradient is held back the ledger (steps/ledger.py)
puts a *tripwire* in its canaries' DTensor gradients: their local shard wrapped in a tensor
subclass that runs every op on the shard it holds and notes any op other than the accumulation FSDP2
itself makes (``add_``: its reduce-scatter adds into an existing gradient). A norm read, a multiply, a
zero all trip it; the ledger reads the flag on the host, with no device read. The wrappers are taken out
(the shards put back) when nothing is held back any more (``lay_tripwire``, ``lift_tripwire``).

Private PyTorch names used here: ``torch.Tensor._make_wrapper_subclass`` and DTensor's ``_local_tensor``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

_ACCUMULATE = {torch.ops.aten.add_.Tensor, torch.ops.aten._foreach_add_.List}


def _is_view(func) -> bool:
    """An op that returns an alias of its input and writes nothing (``to_local``'s view, ``detach``): the
    alias shares the shard's version counter, which the ledger reads."""
    schema = func._schema
    return not schema.is_mutable and bool(schema.returns) and schema.returns[0].alias_info is not None


class TripFlag:
    __slots__ = ("tripped", "what")

    def __init__(self):
        self.tripped, self.what = False, ""


class _Tripwire(torch.Tensor):
    """A local shard that notes the ops made on it (module docstring)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, flag: TripFlag):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                  device=inner.device, storage_offset=inner.storage_offset(),
                                                  requires_grad=False)
        out._shard, out.flag = inner, flag
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"_Tripwire({self._shard!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wires = []

        def unwrap(t):
            wires.append(t)
            return t._shard

        args, kwargs = tree_map_only(_Tripwire, unwrap, (args, kwargs))
        if func not in _ACCUMULATE and not _is_view(func):
            for w in wires:
                if not w.flag.tripped:
                    w.flag.tripped, w.flag.what = True, str(func.overloadpacket.__name__)
        out = func(*args, **kwargs)
        if func._schema.is_mutable and wires and isinstance(out, torch.Tensor) and out is wires[0]._shard:
            return wires[0]                 # an in-place op returns its (wrapped) first argument
        return out


def _is_dtensor(t) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "to_local")


def lay_tripwire(grad: torch.Tensor, flag: TripFlag) -> bool:
    """Wrap ``grad``'s (a DTensor's) local shard; False where it is no DTensor or wrapped already."""
    if not _is_dtensor(grad) or isinstance(grad._local_tensor, _Tripwire):
        return False
    grad._local_tensor = _Tripwire(grad._local_tensor, flag)
    return True


def lift_tripwire(grad: torch.Tensor) -> None:
    """Put ``grad``'s local shard back (a no-op where none is wrapped)."""
    if _is_dtensor(grad) and isinstance(grad._local_tensor, _Tripwire):
        grad._local_tensor = grad._local_tensor._shard


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The shard a tripwire holds, else ``t``."""
    return t._shard if isinstance(t, _Tripwire) else t


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (the tripwire's shard where one is laid), else ``t``. Not
    ``to_local()``: with grad enabled it hands out a new alias, whose version counter, made below
    autograd where a tripwire sits, is not the shard's."""
    local = getattr(t, "_local_tensor", None)
    return _unwrapped(local) if isinstance(local, torch.Tensor) else t


__all__ = ["TripFlag", "lay_tripwire", "lift_tripwire", "local_shard"]
