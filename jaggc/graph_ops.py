"""The node targets of jaggc's graphs: module-level functions that call into the runtime.

Every captured DiT call becomes ``dit_call(dit, args, kwargs)`` (the canonical form both
frontends produce), and every rewritten window one ``jagg_window(dit, calls, ...)`` node whose
output tuple is read by one ``getitem`` per step. They are ``torch.fx.wrap``ped so that an FX
retrace keeps them opaque, and module-level so that generated code can name them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from ._compat import tree_flatten
from .runtime.calls import DitCall, per_sample_time, resolve_time_arg
from .runtime.deferred import BackwardGroup
from .runtime.routing import Routing, RoutingDecision, run_routed
from .runtime.window import WindowOptions, run_exact, run_window


_IN_PLACE_OPERATORS = frozenset(getattr(operator, n) for n in (
    "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior", "ipow", "irshift",
    "isub", "itruediv", "ixor", "setitem", "delitem"))


def is_in_place(node: torch.fx.Node) -> bool:
    """An op that writes one of its inputs (``x.add_(y)``, ``x[i] = y``, ``x += y``): its effect
    lives in the input, so it must run even when its own output is unused."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in _IN_PLACE_OPERATORS:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


@torch.fx.wrap
def dit_call(dit, args: tuple, kwargs: dict, step: int | None = None, options: WindowOptions | None = None) -> Any:
    """One DiT call that was not rewritten (exact, or a no-grad reference call)."""
    call = DitCall(tuple(args), dict(kwargs))
    if step is None:
        return call(dit)
    return run_exact(dit, [call], steps=[step], options=options or WindowOptions())[0]


@dataclass
class DeferredGroupPlan:
    """Shared by the per-window-mode plans of one graph: each execution of the graph starts a new
    ``BackwardGroup`` at its first deferred window, so DDP syncs once per loss evaluation."""

    grad_forwards: int
    first_window: int
    current: BackwardGroup | None = None

    def group_for(self, window_index: int) -> BackwardGroup:
        if window_index == self.first_window or self.current is None:
            self.current = BackwardGroup(self.grad_forwards)
        return self.current


@dataclass
class WindowPlan:
    """What a ``jagg_window`` node runs (held by the GraphModule, read through ``get_attr``).

    ``observed_times`` keeps the first sample's timesteps of the latest execution, for reports.
    """

    index: int
    steps: tuple[int, ...]
    options: WindowOptions
    observed_times: list[float] = field(default_factory=list)
    deferred: DeferredGroupPlan | None = None


@torch.fx.wrap
def jagg_window(dit, calls: tuple, plan: WindowPlan) -> tuple:
    """The W outputs of one window (values exact, backward JAGG); ``calls`` = ((args, kwargs), ...)."""
    dit_calls = [DitCall(tuple(a), dict(k)) for a, k in calls]
    if not plan.observed_times:
        plan.observed_times = observed_times(dit_calls, plan.options.time_arg)
    group = plan.deferred.group_for(plan.index) if plan.deferred is not None else None
    return tuple(run_window(dit, dit_calls, steps=list(plan.steps), options=plan.options, group=group))


@dataclass
class TrajectoryPlan:
    """What a ``jagg_trajectory`` node runs: the routed windows, and the latest routing decision."""

    windows: tuple[tuple[int, ...], ...]   # the steps of each routed window
    window_indices: tuple[int, ...]        # their indices among all windows (report rows)
    options: WindowOptions
    routing: Routing
    decision: RoutingDecision | None = None
    observed_times: list[list[float]] = field(default_factory=list)


@torch.fx.wrap
def jagg_trajectory(dit, windows: tuple, plan: TrajectoryPlan) -> tuple:
    """The outputs of every routed window's steps, in order: each window scored, then run as JAGG or
    exact (runtime/routing.py). ``windows`` = (((args, kwargs), ...), ...), one tuple per window."""
    calls = [[DitCall(tuple(a), dict(k)) for a, k in w] for w in windows]
    if not plan.observed_times:
        plan.observed_times = [observed_times(w, plan.options.time_arg) for w in calls]
    outs, plan.decision = run_routed(dit, calls, [list(w) for w in plan.windows], plan.options, plan.routing)
    return tuple(o for window_outs in outs for o in window_outs)


def observed_times(calls, time_arg) -> list[float]:
    """The first sample's timestep of each call (one host sync; only on a plan's first run)."""
    arg = resolve_time_arg(calls[0], time_arg)
    try:
        return [float(per_sample_time(c, arg)[0]) for c in calls]
    except Exception:  # reporting must never break a training step
        return []


@torch.fx.wrap
def flatten_output(output: Any) -> tuple:
    """The flat output leaves a Dynamo graph expects from an opaque call."""
    return tuple(tree_flatten(output)[0])
