"""What a compiled loss is compiled for: ``CompileConfig``, the one configuration the frontends, the
passes and the report share (the window size, the runtime's options for every window and the
run-time routing). It lives below the frontends and the passes so both can name its type."""

from __future__ import annotations

from dataclasses import dataclass

from .runtime.routing import Routing
from .runtime.window import WindowOptions


@dataclass(frozen=True)
class CompileConfig:
    """What the passes compile for: the window size, the runtime's options for every window (its
    weights, time argument and backward mode among them) and the run-time routing."""

    window: int = 4
    options: WindowOptions = WindowOptions()
    routing: Routing = Routing()
    split_batches: bool = True     # split_cfg_batches: run detached batch slices without grad
    check_passes: bool = False     # run every pass's ensures after it (pipeline.checks_requested)


__all__ = ["CompileConfig"]
