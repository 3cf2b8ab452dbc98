"""deepspeed: the ZeRO optimizer internals a stepwise window needs (runtime/engines.py says why).
DeepSpeed stays optional: nothing here imports it; the engine is recognised by its class name."""

from __future__ import annotations

import copy
import sys
import weakref
from typing import Callable

import torch
from torch import nn

#: the DeepSpeed releases jaggc's DeepSpeed tests ran on (tests/steps/test_stepwise_deepspeed.py,
#: test_stepwise_engines.py); ``deepspeed_internals_missing`` checks the internals below by name
DEEPSPEED_TESTED = ("0.19.8",)


def deepspeed_version() -> str:
    """The installed DeepSpeed's version ("unknown" where it is not imported: an engine was built by it)."""
    module = sys.modules.get("deepspeed")
    return str(getattr(module, "__version__", "unknown"))


def deepspeed_internals_missing(engine: nn.Module, stage: int) -> list[str]:
    """The DeepSpeed internals jaggc uses on a stage-``stage`` engine that ``engine`` lacks, by name
    (empty: all there). Every stage: ``engine.module``, ``engine.optimizer`` and
    ``seq_data_parallel_group`` (the group it reduces over); ZeRO-1/2 besides: the ZeRO optimizer's
    ``setup_buckets`` (``zero_ready_buckets``) and the ``param_idx_in_group`` it numbers each trainable
    parameter with (``zero12_managed``)."""
    missing = [f"engine.{name}" for name in ("module", "optimizer", "seq_data_parallel_group")
               if not hasattr(engine, name)]
    if stage in (1, 2):
        optimizer = getattr(engine, "optimizer", None)
        if not callable(getattr(optimizer, "setup_buckets", None)):
            missing.append(f"engine.optimizer.setup_buckets ({type(optimizer).__name__})")
        module = getattr(engine, "module", None)
        trainable = [p for p in module.parameters() if p.requires_grad] if isinstance(module, nn.Module) else []
        if trainable and not any(hasattr(p, "param_idx_in_group") for p in trainable):
            missing.append("param_idx_in_group (on the engine module's trainable parameters)")
    if stage == 3:
        module = getattr(engine, "module", None)
        params = list(module.parameters()) if isinstance(module, nn.Module) else []
        for name in ("ds_tensor", "ds_numel"):
            if params and not all(hasattr(p, name) for p in params):
                missing.append(f"{name} (on the engine module's ZeRO-3 parameters)")
    return missing


def is_deepspeed_engine(module: nn.Module) -> bool:
    """Whether ``module`` is a ``deepspeed.DeepSpeedEngine`` (or a subclass: the pipeline engine)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(module).__mro__)


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitioned (each carries ``ds_status``: gathered by
    hooks of the forward, released after it), also where the loop holds ``engine.module``."""
    return any(hasattr(p, "ds_status") for p in module.parameters())


def zero3_numel(p: torch.Tensor) -> int:
    """The full size of a ZeRO-3 partitioned parameter (``ds_numel``; ``p.numel()`` is 0 at rest)."""
    return int(getattr(p, "ds_numel", p.numel()))


class Zero3Partitions:
    """``module``'s parameters as ZeRO-3 holds them at rest: each one's partition on this rank
    (``p.ds_tensor``), by name. ``p.data`` is swapped by ZeRO-3's hooks (gathered for a forward or a
    module's backward, then released to an empty tensor): its storage and version say nothing of a
    write, while the optimizer writes the partition in place (a stepwise ledger reads these)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def named_parameters(self):
        for name, p in self.module.named_parameters():
            yield name, getattr(p, "ds_tensor", p)

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def modules(self):
        return self.module.modules()


def zero12_managed(module: nn.Module) -> bool:
    """Whether a ZeRO-1/2 optimizer manages ``module``'s parameters (it numbers each trainable one in
    its group, ``param_idx_in_group``, and hooks its gradient accumulator): true of ``engine.module``,
    where the engine itself is out of reach."""
    return any(hasattr(p, "param_idx_in_group") for p in module.parameters())


def zero_ready_buckets(engine: nn.Module) -> None:
    """ZeRO-1/2 ready their gradient buckets (``setup_buckets``, no public name) when a backward's
    first parameter gradient arrives, and the engine's end of backward reduces them: a backward in
    which none arrives must ready them as that first gradient would (idempotent within a backward)."""
    engine.optimizer.setup_buckets()


def zero_torch_optimizer(engine: nn.Module):
    """The torch optimizer a ZeRO optimizer steps on its fp32 partitions (``.optimizer``), or None."""
    return getattr(engine.optimizer, "optimizer", None)


def zero_optimizer_steps(engine: nn.Module) -> int:
    """How many times the DeepSpeed optimizer's ``step`` has run since jaggc first asked (``engine.step()``
    calls it at each accumulation boundary; its instance ``step`` is wrapped at the first call). ZeRO-1/2
    (and stage 0's fp16/bf16 wrapper) step a torch optimizer on fp32 copies and then write them into the
    module's parameters through ``.data`` and collectives, which bump no version counter of the
    parameters: the count is what tells a rollout cache that they moved (measured on DeepSpeed 0.18:
    ``p._version`` unchanged by ``engine.step()`` on ZeRO-1/2, the values changed)."""
    return _counted_step(engine.optimizer).count


def after_zero_optimizer_step(engine: nn.Module, fn: Callable[[], None]) -> None:
    """Call ``fn()`` each time the DeepSpeed optimizer's ``step`` returns (``zero_optimizer_steps``),
    while ``fn`` lives (held weakly: a bound method by its object)."""
    ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else weakref.ref(fn)
    _counted_step(engine.optimizer).after.append(ref)


def _counted_step(optimizer) -> "_CountedStep":
    counted = optimizer.__dict__.get("step")
    if not isinstance(counted, _CountedStep):
        counted = optimizer.__dict__["step"] = _CountedStep(optimizer, optimizer.__dict__.get("step", _UNSET))
    return counted


class _CountedStep:
    """A DeepSpeed optimizer's instance ``step`` slot while counted (``zero_optimizer_steps``): the step it
    had, then the count and the callbacks. A step that raises is counted (it may have written some
    parameters) and calls no callback."""

    def __init__(self, owner, previous):
        self.original = owner.step if previous is _UNSET else previous
        self.count = 0
        self.after: list = []

    def __call__(self, *args, **kwargs):
        try:
            out = self.original(*args, **kwargs)
        finally:
            self.count += 1
        for ref in list(self.after):
            fn = ref()
            if fn is None:
                self.after.remove(ref)
            else:
                fn()
        return out


def intercept_zero_grad(engine: nn.Module, before: Callable[[str], None]) -> Callable[[], None]:
    """Call ``before(call)`` ahead of every ``engine.zero_grad()``, ``engine.optimizer.zero_grad()`` (the
    ZeRO optimizer's: what ``engine.step()`` calls at its boundary, and what a hand-written loop or
    ``accelerator.optimizer.optimizer`` reaches; accelerate's own optimizer wrapper makes its ``zero_grad``
    a no-op under DeepSpeed) and ``engine.module.zero_grad()`` (torch's, on the bare module). ZeRO's ``zero_grad`` clears ``.grad`` and its ``grad_accum`` attribute, where
    ZeRO-1 accumulates between boundaries, and leaves ZeRO-2's reduced partitions: no trace on ``.grad``
    that a ledger could read, so the call itself is watched. ``before`` may raise: the ``zero_grad`` then
    does not run. Each watcher is a ``_WatchedZeroGrad`` in the instance dict: a copy or pickle of its owner
    gets the owner's own ``zero_grad``. Returns the function that restores the methods."""
    targets = [(engine, "engine.zero_grad()"), (engine.module, "engine.module.zero_grad()")]
    if getattr(engine, "optimizer", None) is not None and callable(getattr(engine.optimizer, "zero_grad", None)):
        targets.append((engine.optimizer, "engine.optimizer.zero_grad()"))
    restore = []
    for owner, call in targets:
        watched = _WatchedZeroGrad(owner, call, before, owner.__dict__.get("zero_grad", _UNSET))
        owner.__dict__["zero_grad"] = watched
        restore.append((owner, watched))

    def remove() -> None:
        for owner, watched in restore:
            if owner.__dict__.get("zero_grad") is watched:
                if watched.previous is _UNSET:
                    del owner.__dict__["zero_grad"]
                else:
                    owner.__dict__["zero_grad"] = watched.previous
        restore.clear()

    return remove


_UNSET = object()


class _WatchedZeroGrad:
    """``owner``'s instance ``zero_grad`` slot while watched (``intercept_zero_grad``): ``before(call)``,
    then the ``zero_grad`` it had. A copy of the owner (``copy.deepcopy(engine.module)``: a reference or
    EMA model) gets its own class's ``zero_grad`` (or a copy of the instance one it had before), not a
    path into the original's gradients or the watcher; a pickle of it (``torch.save(engine.module)``)
    likewise, where a closure would not pickle at all (``InstalledForward`` does the same for the forward)."""

    def __init__(self, owner, call: str, before: Callable[[str], None], previous):
        self.owner, self.call, self.before, self.previous = owner, call, before, previous
        self.original = owner.zero_grad if previous is _UNSET else previous

    def __call__(self, *args, **kwargs):
        self.before(self.call)
        return self.original(*args, **kwargs)

    def __deepcopy__(self, memo):
        if self.previous is not _UNSET:
            return copy.deepcopy(self.previous, memo)
        copied = memo.get(id(self.owner))
        return _class_zero_grad(copied) if copied is not None else _class_zero_grad(self.owner)

    def __reduce__(self):
        if self.previous is not _UNSET:
            return (_same, (self.previous,))
        return (_class_zero_grad, (self.owner,))


def _class_zero_grad(owner):
    return type(owner).zero_grad.__get__(owner)


def _same(value):
    return value


def zero_data_parallel_group(engine: nn.Module):
    """The process group ZeRO averages gradients over (``seq_data_parallel_group``: the data-parallel
    group, sequence-parallel ranks included), None (the default group) where the engine names none."""
    return getattr(engine, "seq_data_parallel_group", None)


def accumulation_taps(params, on_grad: Callable[[int, torch.Tensor], None]) -> Callable[[], None]:
    """Call ``on_grad(i, grad)`` with every gradient autograd accumulates into ``params[i]``, before it
    is accumulated: a pre-hook on the parameter's ``AccumulateGrad`` node (``view_as(p).grad_fn``'s next
    function, the idiom DeepSpeed itself uses). ZeRO-2 takes the gradient off ``.grad`` in its
    post-accumulate hooks, so ``.grad`` never shows it; and unlike a tensor hook on the parameter, a node
    pre-hook does not run for a ``torch.autograd.grad`` whose inputs are the parameters (that graph
    captures the gradient, the node does not run): exactly what the loop's backward passes hand ZeRO.
    The nodes are held until the returned function removes the hooks (autograd caches them weakly)."""
    handles, nodes = [], []
    for i, p in enumerate(params):
        node = p.view_as(p).grad_fn.next_functions[0][0]
        nodes.append(node)
        handles.append(node.register_prehook(lambda grads, _i=i: on_grad(_i, grads[0]) if grads[0] is not None
                                             else None))

    def remove() -> None:
        for h in handles:
            h.remove()
        handles.clear()
        nodes.clear()

    return remove


__all__ = ["DEEPSPEED_TESTED", "accumulation_taps", "deepspeed_internals_missing", "deepspeed_version",
           "intercept_zero_grad", "is_deepspeed_engine", "Zero3Partitions", "zero3_numel", "zero3_partitioned", "zero_data_parallel_group",
           "zero_ready_buckets", "zero_torch_optimizer"]
