"""Work that must happen before any optimizer step moves a parameter: one global pre-hook.

A per-step loop's open JAGG window must refuse an optimizer step (its knots' gradient is not in
``.grad`` yet: steps/safety.py), and a guard probe whose exact gradient is measured by re-running
the window's calls (under FSDP: guard_probe.py) must run them while the parameters are still those
the calls ran with. Both register an object here; ``torch.optim``'s global step pre-hook (public:
``register_optimizer_step_pre_hook``) calls ``before_optimizer_step(optimizer)`` on each live one,
in the order registered, for every optimizer of the process (accelerate's wrapper steps the inner
one, so its off-sync skipped steps call nothing); each decides whether that optimizer is its concern
(``steps_parameters_of``).
"""

from __future__ import annotations

import weakref
from typing import Protocol


class BeforeStep(Protocol):
    def before_optimizer_step(self, optimizer) -> None: ...


_LIVE: "weakref.WeakValueDictionary[int, BeforeStep]" = weakref.WeakValueDictionary()
_HOOK: list = []
_AFTER: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_POST_HOOK: list = []
_ORDER = [0]


def register_before_optimizer_step(obj: BeforeStep) -> None:
    """Call ``obj.before_optimizer_step(optimizer)`` before every optimizer step while ``obj`` lives."""
    if not any(v is obj for v in _LIVE.values()):
        _ORDER[0] += 1
        _LIVE[_ORDER[0]] = obj
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_before_optimizer_step))


def register_after_optimizer_step(obj) -> None:
    """Call ``obj.after_optimizer_step(optimizer)`` after every optimizer step while ``obj`` lives
    (the global post-hook: ``register_optimizer_step_post_hook``)."""
    if not any(v is obj for v in _AFTER.values()):
        _ORDER[0] += 1
        _AFTER[_ORDER[0]] = obj
    if not _POST_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _POST_HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


def unregister_after_optimizer_step(obj) -> None:
    for key in [k for k, v in _AFTER.items() if v is obj]:
        del _AFTER[key]


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for key in sorted(_AFTER.keys()):
        obj = _AFTER.get(key)
        if obj is not None:
            obj.after_optimizer_step(optimizer)


def unregister_before_optimizer_step(obj: BeforeStep) -> None:
    for key in [k for k, v in _LIVE.items() if v is obj]:
        del _LIVE[key]


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    for key in sorted(_LIVE.keys()):
        obj = _LIVE.get(key)
        if obj is not None:
            obj.before_optimizer_step(optimizer)


def steps_parameters_of(optimizer, module) -> bool:
    """Whether ``optimizer`` holds a parameter of ``module`` (another model's optimizer in the same
    process, a reward model's, is no concern of a window open on ``module``)."""
    mine = {id(p) for p in module.parameters()}
    return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])


__all__ = ["register_after_optimizer_step", "register_before_optimizer_step", "steps_parameters_of",
           "unregister_after_optimizer_step", "unregister_before_optimizer_step"]
