"""How a ``Stepwise`` sits on its module: the instance ``forward`` slot (``InstalledForward``) that
routes the loop's calls into the trajectory, and the innermost module's hook that records the
rollout for the rollout cache (``_InnerRecorder``). Both survive ``copy.deepcopy`` and pickling of
the module as the module's own forward and a hook that records nothing: a copy (a reference model,
an EMA copy) is never a path into the ``Stepwise``."""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch
from torch import nn

from .._compat import in_backward
from ..runtime.calls import DitCall
from ..runtime.engines import install_target_of
from ..runtime.module_state import unwrap
from ..source import frame_location, user_frame

#: no instance ``forward`` slot before the install
UNSET = object()


def install_forward(owner, module: nn.Module):
    """Put ``owner``'s call path in ``module``'s instance ``forward`` slot, and (a rollout cache) the
    innermost module's recording hook; returns that hook's handle (None: no cache)."""
    previous = module.__dict__.get("forward", UNSET)
    module.__dict__["forward"] = InstalledForward(owner, module, previous)
    if owner.cache is None:
        return None
    # the rollout may call the wrapped module itself (Flow-GRPO samples through
    # pipeline.transformer, inside the DDP wrapper the loop trains): its calls are recorded
    # where every path reaches, the innermost module, unless they came through this one
    return unwrap(module).register_forward_hook(_InnerRecorder(owner), with_kwargs=True)


def remove_forward(owner, module: nn.Module) -> None:
    """Give ``module`` back the forward it had before ``owner`` was installed."""
    installed_ = module.__dict__.get("forward")
    if isinstance(installed_, InstalledForward) and installed_.owner is owner:
        if installed_.previous is UNSET:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = installed_.previous


def installed(module: nn.Module):
    """The ``Stepwise`` installed on ``module`` (on a DeepSpeed engine: on ``engine.module``), or None."""
    module = install_target_of(module)     # where stepwise installs on a DeepSpeed engine (runtime/engines.py)
    installed = module.__dict__.get("forward")
    return installed.owner if isinstance(installed, InstalledForward) else None


class InstalledForward:
    """The module's instance ``forward`` slot while a ``Stepwise`` is installed: every call of the
    module during a declared trajectory, with grad, goes to the trajectory; any other call to the
    forward the module had. A copy of the module (``copy.deepcopy``: a trainer's reference model,
    an EMA copy) or a pickle of it gets the module's own forward back, not a path into this one."""

    def __init__(self, owner, module: nn.Module, previous):
        self.owner, self.module, self.previous = owner, module, previous
        self.original = module.forward if previous is UNSET else previous

    def __call__(self, *args, **kwargs):
        owner = self.owner
        if owner.records() and not in_backward():
            # a rollout's call: recorded as the loop makes it (the innermost module's hook skips it)
            owner._local.outer = 1
            try:
                out = self.original(*args, **kwargs)
            finally:
                owner._local.outer = 0
            owner.record(DitCall(tuple(args), dict(kwargs)), out)
            # where this module is the innermost, its own forward hooks (the inner recorder among them)
            # run after this returns: that hook must not record the call a second time
            owner._local.last_recorded = out
            return out
        if (owner._run is None or not torch.is_grad_enabled() or getattr(owner._local, "through", 0)
                or in_backward()):
            # a call inside a backward is a recomputation (activation checkpointing written around
            # the call), which must repeat the original forward's ops, not be a step of its own
            if owner.fsdp1 and owner._run is not None and not torch.is_grad_enabled() \
                    and not getattr(owner._local, "through", 0) and not in_backward():
                # the loop's own no-grad call between steps (a KL reference): FSDP1's forward hands
                # the original parameters new gradient views (run.py's outside_step)
                return owner._run.outside_step(lambda: self.original(*args, **kwargs), frame_location(user_frame()))
            return self.original(*args, **kwargs)
        # the rollout cache's parameter versions read once per call (runtime/rollout_cache.py)
        with owner.cache.versions_held() if owner.cache is not None else contextlib.nullcontext():
            return owner._run.call(DitCall(tuple(args), dict(kwargs)), self.original, frame_location(user_frame()))

    def __deepcopy__(self, memo):
        copied = memo.get(id(self.module))
        if self.previous is not UNSET:
            return copy.deepcopy(self.previous, memo)
        return type(copied).forward.__get__(copied) if copied is not None else self.original

    def __reduce__(self):
        return (_class_forward, (self.module,))


class _InnerRecorder:
    """The innermost module's forward hook that records the rollout's calls made around this
    Stepwise's module (``Stepwise._install``). A copy or pickle of the module (a reference model, an
    EMA copy) gets a hook that records nothing, not a path into this Stepwise."""

    _jaggc_observer = True          # module_state ignores it: it changes no output

    def __init__(self, owner):
        self.owner = weakref.ref(owner)

    def __call__(self, module, args, kwargs, output) -> None:
        owner = self.owner()
        if owner is not None and output is getattr(owner._local, "last_recorded", None):
            owner._local.last_recorded = None          # recorded by the installed forward (InstalledForward)
            return
        if owner is not None and owner.records():
            owner.record(DitCall(tuple(args), dict(kwargs)), output)

    def __deepcopy__(self, memo):
        return _records_nothing

    def __reduce__(self):
        return (_records_nothing_hook, ())


def _records_nothing(module, args, kwargs, output) -> None:
    return None


_records_nothing._jaggc_observer = True


def _records_nothing_hook():
    return _records_nothing


def _class_forward(module: nn.Module):
    return type(module).forward.__get__(module)


__all__ = ["InstalledForward", "UNSET", "install_forward", "installed", "remove_forward"]
