"""The state of a DiT that changes its output for the same inputs and parameter values.

Two DiT calls with equal inputs give different outputs when the module is in another state:
a peft adapter disabled (Flow-GRPO's KL reference runs under ``disable_adapter()``), another
adapter active or merged, ``train()``/``eval()`` (dropout), or other forward hooks; and when the
thread is in another autocast state (``autocast.py``; a thread mode like grad mode, not a module
flag). Anything that reuses or pairs DiT outputs across calls (a JAGG window, the rollout cache,
the intercept fallback's recording, a compiled graph replaying a traced call) must compare both,
not only the inputs: ``CallState`` is the pair.

``module_state(m)`` takes a hashable snapshot; ``applied(m, state)`` puts a module into a recorded
state for the duration of a call (what a compiled graph does for a reference call traced under
``disable_adapter()``) and restores it after; ``difference(a, b)`` says in words how two states
differ, for error messages.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from dataclasses import dataclass

from torch import nn

from .._compat import compiled_inner_module, module_hook_keys
from .autocast import AutocastState, autocast_applied, current_autocast
from .module_tree import module_tree


def module_chain(module: nn.Module) -> list[nn.Module]:
    """The module and every wrapper-held module under it (DDP/FSDP .module, peft, compile)."""
    chain = [module]
    while True:
        m = chain[-1]
        inner = None
        if compiled_inner_module(m) is not None:  # torch.compile
            inner = compiled_inner_module(m)
        elif hasattr(m, "get_base_model") and callable(m.get_base_model):  # peft PeftModel
            inner = m.get_base_model()
        elif type(m).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel", "DataParallel", "DeepSpeedEngine"):
            inner = m.module
        if inner is None or inner is m or inner in chain:
            return chain
        chain.append(inner)


def unwrap(module: nn.Module) -> nn.Module:
    return module_chain(module)[-1]


def is_tuner_layer(m: nn.Module) -> bool:
    # peft's BaseTunerLayer, by duck type: peft stays an optional dependency
    return hasattr(m, "_disable_adapters") and hasattr(m, "_active_adapter")


def _active(m: nn.Module) -> tuple[str, ...]:
    active = m._active_adapter
    return (active,) if isinstance(active, str) else tuple(active)


def adapter_state(index: int, m: nn.Module) -> tuple:
    """(index, disabled, active adapters, merged adapters) of the peft tuner layer ``m``."""
    return (index, bool(m._disable_adapters), _active(m), tuple(getattr(m, "merged_adapters", ())))


@dataclass(frozen=True)
class ModuleState:
    """A snapshot of what, besides inputs and parameter values, decides a module's output.

    ``training`` holds one flag per submodule and ``requires_grad`` one per parameter, in
    ``modules()`` / ``parameters()`` order; ``adapters`` one (disabled, active, merged) triple per
    peft tuner layer; ``hooks`` the registered forward (pre-)hook handles of every submodule that
    has any."""

    training: tuple[bool, ...]
    requires_grad: tuple[bool, ...]
    adapters: tuple[tuple, ...]
    hooks: tuple[tuple, ...]

    def output_key(self) -> tuple:
        """What of the module decides the output's *values* (requires_grad and hooks installed by
        tools, such as a rollout cache's own recording hook, do not)."""
        return (self.training, self.adapters)


def module_state(module: nn.Module, *, hooks: bool = True) -> ModuleState:
    """The state of ``module`` and its submodules now (``hooks=False`` leaves hooks out: a rollout
    cache records through a hook of its own)."""
    modules = list(module.modules())
    return ModuleState(
        training=tuple(m.training for m in modules),
        requires_grad=tuple(p.requires_grad for p in module.parameters()),
        adapters=tuple(adapter_state(i, m) for i, m in enumerate(modules) if is_tuner_layer(m)),
        hooks=tuple((i, keys) for i, m in enumerate(modules) if (keys := module_hook_keys(m))) if hooks else (),
    )


_READERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # ModuleTree -> StateReader


class StateReader:
    """``module_state(module, hooks=False)`` read many times over a stretch in which the module's
    structure does not change (one trajectory of a per-step loop): its submodules, parameters and
    peft layers are listed once, so a read is three flag sweeps (a tenth of ``module_state``'s time
    on a Flux DiT)."""

    def __init__(self, module: nn.Module, tree=None):
        tree = module_tree(module) if tree is None else tree
        self.modules = tree.modules
        self.params = tree.parameters
        self.tuners = [(i, m) for i, m in enumerate(self.modules) if is_tuner_layer(m)]

    @classmethod
    def of(cls, module: nn.Module, tree=None) -> "StateReader":
        """``module``'s reader, the same one while its tree is the same listing (module_tree.py): a per-step
        loop makes one per trajectory, and listing the peft layers of a DiT costs a walk of every module.
        ``tree``: ``module_tree(module)`` as just checked."""
        tree = module_tree(module) if tree is None else tree
        reader = _READERS.get(tree)
        if reader is None:
            reader = _READERS[tree] = cls(module, tree)
        return reader

    def read(self) -> ModuleState:
        # the flags read in C (``map`` over attribute getters): a read per DiT call
        return ModuleState(
            training=tuple(map(_TRAINING, self.modules)),
            requires_grad=tuple(map(_REQUIRES_GRAD, self.params)),
            adapters=tuple(adapter_state(i, m) for i, m in self.tuners),
            hooks=(),
        )


_TRAINING = operator.attrgetter("training")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def difference(a: ModuleState, b: ModuleState) -> str:
    """What differs between two states, in words ("adapters disabled in 8 layers", ...)."""
    parts = []
    if a.adapters != b.adapters:
        old, new = dict((i, rest) for i, *rest in a.adapters), dict((i, rest) for i, *rest in b.adapters)
        disabled = sum(1 for i in new if i in old and new[i][0] != old[i][0])
        active = sum(1 for i in new if i in old and new[i][1] != old[i][1])
        merged = sum(1 for i in new if i in old and new[i][2] != old[i][2])
        parts += [f"{what} in {n} peft layer(s)" for what, n in
                  (("adapters enabled/disabled", disabled), ("another active adapter", active),
                   ("adapters merged/unmerged", merged)) if n]
    if a.training != b.training:
        n = sum(x != y for x, y in zip(a.training, b.training))
        parts.append(f"train/eval mode of {n} submodule(s) (training={b.training[0]} at the top)")
    if a.requires_grad != b.requires_grad:
        parts.append(f"requires_grad of {sum(x != y for x, y in zip(a.requires_grad, b.requires_grad))} parameter(s)")
    if a.hooks != b.hooks:
        parts.append("registered forward hooks")
    return "; ".join(parts) or "nothing"


def applicable(a: ModuleState, b: ModuleState) -> bool:
    """True if ``applied`` can turn state ``a`` into ``b`` (flags only: hooks and merged weights
    cannot be set on a module)."""
    merged = [x[3] for x in a.adapters] == [x[3] for x in b.adapters]
    return (merged and a.hooks == b.hooks
            and len(a.training) == len(b.training) and len(a.requires_grad) == len(b.requires_grad)
            and [x[0] for x in a.adapters] == [x[0] for x in b.adapters])


def set_state(module: nn.Module, state: ModuleState) -> None:
    """Set the training, requires_grad and adapter flags of ``module`` to ``state``'s (the module
    must have the structure it had when the state was taken: ``applicable``)."""
    modules = list(module.modules())
    params = list(module.parameters())
    if len(modules) != len(state.training) or len(params) != len(state.requires_grad):
        raise ValueError(f"{type(module).__name__} changed structure since its state was recorded "
                         f"({len(modules)} modules / {len(params)} parameters, recorded "
                         f"{len(state.training)} / {len(state.requires_grad)})")
    for m, flag in zip(modules, state.training):
        # the attribute, not .train(): train() recurses, and every module gets its own flag here
        m.training = flag
    for p, flag in zip(params, state.requires_grad):
        if p.requires_grad != flag:
            p.requires_grad_(flag)
    for i, disabled, active, _ in state.adapters:
        layer = modules[i]
        layer._disable_adapters = disabled
        layer._active_adapter = list(active) if isinstance(layer._active_adapter, list) else active[0]


@contextlib.contextmanager
def applied(module: nn.Module, state: ModuleState | None):
    """Run the body with ``module`` in ``state`` (None: as it is), then put it back."""
    if state is None:
        yield
        return
    before = module_state(module)
    if before == state:
        yield
        return
    set_state(module, state)
    try:
        yield
    finally:
        set_state(module, before)


@dataclass(frozen=True)
class CallState:
    """What besides its inputs decides a recorded DiT call's output: the module's state and the
    thread's autocast state when it was made (the intercept fallback records one per call and runs
    each window in its calls' state)."""

    module: ModuleState
    autocast: AutocastState

    @staticmethod
    def of(module: nn.Module) -> "CallState":
        return CallState(module_state(module), current_autocast())

    def difference(self, other: "CallState") -> str:
        parts = [difference(self.module, other.module)] if self.module != other.module else []
        if self.autocast != other.autocast:
            parts.append(f"autocast {self.autocast.describe()} vs {other.autocast.describe()}")
        return "; ".join(parts) or "nothing"

    @contextlib.contextmanager
    def applied(self, module: nn.Module):
        with applied(module, self.module), autocast_applied(self.autocast):
            yield


def output_key(module: nn.Module) -> tuple:
    """What decides a call's output values besides its inputs, now: the key a recorded output
    (the rollout cache) is reused under."""
    return module_state(module, hooks=False).output_key() + (current_autocast(),)
