"""The capture paths a compiled loss can take, in ``capture="auto"`` order: one line each.

``api.jagg_compile`` checks ``capture=`` against ``capture_choices()``, the compile session makes
one frontend per entry, ``capture="auto"`` tries them in registration order, and a fallback
announces the path it took with the entry's cost note. Adding a frontend is one new module (a
class with ``name``, ``run(args, kwargs)`` and ``reset()``, made as ``cls(session, qualname)``:
``contract.Frontend``/``contract.Session``) plus one ``register`` line below.

Order of ``auto``: FX first: its first call on a 50-step Flow-GRPO loss is about 5x cheaper than
Dynamo's, and it takes the trainers' schedule reads, no_grad reference blocks, autocast blocks,
train()/eval() and adapter toggles, several of which Dynamo breaks the graph on; Dynamo takes
Function.apply; intercept runs anything the DiT is an argument of, at one more forward per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .contract import Frontend, Session
from .dynamo_runner import DynamoFrontend
from .fx_runner import FxFrontend
from .intercept_runner import InterceptFrontend


@dataclass(frozen=True)
class FrontendEntry:
    """One capture path: how to make it for a session, and what taking it as a fallback costs."""

    name: str
    make: Callable[[Session, str], Frontend]     # (session, the loss's qualname) -> the frontend
    fallback_cost: str = ""                      # said when capture="auto" falls back to this path


FRONTENDS: dict[str, FrontendEntry] = {}         # name -> entry, in capture="auto" order


def register(name: str, make: Callable[[Session, str], Frontend], *, fallback_cost: str = "") -> None:
    """Add a capture path, tried by ``capture="auto"`` after those registered before it."""
    FRONTENDS[name] = FrontendEntry(name, make, fallback_cost)


def capture_choices() -> tuple[str, ...]:
    """The values ``jagg_compile(capture=...)`` takes: "auto" and every registered path."""
    return ("auto", *FRONTENDS)


def auto_order() -> tuple[str, ...]:
    return tuple(FRONTENDS)


register("fx", FxFrontend)
register("dynamo", DynamoFrontend,
         fallback_cost="a first call about 5x slower than FX's (Dynamo tracing); later calls as fast")
register("intercept", InterceptFrontend,
         fallback_cost="one more DiT forward per trained step and the loss's Python run twice per call, "
                       "(W+6)F per window instead of (W+4)F")


__all__ = ["FRONTENDS", "FrontendEntry", "auto_order", "capture_choices", "register"]
