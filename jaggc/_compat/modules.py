"""nn.Module internals: the call slot ``module.compile()`` installs, the normal call with hooks, the
module a ``torch.compile`` wrapper holds, a module's own hook handles, and activation checkpointing
(a private package of torch.distributed)."""

from __future__ import annotations

import torch


# --- nn.Module internals -------------------------------------------------------------------
# ``nn.Module.__call__`` runs ``self._compiled_call_impl`` when a module has one (what
# ``module.compile()`` installs), else ``self._call_impl`` (hooks, then forward). The Dynamo
# frontend installs its opaque stand-in in that slot, so that a call through ``__call__`` (the one
# with hooks: DDP/FSDP sync, peft) ends in one opaque node, and calls the original at run time.

MODULE_CALL_SLOT = "_compiled_call_impl"


def module_call_impl(module):
    """The module's normal call (hooks, then forward): what ``__call__`` runs without a compiled
    call slot."""
    return module._call_impl


def compiled_inner_module(module):
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) holds, else None:
    jaggc unwraps it by identity, and the wrapper exposes it only as ``_orig_mod``."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def module_hook_keys(module) -> tuple:
    """The handles of a module's own forward and forward-pre hooks (its private hook dicts),
    leaving out jaggc's own observers (marked ``_jaggc_observer``: pass counters, the rollout
    cache's recorder), which see a call without changing it."""
    hooks, pre = module._forward_hooks, module._forward_pre_hooks
    if not hooks and not pre:
        return ()
    keep = lambda d: tuple(k for k, fn in d.items() if not getattr(fn, "_jaggc_observer", False))  # noqa: E731
    keys = (keep(hooks), keep(pre))
    return keys if keys != ((), ()) else ()


def apply_activation_checkpointing(model, check_fn) -> None:
    """Wrap every submodule ``check_fn`` accepts in a non-reentrant checkpoint wrapper, in place:
    what DanceGRPO's ``apply_fsdp_checkpointing`` and torchtitan do to transformer blocks (after an
    FSDP1 wrap, or before ``fully_shard``). torch keeps it under the private package
    ``torch.distributed.algorithms._checkpoint`` (there is no public name)."""
    import functools

    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    cw.apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(cw.checkpoint_wrapper, checkpoint_impl=cw.CheckpointImpl.NO_REENTRANT),
        check_fn=check_fn)
