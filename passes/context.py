"""The facts passes share: the compile configuration and what each analysis found.

``CompileConfig`` (jaggc/config.py), ``CallSite`` and ``Window`` (jaggc/call_site.py) live below the
frontends, which name them too; they are re-exported here, where the passes always found them.

Analyses store per-node facts in ``node.meta`` (``jagg_call`` on DiT calls, ``jagg_grad`` and
``jagg_autocast`` on every node) and per-graph facts (the windows) here; a pass never recomputes what an earlier one stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

from jaggc.call_site import CallSite, Window
from jaggc.config import CompileConfig
from jaggc.node_meta import CALL
from jaggc.runtime.autocast import AUTOCAST_OFF, AutocastState


@dataclass
class PassContext:
    """One compile's shared state: its configuration, the DiT, and what each analysis stored."""

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


__all__ = ["CallSite", "CompileConfig", "PassContext", "Window"]
