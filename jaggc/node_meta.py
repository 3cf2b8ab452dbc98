"""The facts jaggc stores on fx nodes (``node.meta``), one typed accessor each.

Like torch.fx's ``shape_prop`` (``meta["tensor_meta"]``), analyses store facts on the nodes they
describe; here every key is declared once, with who writes it and what it holds, and read and
written only through its ``Fact``: ``CALL.of(node)`` (the fact, or an internal error naming the
node and the writer that should have run), ``CALL.get(node)`` (or None), ``CALL.on(node)``,
``CALL.set(node, value)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch import nn

from .call_site import CallSite
from .errors import JaggInternalError
from .runtime.autocast import AutocastState
from .runtime.module_state import ModuleState

T = TypeVar("T")
_MISSING = object()


@dataclass(frozen=True)
class Fact(Generic[T]):
    key: str
    writer: str         # the frontend or pass that writes it
    holds: str          # what the value is

    def of(self, node) -> T:
        value = node.meta.get(self.key, _MISSING)
        if value is _MISSING:
            raise JaggInternalError(f"node {node.name} has no {self.key} ({self.holds}); {self.writer} writes it")
        return value

    def get(self, node, default: Any = None) -> T | Any:
        return node.meta.get(self.key, default)

    def on(self, node) -> bool:
        return self.key in node.meta

    def set(self, node, value: T) -> None:
        node.meta[self.key] = value


@dataclass(frozen=True)
class TracedCall:
    """A DiT call as the FX trace saw it: the module, its state then, whether grad was on."""

    module: nn.Module
    state: ModuleState
    grad_enabled: bool


# written by the FX frontend while tracing
TRACED_MODES: Fact[tuple] = Fact("jagg_traced_modes", "the FX frontend", "(grad mode, autocast state) at trace time")
TRACED_CALL: Fact[TracedCall] = Fact("jagg_traced_call", "the FX frontend", "TracedCall of a DiT call")
REQUIRES_GRAD: Fact[bool] = Fact("jagg_requires_grad", "the FX frontend", "whether a placeholder's value requires grad")
STORAGE: Fact[Any] = Fact("jagg_storage", "the FX frontend", "the storage an input placeholder's value lives in")
# written by the passes
CALL: Fact[CallSite] = Fact("jagg_call", "find_dit_calls", "the CallSite (jaggc/call_site.py) of a DiT call")
GRAD: Fact[bool] = Fact("jagg_grad", "tag_modes", "the grad mode the node runs under")
AUTOCAST: Fact[AutocastState] = Fact("jagg_autocast", "tag_modes", "the runtime.autocast.AutocastState the node runs under")
WINDOW: Fact[int] = Fact("jagg_window", "rewrite_windows", "the window a runtime node (or its output) belongs to")

FACTS = (TRACED_MODES, TRACED_CALL, REQUIRES_GRAD, STORAGE, CALL, GRAD, AUTOCAST, WINDOW)

__all__ = ["AUTOCAST", "CALL", "FACTS", "Fact", "GRAD", "REQUIRES_GRAD", "STORAGE", "TRACED_CALL", "TRACED_MODES",
           "TracedCall", "WINDOW"]
