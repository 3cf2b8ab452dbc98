"""Run the passes in order, linting and snapshotting the graph after each one.

Every snapshot is the graph's generated code after that pass, so users can read and diff what
each pass did (``Report.stages``, ``Report.diff``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import fx

from jaggc.errors import JaggError, JaggGraphError

from .check_frontend import check_frontend
from .cleanup import cleanup
from .context import PassContext
from .find_dit_calls import find_dit_calls
from .independence import check_independence
from .rewrite import rewrite_windows
from .weights import compute_weights
from .windows import assign_windows

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

DEFAULT_PASSES: tuple[Pass, ...] = (
    check_frontend, find_dit_calls, check_independence, assign_windows, compute_weights,
    rewrite_windows, cleanup,
)


@dataclass
class Stage:
    name: str
    code: str


def graph_code(gm: fx.GraphModule) -> str:
    gm.recompile()
    return gm.code.strip() + "\n"


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes=DEFAULT_PASSES) -> tuple[fx.GraphModule, list[Stage]]:
    stages = [Stage(f"capture ({ctx.frontend})", graph_code(gm))]
    for p in passes:
        try:
            gm = p(gm, ctx)
            gm.graph.lint()
        except JaggError:
            raise
        except Exception as e:  # a pass bug must not look like a user error, nor pass silently
            raise JaggGraphError(f"pass {p.__name__} failed after {[s.name for s in stages]}: "
                                 f"{type(e).__name__}: {e}") from e
        stages.append(Stage(p.__name__, graph_code(gm)))
    return gm, stages
