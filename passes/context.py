"""The facts passes share: the compile configuration and what each analysis found.

Analyses store per-node facts in ``node.meta`` (``jagg_call`` on DiT calls, ``jagg_grad`` and
``jagg_autocast`` on every node) and per-graph facts (the windows) here; a pass never recomputes what an earlier one stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

from jaggc.node_meta import CALL
from jaggc.runtime.autocast import AUTOCAST_OFF, AutocastState
from jaggc.runtime.routing import Routing
from jaggc.runtime.window import WindowOptions


@dataclass(frozen=True)
class CompileConfig:
    """What the passes compile for: the window size, the runtime's options for every window (its
    weights, time argument and backward mode among them) and the run-time routing."""

    window: int = 4
    options: WindowOptions = WindowOptions()
    routing: Routing = Routing()
    split_batches: bool = True     # split_cfg_batches: run detached batch slices without grad
    check_passes: bool = False     # run every pass's ensures after it (pipeline.checks_requested)


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


@dataclass
class PassContext:
    config: CompileConfig
    dit: nn.Module | None = None
    frontend: str = ""
    windows: list[Window] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    watched: list[str] = field(default_factory=list)   # the modules the frontend kept opaque, for messages
    entry_grad: bool = True    # the grad mode the graph is entered in (the caller's, at capture)
    entry_autocast: AutocastState = AUTOCAST_OFF   # the autocast state it is entered in
    splits: list = field(default_factory=list)          # split_cfg_batches: the DiT calls it split
    effects: list | None = None    # effects.effect_edges: (earlier, later, write) order constraints
    replaced: dict = field(default_factory=dict)        # rewrite_windows: erased call -> the node running it

    def dit_calls(self, gm: fx.GraphModule) -> list[fx.Node]:
        return [n for n in gm.graph.nodes if CALL.on(n)]

    def trained_calls(self, gm: fx.GraphModule) -> list[fx.Node]:
        return [n for n in self.dit_calls(gm) if CALL.of(n).step is not None]
