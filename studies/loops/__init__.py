"""The trainers' own training loops (per-step ``backward()``), unchanged and with ``jaggc.stepwise``.

One module per trainer: ``flow_grpo`` (accelerate, peft LoRA on SD3, CFG, KL reference),
``dance_grpo`` (a random permutation of a random subset of steps, per-step backward, FSDP in its
multi-GPU runs), ``mix_grpo`` (a moving window of steps); the frameworks' (``FRAMEWORK_LOOPS``):
``flow_factory`` (Flow-Factory's ``GRPOTrainer.optimize``: a randperm subset, the clip and step in the
last step's body) and ``verl_omni`` (verl-omni's FSDP engine: micro-batches x timesteps). Each has ``train_unchanged`` (the loop as
the trainer writes it) and ``train_jaggc`` (the same loop with the user's change) and a ``setup``
whose ``stepwise=`` keywords are the other changed line, ``INSTALL`` (after the model is wrapped).
``user_diff`` is what a user applies: those lines, measured from the two loops' source.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from types import ModuleType

LOOPS = ("flow_grpo", "dance_grpo", "mix_grpo")
FRAMEWORK_LOOPS = ("flow_factory", "verl_omni")

# the line a user adds once the model is prepared / wrapped, as setup() runs it
INSTALL = "jaggc.stepwise(transformer, window=4)"


def loop_module(name: str) -> ModuleType:
    if name not in LOOPS + FRAMEWORK_LOOPS:
        raise ValueError(f"loop {name!r}: use one of {LOOPS + FRAMEWORK_LOOPS}")
    return importlib.import_module(f"jaggc_studies.loops.{name}")


def _body(fn) -> list[str]:
    """A loop function's lines after its signature and docstring."""
    lines = inspect.getsource(fn).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().endswith('"""') and i > 0) + 1
    return lines[start:]


def user_diff(name: str) -> list[str]:
    """The unified diff (no context) a user applies to the trainer's loop: the install line, then
    the loop lines that differ between ``train_unchanged`` and ``train_jaggc``."""
    module = loop_module(name)
    diff = [line for line in difflib.unified_diff(_body(module.train_unchanged), _body(module.train_jaggc), n=0,
                                                  lineterm="")
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return [f"+{INSTALL}"] + diff


def lines_changed(name: str) -> int:
    """Lines the user adds or replaces (a replaced line counts once)."""
    diff = user_diff(name)
    return max(sum(line.startswith("+") for line in diff), sum(line.startswith("-") for line in diff))


__all__ = ["FRAMEWORK_LOOPS", "INSTALL", "LOOPS", "lines_changed", "loop_module", "user_diff"]
