"""The backward modes as symbols, and the one table of what each mode supports.

``BackwardMode`` names the three ways a compiled loss (and ``jaggc.stepwise``) runs its windows'
joint backward: ``JOINT`` (the knot forward keeps its activations until the loss's backward),
``PER_WINDOW`` (values from no-grad forwards; each window re-runs its knots inside the backward,
runtime/deferred.py) and ``LOWMEM`` (each window's backward runs inside the loss's forward as soon as
the loss's per-step terms give its upstream gradients, runtime/lowmem.py). It is a ``str`` enum, so
users keep writing ``backward="joint"``; ``backward_mode`` turns either into the symbol.

``SUPPORT`` is the only place that says what a mode can do; every refusal of a mode (the intercept
fallback, routing, the low-memory pass's parameter terms, the stepwise forms) reads it, and
tests/compiler/test_backward_modes.py checks each entry against what the runtime does. A new mode is one
``BackwardMode`` member and one ``SUPPORT`` row (docs/layout.md, "a new backward mode").

This module sits below the runtime (it imports only ``errors``), so the runtime, the passes and the
frontends all share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import JaggInputError


class BackwardMode(str, Enum):
    """A backward mode; equal to (and printed as) its string, so ``"joint"`` still works."""

    JOINT = "joint"
    PER_WINDOW = "per_window"
    LOWMEM = "lowmem"

    __hash__ = str.__hash__         # a mode and its string are one dict key

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def support(self) -> "ModeSupport":
        return SUPPORT[self]


CAPTURE_PATHS = ("fx", "dynamo", "intercept")


@dataclass(frozen=True)
class ModeSupport:
    """What one backward mode supports (the columns of ``SUPPORT``)."""

    captures: tuple[str, ...]      # the capture paths a compiled loss may take in this mode
    routing: bool                  # Routing(...): every window scored before choosing JAGG or exact
    parameter_terms: bool          # a loss term that calls a trainable module or input outside the DiT
    any_loss: bool                 # any function of the DiT outputs (else: a sum of per-step terms)
    autograd_grad: bool            # backward(inputs=...) and torch.autograd.grad(loss, params) on the loss (not
                                   # under FSDP: lowmem adds its buffer to .grad after the backward; per_window
                                   # refuses them under DDP/FSDP)
    stepwise: bool                 # a backward= form of jaggc.stepwise
    # how it runs (what the runtime and the passes branch on)
    knots_in_backward: bool        # the knot forward re-runs inside the loss's backward (deferred.py)
    backward_in_forward: bool      # each window's backward runs inside the loss's forward (lowmem.py)


SUPPORT: dict[BackwardMode, ModeSupport] = {
    BackwardMode.JOINT: ModeSupport(captures=CAPTURE_PATHS, routing=True, parameter_terms=True, any_loss=True,
                                    autograd_grad=True, stepwise=True,
                                    knots_in_backward=False, backward_in_forward=False),
    BackwardMode.PER_WINDOW: ModeSupport(captures=CAPTURE_PATHS, routing=False, parameter_terms=True,
                                         any_loss=True, autograd_grad=True, stepwise=True,
                                         knots_in_backward=True, backward_in_forward=False),
    BackwardMode.LOWMEM: ModeSupport(captures=("fx", "dynamo"), routing=False, parameter_terms=False,
                                     any_loss=False, autograd_grad=True, stepwise=True,
                                     knots_in_backward=False, backward_in_forward=True),
}

#: columns no refusal can read, each with why (the behaviour test checks them all the same)
DOCUMENTED_ONLY: dict[str, str] = {
    "autograd_grad": "no refusal reads it: every mode takes backward(inputs=...) and torch.autograd.grad "
                     "(per_window through its parameters as inputs of its window node, deferred.py; under DDP/FSDP "
                     "it refuses those forms itself); a new mode's row must say whether it does",
}

#: every mode, in the order the table lists them (for messages)
BACKWARD_MODES: tuple[BackwardMode, ...] = tuple(SUPPORT)


def modes_where(column: str) -> tuple[BackwardMode, ...]:
    """The modes whose ``SUPPORT`` row has ``column`` true (for refusals: "use one of ...")."""
    return tuple(m for m, row in SUPPORT.items() if getattr(row, column))


def mode_names(modes) -> str:
    """``'joint' or 'per_window'``: modes as a message names them."""
    names = [f"backward='{m.value}'" for m in modes]
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


def backward_mode(value, *, where: str = "backward") -> BackwardMode:
    """``value`` (a ``BackwardMode`` or its string) as the symbol; refuses anything else."""
    try:
        return BackwardMode(value)
    except ValueError:
        raise JaggInputError(f"{where}={value!r}: use one of {tuple(m.value for m in BACKWARD_MODES)}") from None


__all__ = ["BACKWARD_MODES", "BackwardMode", "CAPTURE_PATHS", "DOCUMENTED_ONLY", "ModeSupport", "SUPPORT",
           "backward_mode", "mode_names", "modes_where"]
