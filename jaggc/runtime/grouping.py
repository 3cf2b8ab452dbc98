"""The one rule that cuts a trajectory's trained DiT calls into windows.

The window pass applies it to fx nodes (passes/windows.py); the eager drivers apply it to recorded
``DitCall``s (``jagg_calls``, the intercept path, the fidelity estimators). A loss therefore gets
the same windows whichever path runs it; each caller only says when two calls belong to one
sampling step and when two calls can share one batched call.

1. **Streams.** Consecutive calls on the same state and timestep are one sampling step (two-call
   classifier-free guidance: uncond, then cond). When every step makes the same number s > 1 of
   calls, the i-th call of each step is stream i and no window mixes streams: a window interpolates
   between Jacobians of one conditioning. Otherwise all calls are one stream.
2. **Runs.** Within a stream, consecutive calls with equal batch keys (argument structure; for
   recorded calls also the module state) form a run; a call that breaks it starts a new run.
3. **Windows.** Each run is cut into windows of ``window`` steps; a shorter tail is a window of
   its own length (exact when it has <= 2 steps, since then every step is a knot). ``window`` is
   the largest window, not a demand: a run shorter than it (a trajectory of 3 trained steps at
   ``window=4``, MixGRPO's window near the end of its run) is one window of its length.

Windows are listed stream by stream, run by run; indices refer to the caller's call list.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from .._compat import tree_flatten, tree_flatten_with_path
from ..errors import JaggInputError
from .calls import DitCall, get_time, input_name, primary_input, resolve_time_arg
from .window import check_window_size, partition


@dataclass(frozen=True)
class Grouping:
    """Where the rule cut a trajectory: ``streams`` and ``windows`` hold call indices."""

    streams: list[list[int]]
    windows: list[list[int]]
    cut: bool           # some stream holds calls of different batch keys, so windows were cut there
    cuts: tuple[tuple[int, int], ...] = ()    # (last call of a run, first call of the next), per cut
    uncut_knots: int = 0          # knots (DiT backward rows) the streams' windows would have without cuts

    @property
    def knots(self) -> int:
        """Knot calls of the windows (plain JAGG: two per window, every call of a window of <= 2)."""
        return sum(min(len(w), 2) for w in self.windows)

    def notes(self) -> list[str]:
        """What the rule did beyond plain consecutive windows, in words for a report."""
        out = []
        if len(self.streams) > 1:
            out.append(f"{len(self.streams)} DiT calls per sampling step (classifier-free guidance with separate "
                       f"calls): one window per stream, never mixing streams")
        if self.cut:
            out.append("some DiT calls differ in argument structure; windows were cut at those calls")
        return out


def streams(num_calls: int, same_step: Callable[[int, int], bool]) -> list[list[int]]:
    """The calls by stream (rule 1); ``same_step(j, k)``: calls j and k make one sampling step."""
    steps: list[list[int]] = []
    for k in range(num_calls):
        if steps and same_step(steps[-1][-1], k):
            steps[-1].append(k)
        else:
            steps.append([k])
    width = max((len(s) for s in steps), default=1)
    if width == 1 or any(len(s) != width for s in steps):
        return [list(range(num_calls))]
    return [[s[i] for s in steps] for i in range(width)]


def runs(stream: Sequence[int], batch_key: Callable[[int], Hashable]) -> list[list[int]]:
    """Rule 2: consecutive calls of ``stream`` with equal ``batch_key``."""
    out: list[list[int]] = []
    for k in stream:
        if out and batch_key(out[-1][-1]) == batch_key(k):
            out[-1].append(k)
        else:
            out.append([k])
    return out


def group_windows(num_calls: int, window: int, *, same_step: Callable[[int, int], bool],
                  batch_key: Callable[[int], Hashable]) -> Grouping:
    """The windows of ``num_calls`` calls (module docstring)."""
    check_window_size(window)
    by_stream = streams(num_calls, same_step)
    runs_per_stream = [runs(s, batch_key) for s in by_stream]
    windows = [[run[i] for i in idx] for rs in runs_per_stream for run in rs for idx in partition(len(run), window)]
    cuts = tuple((a[-1], b[0]) for rs in runs_per_stream for a, b in zip(rs, rs[1:]))
    return Grouping(by_stream, windows, cut=bool(cuts), cuts=cuts,
                    uncut_knots=sum(min(len(p), 2) for s in by_stream for p in partition(len(s), window)))


def cut_announcement(grouping: Grouping, window: int, differ: Callable[[int, int], str],
                     calls_named: str = "DiT calls") -> str | None:
    """The words for a cut that makes windows smaller (a slower gradient: more DiT backward passes),
    or None if the cuts cost nothing. ``differ(j, k)`` says how calls j and k differ."""
    if grouping.knots <= grouping.uncut_knots:
        return None
    j, k = grouping.cuts[0]
    more = f" (and {len(grouping.cuts) - 1} more cuts)" if len(grouping.cuts) > 1 else ""
    return (f"windows were cut between {calls_named} {j} and {k}{more} because the calls differ in {differ(j, k)}: "
            f"{len(grouping.windows)} windows with {grouping.knots} knot calls instead of {grouping.uncut_knots} at "
            f"window={window}, so more steps run their own DiT backward. Calls batch into one window only with the same argument structure; pass "
            f"such a value as a tensor (a Python-number timestep: `torch.full((batch,), t)`) or keep it equal "
            f"across steps")


def leaf_difference(a: tuple[tuple, dict], b: tuple[tuple, dict], is_value: Callable[[Any], bool]) -> str:
    """The first argument two calls' (args, kwargs) differ in, as ``'timestep' (a Python float: 0.9
    vs 0.8)``; leaves with ``is_value(x)`` (tensors, graph values) are batched and not compared."""
    fa, sa = tree_flatten_with_path(a)
    fb, sb = tree_flatten_with_path(b)
    if sa != sb:
        names_a, names_b = {input_name(p) for p, _ in fa}, {input_name(p) for p, _ in fb}
        changed = sorted(names_a ^ names_b) or [input_name(p) for p, _ in fa][:1]
        return f"argument structure ({', '.join(changed[:3])})"
    for (path, x), (_, y) in zip(fa, fb):
        if is_value(x) or is_value(y):
            continue
        if type(x) is not type(y) or repr(x) != repr(y):
            kind = f"a Python {type(x).__name__}" if type(x) is type(y) else f"{type(x).__name__} vs {type(y).__name__}"
            return f"{input_name(path)} ({kind}: {x!r} vs {y!r})"
    return "argument structure"


# ---------------------------------------------------------------------------------------------
# the keys of recorded calls


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                      and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()):
            return True   # the same view: no need to look at the values
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, numbers.Number) and isinstance(b, numbers.Number):
        return a == b
    return False


def same_step_of(calls: Sequence[DitCall], time_arg: str | int | None) -> Callable[[int, int], bool]:
    """Calls j and k are one sampling step when they take the same state and the same timestep
    (by value: a CFG loss may index its stored state twice)."""
    def same_step(j: int, k: int) -> bool:
        a, b = calls[j], calls[k]
        arg = resolve_time_arg(a, time_arg)
        try:
            # the timestep first: two steps' Python-number timesteps differ without a host sync
            return (_same_value(get_time(a, arg), get_time(b, arg))
                    and _same_value(primary_input(a), primary_input(b)))
        except JaggInputError:
            return False   # no state or timestep to compare: the window's own checks say why
    return same_step


def structure(call: DitCall) -> Hashable:
    """A recorded call's argument structure with tensors erased (the fx pass's ``static_signature``
    on recorded calls): tensor shapes that differ are refused by the window, not cut around."""
    flat, spec = tree_flatten((call.args, call.kwargs))
    return str(spec), tuple("<tensor>" if isinstance(x, torch.Tensor) else repr(x) for x in flat)


def group_calls(calls: Sequence[DitCall], window: int, *, time_arg: str | int | None = None,
                states: Sequence[Hashable] | None = None) -> Grouping:
    """The windows of recorded calls; with ``states`` (one module state per call), calls in
    different states never share a run."""
    def batch_key(k: int) -> Hashable:
        return structure(calls[k]) if states is None else (structure(calls[k]), states[k])

    return group_windows(len(calls), window, same_step=same_step_of(calls, time_arg), batch_key=batch_key)
