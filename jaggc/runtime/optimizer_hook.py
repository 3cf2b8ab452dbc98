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


class _Registry:
    """The live objects one global optimizer hook calls, in the order registered (weakly held)."""

    def __init__(self, method: str, install):
        self.method, self.install = method, install
        self.live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self.handle = None

    def add(self, obj) -> None:
        if not any(v is obj for v in self.live.values()):
            _ORDER[0] += 1
            self.live[_ORDER[0]] = obj
        if self.handle is None:
            self.handle = self.install(self)

    def remove(self, obj) -> None:
        for key in [k for k, v in self.live.items() if v is obj]:
            del self.live[key]

    def __call__(self, optimizer, args, kwargs) -> None:
        for key in sorted(self.live.keys()):
            obj = self.live.get(key)
            if obj is not None:
                getattr(obj, self.method)(optimizer)


def _pre_hook(registry):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(registry)


def _post_hook(registry):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(registry)


_ORDER = [0]
_BEFORE = _Registry("before_optimizer_step", _pre_hook)
_AFTER = _Registry("after_optimizer_step", _post_hook)


def register_before_optimizer_step(obj: BeforeStep) -> None:
    """Call ``obj.before_optimizer_step(optimizer)`` before every optimizer step while ``obj`` lives."""
    _BEFORE.add(obj)


def unregister_before_optimizer_step(obj: BeforeStep) -> None:
    _BEFORE.remove(obj)


def register_after_optimizer_step(obj) -> None:
    """Call ``obj.after_optimizer_step(optimizer)`` after every optimizer step while ``obj`` lives
    (torch's global post-hook, ``register_optimizer_step_post_hook``: the rollout cache counts the steps
    off-policy serving accounts for)."""
    _AFTER.add(obj)


def unregister_after_optimizer_step(obj) -> None:
    _AFTER.remove(obj)


def steps_parameters_of(optimizer, module) -> bool:
    """Whether ``optimizer`` holds a parameter of ``module`` (another model's optimizer in the same
    process, a reward model's, is no concern of a window open on ``module``)."""
    mine = {id(p) for p in module.parameters()}
    return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])


__all__ = ["register_after_optimizer_step", "register_before_optimizer_step", "steps_parameters_of",
           "unregister_after_optimizer_step", "unregister_before_optimizer_step"]
