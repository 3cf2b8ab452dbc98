"""The FSDP gradient-slot subsystem: where a sharded module keeps its gradients between backward
passes (``GradSlot``, one per FSDP1 FlatParameter or FSDP2 parameter), which FSDP a module uses
(``fsdp_version``), and every slot of a module (``fsdp_gradient_slots``). The comment below says why."""

from __future__ import annotations

import torch


# --- FSDP: where a sharded module keeps its gradients between backward passes -----------------
# The low-memory mode runs some windows' backward inside the loss's forward, through FSDP's own
# hooks (they gather parameters, recompute checkpointed blocks and reduce-scatter), and must take
# what that backward added to the gradients out of FSDP's storage, keep it aside and add it back,
# times the loss's grad_output, when ``loss.backward()`` has finished. Neither FSDP exposes that
# storage: FSDP1 keeps each unit's gradient on its FlatParameter (sharded after a synced backward,
# unsharded inside ``no_sync()``, a sharded remainder in ``_saved_grad_shard`` across no_sync
# steps) and, with ``use_orig_params=True``, views of it on the original parameters; FSDP2 keeps a
# synced gradient on the sharded DTensor parameter and, with ``set_requires_gradient_sync(False)``,
# the unsharded one on its private unsharded parameter. A ``GradSlot`` is one such storage with
# the three operations the low-memory mode needs, each leaving FSDP's own invariants as FSDP
# would (tests/runtime/test_sharded.py runs them under both FSDPs, both ``use_orig_params``, and the
# user's no-sync micro-steps).

class GradSlot:
    """One gradient as FSDP keeps it between backward passes (FSDP1: a unit's FlatParameter;
    FSDP2: one parameter)."""

    name: str

    def stash(self):
        """Take every gradient FSDP holds here out of its reach (it will accumulate a fresh one);
        returns what ``restore`` puts back."""
        raise NotImplementedError

    def take(self):
        """The gradient the backward since ``stash`` left here (None if none), removed."""
        raise NotImplementedError

    def restore(self, stashed) -> None:
        raise NotImplementedError

    def add(self, grad: torch.Tensor, alpha: float) -> None:
        """Add ``alpha * grad`` (a tensor ``take`` returned) to what FSDP holds now."""
        raise NotImplementedError

    def graph_leaf(self) -> torch.Tensor | None:
        """The tensor autograd accumulates this gradient into during a backward."""
        raise NotImplementedError

    def shard(self) -> torch.Tensor:
        """This rank's shard of the parameter (a synced backward leaves a gradient of its size)."""
        raise NotImplementedError

    def held(self) -> list[torch.Tensor]:
        """The gradient tensors FSDP holds here now (for measurements; DTensors as they are)."""
        raise NotImplementedError


_NO_ATTR = object()


class _Fsdp1Slot(GradSlot):
    def __init__(self, name, handle):
        self.name, self.handle, self.flat = name, handle, handle.flat_param
        self.orig = list(self.flat._params) if handle._use_orig_params else []

    def stash(self):
        saved = (self.flat.grad, getattr(self.flat, "_saved_grad_shard", _NO_ATTR), [p.grad for p in self.orig])
        self.flat.grad = None
        if saved[1] is not _NO_ATTR:
            del self.flat._saved_grad_shard
        for p in self.orig:      # else FSDP's pre-unshard writes these views back into .grad
            p.grad = None
        return saved

    def take(self):
        grad, self.flat.grad = self.flat.grad, None
        return grad

    def restore(self, stashed) -> None:
        grad, saved_shard, orig = stashed
        _assign_grad(self.flat, grad)
        if saved_shard is not _NO_ATTR:
            self.flat._saved_grad_shard = saved_shard
        elif hasattr(self.flat, "_saved_grad_shard"):
            del self.flat._saved_grad_shard
        for p, g in zip(self.orig, orig):
            _assign_grad(p, g)

    def graph_leaf(self):
        return self.flat

    def held(self):
        return [g for g in (self.flat.grad, getattr(self.flat, "_saved_grad_shard", None)) if g is not None]

    def shard(self):
        return getattr(self.flat, "_local_shard", self.flat)   # set at FSDP's lazy init

    def add(self, grad, alpha) -> None:
        if self.flat.grad is not None:
            _check_same_layout(self.name, self.flat.grad, grad)
            self.flat.grad.add_(grad, alpha=alpha)   # in place: the original parameters view it
            return
        _assign_grad(self.flat, grad.mul(alpha))
        if self.orig:
            sharded = grad.shape == self.flat._local_shard.shape
            (self.handle._use_sharded_grad_views if sharded else self.handle._use_unsharded_grad_views)()


def _assign_grad(param, grad) -> None:
    """``param.grad = grad``, also for a gradient FSDP1 keeps in another shape or dtype than the
    parameter has now (inside ``no_sync()`` an unsharded gradient of a resharded FlatParameter and
    of the original parameters' views, in the low precision with mixed precision): ``.grad``'s
    setter checks both, ``.data`` does not (FSDP's own ``_use_unsharded_grad_views`` does this)."""
    if grad is None or (grad.shape == param.shape and grad.dtype == param.dtype):
        param.grad = grad
        return
    param.grad = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    param.grad.data = grad


class _Fsdp2Slot(GradSlot):
    def __init__(self, name, fsdp_param, group):
        self.name, self.param, self.group = name, fsdp_param, group

    def _unsharded(self):
        return getattr(self.param, "_unsharded_param", None)

    def _syncs(self) -> bool:
        return bool(self.group.reduce_grads)

    def graph_leaf(self):
        return self._unsharded()

    def shard(self):
        return self.param.sharded_param

    def held(self):
        unsharded = self._unsharded()
        return [g for g in (self.param.sharded_param.grad, self.param.unsharded_accumulated_grad,
                            unsharded.grad if unsharded is not None else None) if g is not None]

    def stash(self):
        unsharded = self._unsharded()
        saved = (self.param.sharded_param.grad, self.param.unsharded_accumulated_grad,
                 unsharded.grad if unsharded is not None else None)
        self.param.sharded_param.grad = None
        self.param.unsharded_accumulated_grad = None
        if unsharded is not None:
            unsharded.grad = None
        return saved

    def take(self):
        if self._syncs():
            grad, self.param.sharded_param.grad = self.param.sharded_param.grad, None
            return grad
        grad, self.param.unsharded_accumulated_grad = self.param.unsharded_accumulated_grad, None
        unsharded = self._unsharded()
        if grad is None and unsharded is not None:
            grad, unsharded.grad = unsharded.grad, None
        return grad

    def restore(self, stashed) -> None:
        sharded, accumulated, unsharded_grad = stashed
        self.param.sharded_param.grad = sharded
        self.param.unsharded_accumulated_grad = accumulated
        unsharded = self._unsharded()
        if unsharded is not None:
            unsharded.grad = unsharded_grad

    def add(self, grad, alpha) -> None:
        if self._syncs():
            held = self.param.sharded_param.grad
            if held is None:
                self.param.sharded_param.grad = grad.mul(alpha)
            else:
                _check_same_layout(self.name, held, grad)
                held.add_(grad, alpha=alpha)
            return
        if self.param.unsharded_accumulated_grad is not None:
            held = self.param.unsharded_accumulated_grad
        else:
            held = self._unsharded().grad
        if held is None:
            self._unsharded().grad = grad.mul(alpha)
        else:
            _check_same_layout(self.name, held, grad)
            held.add_(grad.to(held.dtype), alpha=alpha)


def _check_same_layout(name, held, grad) -> None:
    if held.shape != grad.shape or type(held) is not type(grad):
        from .errors import JaggUnsupportedError

        raise JaggUnsupportedError(
            f"backward='lowmem' under FSDP: {name}'s gradient changed layout between the loss's forward "
            f"({type(grad).__name__} {tuple(grad.shape)}) and its backward ({type(held).__name__} "
            f"{tuple(held.shape)}): gradient sync was switched on or off in between. Run the forward and "
            f"the backward of a loss in the same no_sync() / set_requires_gradient_sync() state")


def fsdp_version(module) -> int | None:
    """1 if ``module`` or a submodule is an FSDP1 ``FullyShardedDataParallel``, 2 if one is
    ``fully_shard``-ed (an ``FSDPModule``), else None. (Public classes; here beside the slots.)"""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    found = None
    for m in module.modules():
        if isinstance(m, FullyShardedDataParallel):
            return 1
        if isinstance(m, FSDPModule):
            found = 2
    return found


def fsdp2_sharded_parameters(module) -> dict[int, torch.Tensor]:
    """id -> the sharded parameter (a DTensor) of every ``fully_shard``-ed parameter in ``module``,
    keyed by the ids of both its forms: FSDP2 registers the gathered parameter on the module while a
    forward holds it unsharded (the root's stays so after a forward) and the sharded one otherwise, so
    only the sharded one is the same tensor from the rollout through the optimizer's steps
    (``FSDPParam.sharded_param`` / ``_unsharded_param``: not public)."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, torch.Tensor] = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    found[id(p.sharded_param)] = p.sharded_param
                    unsharded = getattr(p, "_unsharded_param", None)
                    if unsharded is not None:
                        found[id(unsharded)] = p.sharded_param
    return found


def reshard_fully_sharded(module) -> None:
    """Reshard every ``fully_shard``-ed (FSDP2) module in ``module``: its sharded parameters back in
    place of gathered ones (public ``FSDPModule.reshard``; local, no collective)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def fsdp_gradient_slots(module) -> list[GradSlot]:
    """Every gradient storage of the FSDP units in ``module``, in module order. FSDP1: one per
    unit's FlatParameter (``FullyShardedDataParallel._handle``); FSDP2: one per managed parameter
    (``FSDPModule._get_fsdp_state()._fsdp_param_groups``): neither is public."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    slots: list[GradSlot] = []
    for name, m in module.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            if m._handle is not None and m._handle.flat_param.requires_grad:
                slots.append(_Fsdp1Slot(name or "<root>", m._handle))
        elif isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    if p.sharded_param.requires_grad:
                        slots.append(_Fsdp2Slot(p._param_fqn or name or "<root>", p, group))
    return slots
