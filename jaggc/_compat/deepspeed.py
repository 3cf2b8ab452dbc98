"""deepspeed: the ZeRO optimizer internals a stepwise window needs (runtime/engines.py says why).
DeepSpeed stays optional: nothing here imports it; the engine is recognised by its class name."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def is_deepspeed_engine(module: nn.Module) -> bool:
    """Whether ``module`` is a ``deepspeed.DeepSpeedEngine`` (or a subclass: the pipeline engine)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(module).__mro__)


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitioned (each carries ``ds_status``: gathered by
    hooks of the forward, released after it), also where the loop holds ``engine.module``."""
    return any(hasattr(p, "ds_status") for p in module.parameters())


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


def intercept_zero_grad(engine: nn.Module, before: Callable[[str], None]) -> Callable[[], None]:
    """Call ``before(call)`` ahead of every ``engine.zero_grad()``, ``engine.optimizer.zero_grad()`` (the
    ZeRO optimizer's: what ``engine.step()`` calls at its boundary, and what a hand-written loop or
    ``accelerator.optimizer.optimizer`` reaches; accelerate's own optimizer wrapper makes its ``zero_grad``
    a no-op under DeepSpeed) and ``engine.module.zero_grad()`` (torch's, on the bare module). ZeRO's ``zero_grad`` clears ``.grad`` and its ``grad_accum`` attribute, where
    ZeRO-1 accumulates between boundaries, and leaves ZeRO-2's reduced partitions: no trace on ``.grad``
    that a ledger could read, so the call itself is watched. ``before`` may raise: the ``zero_grad`` then
    does not run. Returns the function that restores both methods."""
    targets = [(engine, "engine.zero_grad()"), (engine.module, "engine.module.zero_grad()")]
    if getattr(engine, "optimizer", None) is not None and callable(getattr(engine.optimizer, "zero_grad", None)):
        targets.append((engine.optimizer, "engine.optimizer.zero_grad()"))
    restore = []
    for owner, call in targets:
        previous = owner.__dict__.get("zero_grad", _UNSET)
        original = owner.zero_grad

        def watched(*args, _original=original, _call=call, **kwargs):
            before(_call)
            return _original(*args, **kwargs)

        owner.__dict__["zero_grad"] = watched
        restore.append((owner, previous, watched))

    def remove() -> None:
        for owner, previous, watched in restore:
            if owner.__dict__.get("zero_grad") is watched:
                if previous is _UNSET:
                    del owner.__dict__["zero_grad"]
                else:
                    owner.__dict__["zero_grad"] = previous
        restore.clear()

    return remove


_UNSET = object()


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


__all__ = ["accumulation_taps", "intercept_zero_grad", "is_deepspeed_engine", "zero3_partitioned", "zero_data_parallel_group",
           "zero_ready_buckets", "zero_torch_optimizer"]
