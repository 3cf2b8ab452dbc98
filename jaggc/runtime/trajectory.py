"""Run a whole trajectory of DiT calls window by window: the eager driver.

``run_trajectory`` runs given windows (plain, routed or all exact, each in its calls' module
and autocast state) and is shared by ``jagg_calls`` and the intercept path; the windows themselves come from
the one grouping rule (``grouping.py``), which the window pass applies to graphs. It sits above
both ``window.py`` (one window) and ``routing.py`` (windows chosen as JAGG or exact by their
score, which itself runs windows), so that neither of those imports the other back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from torch import nn

from ..errors import JaggGraphError
from .calls import DitCall
from .deferred import BackwardGroup
from .grouping import group_calls
from .module_state import CallState
from .routing import Routing, RoutingDecision, run_routed
from .window import WindowOptions, check_window_size, deferred_grad_forwards, run_exact, run_window


def run_trajectory(dit: nn.Module, calls: Sequence[DitCall], windows: Sequence[Sequence[int]], *,
                   options: WindowOptions = WindowOptions(), exact_windows: Sequence[int] = (),
                   routing: Routing | None = None, states: Sequence[CallState] | None = None
                   ) -> tuple[list[Any], RoutingDecision | None]:
    """The outputs of ``calls`` (in call order), run as ``windows`` (lists of call indices), and
    the routing decision (None without routing).

    Windows listed in ``exact_windows`` (by index) run as plain per-step calls; ``routing`` (a
    ``Routing``) chooses JAGG windows at run time by score, over the other windows together;
    ``states`` (one ``CallState`` per call) puts the DiT and the thread in each window's module and
    autocast state while it runs (routing needs one state: its windows are scored together)."""
    outs: list[Any] = [None] * len(calls)
    if states is not None:
        check_one_state_per_window(windows, states)

    def put(idx, window_outs):
        for k, o in zip(idx, window_outs):
            outs[k] = o

    def in_state(idx):
        return states[idx[0]].applied(dit) if states is not None and idx else contextlib.nullcontext()

    def exact(idx):
        with in_state(idx):
            put(idx, run_exact(dit, [calls[k] for k in idx], steps=list(idx), options=options))

    if routing is not None and routing.active:
        kept = [list(w) for i, w in enumerate(windows) if i not in exact_windows]
        with in_state(kept[0] if kept else []):
            routed, decision = run_routed(dit, [[calls[k] for k in w] for w in kept], kept, options, routing)
        for idx, window_outs in zip(kept, routed):
            put(idx, window_outs)
        for i, idx in enumerate(windows):
            if i in exact_windows:
                exact(idx)
        return outs, decision
    group = BackwardGroup(deferred_grad_forwards(windows, options, exact_windows))
    for i, idx in enumerate(windows):
        if i in exact_windows:
            exact(idx)
            continue
        with in_state(idx):
            put(idx, run_window(dit, [calls[k] for k in idx], steps=list(idx), options=options, group=group))
    return outs, None


def check_one_state_per_window(windows: Sequence[Sequence[int]], states: Sequence[CallState]) -> None:
    """Never JAGG across two module or autocast states: a window pairs its calls' Jacobians, and runs
    in its first call's state. The grouping rule cuts runs at every state change (grouping.py), so a
    window that mixes states is refused here, naming the steps, instead of running silently wrong."""
    for idx in windows:
        for k in idx[1:]:
            if states[k] != states[idx[0]]:
                raise JaggGraphError(
                    f"internal: a JAGG window (steps {list(idx)}) holds DiT calls made in two states: step {idx[0]} "
                    f"and step {k} differ in {states[idx[0]].difference(states[k])}. Keep the trained calls of "
                    f"a window in one module state (call dit.train()/dit.eval() outside the loss) and report this",
                    where=f"step {k}")


def jagg_calls(dit: nn.Module, calls: Sequence[DitCall], *, window: int = 4,
               options: WindowOptions = WindowOptions(), exact_windows: Sequence[int] = (),
               routing: Routing | None = None) -> list[Any]:
    """Run a trajectory's DiT calls in windows of ``window`` steps, cut by jaggc's one grouping rule
    (``grouping.py``): consecutive calls, a shorter tail a JAGG window of its own length (exact
    when it has <= 2 steps), two-call CFG (calls on the same state and timestep) one window per
    stream, a change of argument structure a cut.

    Windows listed in ``exact_windows`` (by index) run as plain per-step calls. ``routing`` (a
    ``Routing``) chooses JAGG windows at run time by score. ``window`` is the largest window: a
    trajectory of fewer calls is one window of its length (one or two calls: exact), an empty one
    has no outputs.
    """
    check_window_size(window)
    if not calls:
        return []
    grouping = group_calls(calls, window, time_arg=options.time_arg)
    outs, _ = run_trajectory(dit, calls, grouping.windows, options=options, exact_windows=exact_windows,
                             routing=routing)
    return outs
