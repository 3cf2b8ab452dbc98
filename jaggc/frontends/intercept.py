"""The no-tracing fallback: run the loss twice with the DiT argument replaced by a proxy.

For loss code neither Dynamo nor FX can capture (data-dependent Python, C extensions, exotic
containers), jaggc still needs to know the DiT calls before it can run them as windows. The
interceptor finds out by running the loss:

  1. **record**: the DiT argument is a ``DitProxy`` that runs each grad-mode call without grad,
     records its inputs and returns the output as a fresh leaf that requires grad, so a later call
     whose input was computed from it is caught (the calls must be gradient-independent, like in a
     graph: states are stored, not recomputed). The outputs are kept in a ``RolloutCache``.
  2. **replay**: the recorded calls are cut into windows by jaggc's one grouping rule
     (``runtime/grouping.py``) and run by the eager driver ``run_trajectory`` (interior outputs
     come from the cache, so only the knot forwards run again), then the loss runs a second time
     and the proxy hands back, in call order, the recording's output values carrying the windows'
     JAGG backward (so the replay computes the recording's numbers bit for bit), refusing any call
     whose inputs differ from the recording (the loss must be deterministic given its inputs). The
     recording's side effects are undone before the replay (``intercept_effects.py``).

It costs one extra forward of every step compared with a captured graph (the knots are computed
twice: once without grad in the recording, once with grad) and runs the loss's Python twice. No-grad
calls (KL reference forwards) go straight to the DiT in both runs. The DiT must be an argument of
the loss (a closed-over module cannot be swapped for the proxy).

Every recorded call keeps the DiT's module state and the thread's autocast state
(``module_state.CallState``): the windows run after the loss's first run, outside any
``torch.autocast`` block the loss opened, so each window is put back in its calls' state (a bf16
block around the DiT call stays a bf16 call, never a silent fp32 one); windows never mix calls of
different states, the recording cache keys rows by state (a reference call under
``disable_adapter()`` has the policy call's inputs, not its output), and the replay refuses a call
whose state differs from the recording's. A state change inside a window (``dit.train()`` at step k
of a window entered in ``eval()``, or the other way) therefore splits it there, each part a window of
its own (<= 2 steps: exact), and the cut is announced with its cost; a change at a window boundary
costs nothing. The whole module state decides (every train flag), not ``function_state.py``'s reading
of which modules compute differently: a change that leaves the function as it is (SD3, whose dropouts
have p = 0) still cuts, since a ``self.training`` read that reading misses would otherwise pair
Jacobians of two functions silently. Attribute writes on the proxy (``dit.training = True``,
``nn.Module.train(dit)`` called unbound) go to the DiT (issue 42), and ``run_trajectory`` refuses any
window of two states. A loss that makes no grad-enabled DiT call (an empty trajectory) has nothing to
rewrite: its first run is returned as its value.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .._compat import tree_flatten, tree_map, tree_unflatten
from ..errors import JaggCaptureError, JaggGraphError
from ..runtime.calls import DitCall
from ..runtime.checks import check_placement
from ..runtime.rollout_cache import RolloutCache
from ..runtime.grouping import cut_announcement, group_calls, leaf_difference
from ..runtime.module_state import CallState
from .contract import direct_forward_error, refuse_checkpoint_region
from ..runtime.routing import Routing
from ..runtime.trajectory import run_trajectory
from ..runtime.window import WindowOptions
from .intercept_effects import RecordingRun, refuse_writes_into_saved_inputs


class DitProxy:
    """Stands in for the DiT argument; every grad-mode call goes to ``on_call``."""

    def __init__(self, dit: nn.Module, on_call: Callable[[DitCall], Any]):
        object.__setattr__(self, "_dit", dit)
        object.__setattr__(self, "_on_call", on_call)

    def __call__(self, *args, **kwargs):
        # the windows run outside a checkpoint the loss wrote around the call (contract.py)
        refuse_checkpoint_region(self._dit)
        if not torch.is_grad_enabled():
            return self._dit(*args, **kwargs)  # reference calls run as written
        return self._on_call(DitCall(tuple(args), dict(kwargs)))

    def __getattr__(self, name):
        if name == "forward":
            step = getattr(self._on_call, "next_step", None)
            raise direct_forward_error(f"step {step()}" if step is not None else "", self._dit)
        return getattr(self._dit, name)

    # an attribute the loss writes is the DiT's: ``dit.training = True``, or ``nn.Module.train(dit)``
    # (which sets ``self.training`` on the object it is given, then recurses into the children),
    # would otherwise land on the proxy, the real module would stay in its state, and the calls
    # after it would be recorded (and run as windows) in the old state while the eager loss runs
    # them in the new one (issue 42)
    def __setattr__(self, name, value):
        setattr(self._dit, name, value)

    def __delattr__(self, name):
        delattr(self._dit, name)


def _grad_leaves(call: DitCall) -> list[str]:
    names = []
    flat = tree_flatten((call.args, call.kwargs))[0]
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            names.append(f"input {i}")
    return names


def _as_leaf(output: Any) -> Any:
    def mark(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            # a non-leaf that requires grad: the loss may write into the DiT's output in place
            # (``v.mul_(0.5)``), which autograd refuses on a leaf
            with torch.enable_grad():
                return x.detach().requires_grad_().clone()
        return x

    return tree_map(mark, output)


def _with_recorded_values(values: Any, outs: Any) -> Any:
    """A window's outputs for the replay: the values of the recording's plain DiT call, with the
    window's (JAGG) backward (``value + (out - out.detach())``). The window computes its knots as
    one batched forward, which a float32 DiT rounds differently from the recording's calls; with
    those values a state the loss computes from a DiT output would differ from the recorded
    input in the last bits, and the replay would refuse a deterministic loss. It is also a fresh
    tensor, so the loss may write into it in place (a window's own outputs are views)."""
    flat_values, spec = tree_flatten(values)
    flat_outs = tree_flatten(outs)[0]
    mixed = [v + (o - o.detach()) if isinstance(o, torch.Tensor) and o.requires_grad else v
             for v, o in zip(flat_values, flat_outs)]
    return tree_unflatten(mixed, spec)


def _same_inputs(a: DitCall, b: DitCall) -> bool:
    fa, sa = tree_flatten((a.args, a.kwargs))
    fb, sb = tree_flatten((b.args, b.kwargs))
    if sa != sb or len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and torch.equal(x.detach(), y.detach())):
                return False
        elif x != y:
            return False
    return True


class InterceptedLoss:
    """Runs ``fn`` with the DiT argument ``dit_arg`` replaced (module docstring)."""

    def __init__(self, fn: Callable, dit_arg: str, window: int, options: WindowOptions, exact: bool = False,
                 routing: Routing | None = None):
        self.fn, self.dit_arg, self.window, self.options, self.exact = fn, dit_arg, window, options, exact
        self.routing = routing
        self.decision = None
        self.windows: list[list[int]] = []
        self.notes: list[str] = []
        self.recorded: list[DitCall] = []
        self.states: list[CallState] = []
        self.values: list = []       # the recording's DiT outputs, handed back by the replay

    def __call__(self, dit: nn.Module, bound: inspect.BoundArguments):
        recorded, states, cache = self._record(dit, bound)
        if not recorded:
            # nothing to rewrite: the loss runs as written (once: the recording's writes were undone)
            self.windows, self.recorded, self.states, self.values = [], [], [], []
            self.notes = [f"no grad-enabled call of the DiT argument {self.dit_arg!r}: nothing to rewrite, the loss "
                          f"ran as written"]
            return self.fn(*bound.args, **bound.kwargs)
        grouping = group_calls(recorded, self.window, time_arg=self.options.time_arg, states=states)
        self.windows, self.notes = grouping.windows, grouping.notes()
        self._announce_cuts(grouping, recorded, states)
        self.recorded, self.states = recorded, states
        options = dataclasses.replace(self.options, rollout_cache=cache)
        routing = self.routing if self.routing is not None and self.routing.active and not self.exact else None
        if routing is not None and len(set(states)) > 1:
            raise JaggCaptureError(
                f"routing scores all windows together, but the loss's trained DiT calls run in "
                f"{len(set(states))} module or autocast states "
                f"({states[0].difference(next(s for s in states if s != states[0]))}); "
                f"use routing=jaggc.Routing() (jagg_frac=1, no threshold), or keep the trained calls in one state", path="intercept")
        outs, self.decision = run_trajectory(dit, recorded, self.windows, options=options, routing=routing,
                                             states=states, exact_windows=range(len(self.windows)) if self.exact else ())
        try:
            return self._replay(dit, bound, recorded, outs)
        finally:
            self.values = []         # the recording's outputs are not kept past the call

    def _announce_cuts(self, grouping, recorded: list[DitCall], states: list[CallState]) -> None:
        """A cut that makes more windows is a slower gradient: announced (grouping.cut_announcement)."""
        def differ(j: int, k: int) -> str:
            if states[j] != states[k]:
                return f"module or autocast state ({states[j].difference(states[k])})"
            return leaf_difference((recorded[j].args, recorded[j].kwargs), (recorded[k].args, recorded[k].kwargs),
                                   is_value=lambda x: isinstance(x, torch.Tensor))

        note = cut_announcement(grouping, self.window, differ, calls_named="steps")
        if note is not None:
            self.notes.append(note)
            warnings.warn(f"jaggc: {note}", stacklevel=4)

    def _run(self, bound: inspect.BoundArguments, proxy: DitProxy):
        swapped = inspect.BoundArguments(bound.signature, {**bound.arguments, self.dit_arg: proxy})
        return self.fn(*swapped.args, **swapped.kwargs)

    def _record(self, dit, bound):
        self.values = []
        recorded: list[DitCall] = []
        states: list[CallState] = []
        # strict: the recording is replayed within this one call, in each call's own module state
        cache = RolloutCache(dit, time_arg=self.options.time_arg, unbatched=self.options.unbatched, strict_state=True)

        def on_call(call: DitCall):
            depends = _grad_leaves(call)
            if depends:
                raise JaggGraphError(
                    f"step {len(recorded)}: DiT input(s) {', '.join(depends)} require grad: they were computed "
                    f"from an earlier DiT output (or another trained tensor) without .detach(). JAGG needs the "
                    f"DiT calls to be gradient-independent: feed stored (detached) states")
            if self.options.check_inputs:
                # before the recording forward runs the DiT on it: a 'meta' or wrong-dtype input
                # would otherwise fail inside the DiT with a bare torch error
                check_placement(dit, call, f"step {len(recorded)}")
            run.add_call(call)
            states.append(CallState.of(dit))
            with torch.no_grad(), run.dit_forward():
                out = dit(*call.args, **call.kwargs)
            self.values.append(out)
            return _as_leaf(out)

        on_call.next_step = lambda: len(recorded)      # named by refusals raised between calls
        # the recording's in-place writes and container changes are undone before the replay,
        # and each recorded call keeps the inputs it was called with (intercept_effects.py)
        run = RecordingRun(bound.arguments, dit, recorded)
        with cache.record(), run:
            self._run(bound, DitProxy(dit, on_call))
        refuse_writes_into_saved_inputs(dit, run, states)
        return recorded, states, cache

    def _replay(self, dit, bound, recorded, outs):
        position = [0]

        def on_call(call: DitCall):
            k = position[0]
            if k >= len(recorded) or not _same_inputs(call, recorded[k]):
                raise JaggCaptureError(
                    f"step {k}: the loss called the DiT with different inputs on its second run than on its "
                    f"first. The intercept fallback runs the loss twice and needs it to be deterministic "
                    f"(no sampling inside the loss); sample outside and pass the values in", path="intercept")
            state = CallState.of(dit)
            if state != self.states[k]:
                raise JaggCaptureError(
                    f"step {k}: the DiT is in another state on the loss's second run than on its first "
                    f"({self.states[k].difference(state)}); the intercept fallback runs the loss twice and "
                    f"needs the same module and autocast state at every call. Reset the state at the top of the "
                    f"loss (dit.train()) or outside it", path="intercept")
            position[0] += 1
            return _with_recorded_values(self.values[k], outs[k])

        result = self._run(bound, DitProxy(dit, on_call))
        if position[0] != len(recorded):
            raise JaggCaptureError(
                f"the loss made {position[0]} DiT calls on its second run and {len(recorded)} on its first; "
                f"the intercept fallback needs the same calls every run", path="intercept")
        return result
