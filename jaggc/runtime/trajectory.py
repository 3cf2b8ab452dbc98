"""Run a whole trajectory of DiT calls window by window: ``jagg_calls``.

It sits above both ``window.py`` (one window) and ``routing.py`` (windows chosen as JAGG or exact
by their score, which itself runs windows), so that neither of those imports the other back.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ..errors import JaggInputError
from .calls import DitCall
from .deferred import BackwardGroup
from .routing import Routing, run_routed
from .window import WindowOptions, check_window_size, deferred_grad_forwards, partition, run_exact, run_window


def jagg_calls(dit: nn.Module, calls: Sequence[DitCall], *, window: int = 4,
               options: WindowOptions = WindowOptions(), exact_windows: Sequence[int] = (),
               routing: Routing | None = None) -> list[Any]:
    """Run a trajectory's DiT calls in consecutive windows of ``window`` steps.

    Windows listed in ``exact_windows`` (by index) run as plain per-step calls. A tail shorter
    than ``window`` is a JAGG window of its own length (exact when it has <= 2 steps).
    ``routing`` (a ``Routing``) chooses JAGG windows at run time by score.
    """
    if not calls:
        raise JaggInputError("no DiT calls to run: the trajectory is empty")
    check_window_size(window)
    if len(calls) < 2:
        raise JaggInputError(
            f"window={window}: the trajectory has 1 step and a JAGG window needs at least 2, so there is nothing "
            f"to aggregate; run the call uncompiled (run_exact or plain autograd: one backward per step is the "
            f"minimum)")
    if window > len(calls):
        raise JaggInputError(f"window={window} is larger than the {len(calls)} steps of the trajectory; "
                             f"use window <= {len(calls)}")
    windows = partition(len(calls), window)
    if routing is not None and routing.active:
        kept = [w for i, w in enumerate(windows) if i not in exact_windows]
        routed, _ = run_routed(dit, [[calls[i] for i in w] for w in kept], kept, options, routing)
        by_window = dict(zip([tuple(w) for w in kept], routed))
        return [o for w in windows for o in (by_window.get(tuple(w)) or run_exact(
            dit, [calls[i] for i in w], steps=w, options=options))]
    group = BackwardGroup(deferred_grad_forwards(windows, options, exact_windows))
    outs: list[Any] = []
    for w, idx in enumerate(windows):
        if w in exact_windows:
            outs.extend(run_exact(dit, [calls[i] for i in idx], steps=idx, options=options))
        else:
            outs.extend(run_window(dit, [calls[i] for i in idx], steps=idx, options=options, group=group))
    return outs
