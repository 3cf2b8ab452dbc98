"""The node targets of jaggc's graphs: module-level functions that call into the runtime.

Every captured DiT call becomes ``dit_call(dit, args, kwargs)`` (the canonical form both
frontends produce), and every rewritten window one ``jagg_window(dit, calls, ...)`` node whose
output tuple is read by one ``getitem`` per step. They are ``torch.fx.wrap``ped so that an FX
retrace keeps them opaque, and module-level so that generated code can name them.

``RUNTIME_TARGETS`` is the one table of these targets: the backend splitter keeps them out of
compiled glue and cleanup keeps them even when unused (they run the DiT's hooks or change its
state; torch's ``has_side_effect`` marks them, so ``node.is_impure()`` says so too).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from ._compat import DYNAMO_ENTER_AUTOCAST, DYNAMO_EXIT_AUTOCAST, tree_flatten, tree_map
from .runtime.calls import DitCall, per_sample_time, resolve_time_arg
from .runtime import autocast as _autocast
from .runtime.autocast import AutocastState
from .source import node_location
from .runtime.deferred import BackwardGroup
from .runtime.lowmem import LowMemRun
from .runtime.module_state import ModuleState, applied, set_state
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


def is_graph_value(x) -> bool:
    """An argument the graph computes (an fx node), as opposed to a constant baked into the call:
    the ``is_value`` of runtime/calls.py's call layout, on graphs."""
    return isinstance(x, torch.fx.Node)


def user_source(node: torch.fx.Node) -> str:
    """``file:line`` of the user code that made ``node`` (from its stack trace), skipping torch's
    and jaggc's own frames (the opaque-call slots sit between the user's call and the DiT;
    source.py); "" if unknown."""
    return node_location(node)


@torch.fx.wrap
def dit_call(dit, args: tuple, kwargs: dict, step: int | None = None, options: WindowOptions | None = None,
             state: ModuleState | None = None) -> Any:
    """One DiT call that was not rewritten (exact, or a no-grad reference call). ``state``: the
    module state the call was traced under, when it differs from the graph's (a reference call
    inside ``disable_adapter()``); the module is put in it for the call and restored after."""
    call = DitCall(tuple(args), dict(kwargs))
    with applied(dit, state):
        if step is None:
            # a no-grad call (a reference, the uncond half of a split CFG call): the rollout may
            # have made it already
            cache = options.rollout_cache if options is not None else None
            if cache is not None and not torch.is_grad_enabled():
                out = cache.lookup(call)
                if out is not None:
                    return out
            return call(dit)
        return run_exact(dit, [call], steps=[step], options=options or WindowOptions())[0]


@torch.fx.wrap
def live_tensor(module, path: str):
    """A parameter or buffer of ``module`` (``path`` as in ``named_parameters``), read when the graph
    runs: a loss term such as ``(dit.W1 ** 2).sum()`` must see the current parameter, never the
    value it had when the loss was traced (frontends/live_tensors.py)."""
    value = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


@torch.fx.wrap
def copy_output(output: Any) -> Any:
    """A copy of a window's step output (its tensor leaves cloned, autograd kept), for a loss that
    writes into the DiT's output in place (passes/rewrite.py)."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, output)


@torch.fx.wrap
def batch_chunk(x, state, chunks: int, index: int | tuple[int, ...]):
    """Chunk ``index`` of ``chunks`` of a DiT input along the batch (several chunks, concatenated,
    for a tuple), if it is batched (its leading dim is the state's batch); other inputs (shared
    ids, a scalar timestep) as they are."""
    if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == state.shape[0]:
        parts = x.chunk(chunks)
        if isinstance(index, tuple):
            return torch.cat([parts[i] for i in index]) if len(index) > 1 else parts[index[0]]
        return parts[index]
    return x


@torch.fx.wrap
def set_module_state(dit, state: ModuleState) -> None:
    """Put the DiT in a traced module state (the loss called ``dit.train()`` or changed adapters
    before its trained calls, or left the module changed at its end)."""
    set_state(dit, state)


@torch.fx.wrap
def set_autocast(state: tuple) -> None:
    """Run the nodes that follow in autocast ``state`` (an absolute state: the FX frontend records
    one wherever the traced loss entered or left an autocast block, and the mode pass rebuilds
    them from each node's fact after the rewrite moved nodes; runtime/autocast.py). fx keeps the
    ``AutocastState`` as the plain tuple of its ``(device, dtype)`` pairs."""
    _autocast.set_autocast(AutocastState(state))


def is_autocast_switch(node: torch.fx.Node) -> bool:
    """A mode change of the autocast state: jaggc's absolute switch, or Dynamo's region
    ``_enter_autocast`` / ``_exit_autocast`` pair."""
    return node.op == "call_function" and (node.target is set_autocast or node.target in _DYNAMO_AUTOCAST)


_DYNAMO_AUTOCAST = frozenset({DYNAMO_ENTER_AUTOCAST, DYNAMO_EXIT_AUTOCAST})


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


@dataclass
class LowMemPlan:
    """Shared by the low-memory window, term and output nodes of one graph; each execution of the
    graph starts a new ``LowMemRun`` at its first window."""

    num_windows: int
    first_window: int
    current: LowMemRun | None = None
    buffer_bytes: int = 0          # of the latest execution (for reports and the bench)

    def run_for(self, dit, window_index: int) -> LowMemRun:
        if window_index == self.first_window or self.current is None:
            self.current = LowMemRun(dit, self.num_windows)
        return self.current


@dataclass
class LowMemWindowPlan:
    index: int
    steps: tuple[int, ...]
    options: WindowOptions
    exact: bool                    # every step a knot (a tail of <= 2 steps, or jagg_frac=0)
    terms: dict[int, int]          # step position -> terms of the loss that read its output
    last: bool                     # the last window to run: its knot graph waits for loss.backward()
    shared: LowMemPlan
    observed_times: list[float] = field(default_factory=list)


@torch.fx.wrap
def jagg_lowmem_window(dit, calls: tuple, plan: LowMemWindowPlan, after: tuple = ()) -> tuple:
    """The W outputs of one low-memory window (values exact; runtime/lowmem.py). ``after``: the
    previous window's term nodes, so that this window's forward runs once that one's backward did."""
    dit_calls = [DitCall(tuple(a), dict(k)) for a, k in calls]
    if not plan.observed_times:
        plan.observed_times = observed_times(dit_calls, plan.options.time_arg)
    run = plan.shared.run_for(dit, plan.index)
    return tuple(run.run_window(plan.index, dit_calls, plan.steps, plan.options, exact=plan.exact,
                                terms=plan.terms, last=plan.last))


@torch.fx.wrap
def jagg_lowmem_term(term, plan: LowMemPlan, window: int, position: int, coef: float, name: str):
    """A per-step term of the loss: its gradient feeds its window's backward; returns it detached."""
    return plan.current.add_term(window, position, term, coef, name)


@torch.fx.wrap
def jagg_lowmem_output(loss, plan: LowMemPlan):
    """The loss value, whose backward injects the windows' gradients (runtime/lowmem.py)."""
    out = plan.current.output(loss)
    plan.buffer_bytes = plan.current.buffer_bytes
    plan.current = None
    return out


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


RUNTIME_TARGETS = frozenset({dit_call, jagg_window, jagg_trajectory, flatten_output, set_module_state,
                             set_autocast, jagg_lowmem_window, jagg_lowmem_term, jagg_lowmem_output})
for _target in (dit_call, jagg_window, jagg_trajectory, set_module_state, set_autocast, jagg_lowmem_window,
                jagg_lowmem_term, jagg_lowmem_output):
    torch.fx.node.has_side_effect(_target)


def is_runtime_target(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in RUNTIME_TARGETS
