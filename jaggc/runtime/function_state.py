"""The part of a module's state that changes the function it computes, for reusing its outputs.

A rollout cache serves a training call the output a rollout call computed, so it must compare what
decides the output's values besides the inputs and the parameters, and nothing else: a key that
also holds flags that change nothing never hits. The trainers sample in ``eval()`` and train in
``train()`` (Flow-GRPO through a different wrapper object, the unwrapped peft model, than the one it
trains): on SD3 and Flux, whose dropouts all have p = 0, both modes compute the same function, so
the train flag alone must not make a miss. What does change the function:

* a peft adapter's state (disabled, the active adapter, merged);
* train/eval of a module whose output depends on it: a dropout with p > 0 (torch's dropout
  modules, ``MultiheadAttention`` and RNNs with ``dropout`` > 0), a batch or instance norm with
  running statistics, and any other module whose own ``forward`` reads ``self.training``
  (diffusers' label-dropout embedding, a mixture-of-experts gate), found by reading the source
  of its class's ``forward`` (once per class);
* the thread's autocast state (``autocast.py``).

Some states make an output no function of the inputs at all: a dropout with p > 0 in training
mode draws a new mask each call, a batch norm in training mode (or without running statistics)
normalises over the batch the call happens to have. ``FunctionState.reusable`` is False then, and
nothing is recorded or served.

``FunctionStateReader`` lists the submodules once (a module's structure does not change while a
rollout is recorded and trained on; an adapter added since adds parameters, which the cache's
parameter check sees).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass

from torch import nn

from .autocast import AutocastState, current_autocast
from .module_state import adapter_state, is_tuner_layer

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
_READS_TRAINING = re.compile(r"\bself\.training\b")


@functools.lru_cache(maxsize=None)
def _forward_reads_training(cls: type) -> bool:
    """Whether a (non-torch.nn) class's own ``forward``, or an inherited one below nn.Module,
    reads ``self.training``. A forward whose source cannot be read counts as reading it."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass.__module__.startswith("torch.nn"):
            continue
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        try:
            return bool(_READS_TRAINING.search(inspect.getsource(forward)))
        except (OSError, TypeError):
            return True
    return False


def mode_matters(m: nn.Module) -> bool:
    """Whether ``m``'s output values depend on its train/eval flag (module docstring)."""
    if isinstance(m, _DROPOUTS):
        return m.p > 0
    if isinstance(m, (nn.MultiheadAttention, nn.RNNBase)):
        return m.dropout > 0
    if isinstance(m, _BATCH_NORMS):
        return True
    if isinstance(m, _INSTANCE_NORMS):
        return m.track_running_stats
    if type(m).__module__.startswith("torch.nn"):
        return False
    return _forward_reads_training(type(m))


def draws_per_call(m: nn.Module) -> bool:
    """Whether ``m`` in its current state makes its output depend on more than the inputs of one
    sample: live dropout (random), a batch norm normalising over the batch."""
    if isinstance(m, _DROPOUTS) or isinstance(m, (nn.MultiheadAttention, nn.RNNBase)):
        return m.training and mode_matters(m)
    if isinstance(m, _BATCH_NORMS):
        return m.training or not m.track_running_stats
    return False


@dataclass(frozen=True)
class FunctionState:
    """What decides a call's output values besides its inputs and parameter values (module docstring)."""

    adapters: tuple
    modes: tuple            # (index, training) of the modules whose mode matters
    autocast: AutocastState
    reusable: bool          # False: the output is no function of the call's inputs (live dropout, batch stats)

    def difference(self, other: "FunctionState") -> str:
        parts = []
        if self.adapters != other.adapters:
            parts.append("a peft adapter's state (enabled/disabled, active, merged)")
        if self.modes != other.modes:
            n = sum(a != b for a, b in zip(self.modes, other.modes))
            parts.append(f"train/eval of {n} module(s) whose output depends on it")
        if self.autocast != other.autocast:
            parts.append(f"autocast {self.autocast.describe()} vs {other.autocast.describe()}")
        return "; ".join(parts) or "nothing"


class FunctionStateReader:
    """``FunctionState`` of one module, read many times (its submodules classified once)."""

    def __init__(self, module: nn.Module):
        modules = list(module.modules())
        self.tuners = [(i, m) for i, m in enumerate(modules) if is_tuner_layer(m)]
        self.moded = [(i, m) for i, m in enumerate(modules) if mode_matters(m)]
        self.drawing = [m for m in modules if isinstance(m, _DROPOUTS + _BATCH_NORMS)
                        or isinstance(m, (nn.MultiheadAttention, nn.RNNBase))]

    def read(self) -> FunctionState:
        return FunctionState(adapters=tuple(adapter_state(i, m) for i, m in self.tuners), modes=tuple((i, m.training) for i, m in self.moded),
                             autocast=current_autocast(), reusable=not any(draws_per_call(m) for m in self.drawing))


__all__ = ["FunctionState", "FunctionStateReader", "draws_per_call", "mode_matters"]
