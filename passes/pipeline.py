"""Run the passes in order, linting and snapshotting the graph after each one.

Every snapshot is the graph's generated code after that pass, so users can read and diff what
each pass did (``Report.stages``, ``Report.diff``). Generating code is most of the passes' time on
a long loss, so it is generated only where the graph
changed: the capture snapshot is the code the frontend compiled, an analysis pass (one that only
stores facts in ``node.meta``) reuses the previous snapshot (that it left the node list alone is
checked), and only the last transform's code is compiled (the graph that runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch import fx

from jaggc.errors import JaggError, JaggInternalError

from .check_frontend import check_frontend
from .cleanup import cleanup
from .context import PassContext
from .effects import check_window_inputs
from .find_dit_calls import find_dit_calls
from .independence import check_independence
from .infra import GraphPass, check_order, check_requires
from .lowmem_terms import place_lowmem_terms
from .modes import place_modes, tag_modes
from .rewrite import rewrite_windows
from .split_batch import split_cfg_batches
from .weights import compute_weights
from .windows import assign_windows

# The order, with every analysis named where it runs: the CFG split adds DiT calls the first
# tag_modes never saw, so the modes are tagged again after it; the low-memory pass applies only
# with backward="lowmem". check_order (below, and in every run_passes) proves each pass's requires are
# met and that the order ends runnable (infra.RUNNABLE).
DEFAULT_PASSES: tuple[GraphPass, ...] = (
    check_frontend, tag_modes, split_cfg_batches, tag_modes, find_dit_calls, check_independence, assign_windows,
    check_window_inputs, compute_weights, rewrite_windows, place_lowmem_terms, cleanup, place_modes,
)
check_order(DEFAULT_PASSES)

#: set JAGGC_CHECK_PASSES=1 (the tests do) or Options(check_passes=True) to run every pass's ensures
CHECK_ENV = "JAGGC_CHECK_PASSES"


def checks_requested(ctx: PassContext) -> bool:
    return bool(getattr(ctx.config, "check_passes", False)) or os.environ.get(CHECK_ENV, "") not in ("", "0")


@dataclass
class Stage:
    name: str
    code: str


def graph_code(gm: fx.GraphModule, compile: bool = True) -> str:
    """The graph's generated code; ``compile=False`` skips compiling it (a snapshot of a graph a
    later pass changes again)."""
    if not compile:
        return gm.graph.python_code(root_module="self").src.strip() + "\n"
    gm.recompile()
    return gm.code.strip() + "\n"


def _node_list(gm: fx.GraphModule) -> list:
    return [(n, n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes]


def _same_nodes(before: list, after: list) -> bool:
    return len(before) == len(after) and all(
        a[0] is b[0] and a[1:3] == b[1:3] and a[3] is b[3] and a[4] is b[4] for a, b in zip(before, after))


def passes_for(ctx: PassContext) -> tuple[GraphPass, ...]:
    """The default passes that apply to this compile (``GraphPass.applies``)."""
    return tuple(p for p in DEFAULT_PASSES if p.applies(ctx))


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes=None, *,
               check: bool | None = None) -> tuple[fx.GraphModule, list[Stage]]:
    """Run ``passes`` (default: ``DEFAULT_PASSES``; those that do not apply to ``ctx`` are skipped,
    their facts holding vacuously), linting and snapshotting after each; with ``check`` (default:
    ``checks_requested``) also each pass's ``ensures``. The order is checked before the first pass
    and each pass's ``requires`` against the facts that hold as it is reached, ``passes=...`` too."""
    passes = DEFAULT_PASSES if passes is None else tuple(passes)
    check_order(passes)
    check = checks_requested(ctx) if check is None else check
    last_applying = max((i for i, p in enumerate(passes) if p.applies(ctx)), default=-1)
    # the frontends hand over a compiled GraphModule (fx.GraphModule() and canonicalize_dynamo_calls
    # compile it), so the capture snapshot is its code as it stands
    stages = [Stage(f"capture ({ctx.frontend})", gm.code.strip() + "\n")]
    stale = False   # the graph changed since it was last compiled
    current: set = set()   # the facts that hold for the graph as it stands
    nodes = _node_list(gm)  # the node list as it stands (one snapshot per pass, reused as the next's "before")
    for i, p in enumerate(passes):
        check_requires(p, current)
        if not p.applies(ctx):
            current |= p.provides        # vacuously true: nothing of the graph for it to do
            continue
        if p.analysis and p.provides <= current:
            # its facts still hold (the transform that could make them stale changed nothing,
            # e.g. no CFG call to split): re-running it would store the same facts
            stages.append(Stage(p.__name__, stages[-1].code))
            continue
        try:
            before = nodes
            gm = p(gm, ctx)
            nodes = _node_list(gm)
            unchanged = _same_nodes(before, nodes)
            if p.analysis and not unchanged:
                raise JaggInternalError(f"analysis pass {p.__name__} changed the graph; only transforms may")
            if check:
                p.ensures(gm, ctx)
            current = (current if unchanged else current - p.invalidates) | p.provides
            if unchanged:
                # an analysis, or a transform with nothing to do here: the snapshot stands
                stages.append(Stage(p.__name__, stages[-1].code))
                continue
            gm.graph.lint()
        except JaggError:
            raise
        except Exception as e:  # a pass bug must not look like a user error, nor pass silently
            raise JaggInternalError(f"pass {p.__name__} failed after {[s.name for s in stages]}: "
                                 f"{type(e).__name__}: {e}") from e
        last = i == last_applying
        stages.append(Stage(p.__name__, graph_code(gm, compile=last)))
        stale = not last
    if stale:
        gm.recompile()
    return gm, stages
