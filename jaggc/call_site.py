"""A DiT call found in a captured graph (``CallSite``) and a window of them (``Window``): the
vocabulary the node facts (``node_meta.CALL``), the passes and the report share. It lives below the
frontends and the passes so the facts on fx nodes carry a real type."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from .runtime.autocast import AUTOCAST_OFF, AutocastState


@dataclass
class CallSite:
    """A DiT call found in the graph (``CALL.of(node)``)."""

    index: int                 # order among all DiT calls
    module: str                # get_attr target of the called module
    grad_enabled: bool
    step: int | None = None    # order among the grad-enabled calls of the trained DiT
    window: int | None = None
    role: str | None = None    # "knot", "interior", "exact", "reference"
    source: str = ""           # file:line of the call in the user's code
    autocast: AutocastState = AUTOCAST_OFF   # the autocast state the call runs in


@dataclass
class Window:
    """A window of consecutive trained DiT calls, as assign_windows forms it and rewrite_windows runs it."""

    index: int
    nodes: list[fx.Node]
    steps: list[int]
    mode: str                  # "jagg", "exact", or "routed" (JAGG or exact, chosen at run time by score)
    knots: tuple[int, ...] = ()
    basis: str = ""
    time_arg: str | int | None = None
    node: fx.Node | None = None    # the runtime node after rewrite_windows
    plan: object = None
    autocast: AutocastState = AUTOCAST_OFF   # the autocast state all its calls run in


__all__ = ["CallSite", "Window"]
