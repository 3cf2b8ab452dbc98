"""``@jagg_compile`` and ``explain``: capture a GRPO loss, rewrite its DiT windows, run it.

The compiled loss returns the same value as the undecorated function; its backward runs one
joint DiT backward per window instead of one per step. ``.report`` shows what was rewritten.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
from torch import nn

from . import _compat
from .backends import BACKENDS, compile_glue
from .backward_modes import backward_mode
from .config import CompileConfig
from .errors import JaggCaptureError, JaggInputError, JaggUnsupportedError
from .frontends.contract import Captured, Frontend, bind_loss
from .frontends.dynamo_runner import DynamoFrontend
from .frontends.fx_runner import FxFrontend
from .frontends.intercept import InterceptedLoss
from .frontends.intercept_runner import InterceptFrontend
from .report import Report
from .report_build import build_report, intercept_report, refresh_times
from .runtime.guard import Guard
from .runtime.routing import Routing
from .runtime.weights import DEFAULT_WEIGHTS, Basis
from .runtime.window import check_window_size
from .options import CAPTURES, KEYWORDS, DEPRECATED, Options, apply_deprecated
from .passes import PassContext, run_passes    # passes/, installed as jaggc.passes


# capture="auto" tries these in order. FX first: its first call on a 50-step Flow-GRPO loss is
# about 5x cheaper than Dynamo's, and it takes the trainers' schedule reads, no_grad reference
# blocks, autocast blocks, train()/eval() and adapter toggles, several of which Dynamo breaks the
# graph on; Dynamo takes Function.apply; intercept runs anything the DiT is an argument of, at one
# more forward per step.
AUTO_ORDER = ("fx", "dynamo", "intercept")
_FALLBACK_COST = {
    "dynamo": "a first call about 5x slower than FX's (Dynamo tracing); later calls as fast",
    "intercept": "one more DiT forward per trained step and the loss's Python run twice per call, "
                 "(W+6)F per window instead of (W+4)F",
}



class JaggCompiled:
    """A GRPO loss whose DiT calls run in JAGG windows. Call it like the original function."""

    def __init__(self, fn: Callable, *, dit: nn.Module | None = None, window: int = 4, weights=DEFAULT_WEIGHTS,
                 backward: str = "joint", capture: str = "auto", guard: Guard | None = None,
                 options: Options | None = None, routing: Routing | None = None, **deprecated):
        options, routing = apply_deprecated(options, routing, deprecated)
        if capture not in CAPTURES:
            raise JaggInputError(f"capture={capture!r}: use one of {CAPTURES}")
        backend = options.backend
        if backend is not None and backend not in BACKENDS:
            raise JaggInputError(f"Options(backend={backend!r}): use None (run the rewritten graph eagerly) or one "
                                 f"of {BACKENDS}")
        if backend is not None and capture not in ("auto", "dynamo"):
            raise JaggUnsupportedError(
                f"Options(backend={backend!r}) compiles the glue of a Dynamo-captured graph; capture={capture!r} "
                f"has no such graph. Use capture='dynamo' (or 'auto'), or backend=None")
        check_window_size(window)
        backward = backward_mode(backward)     # "joint" or BackwardMode.JOINT: the symbol from here on
        routing.check_backward(backward)
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.dit = dit
        self.capture = capture
        self.backend = backend
        self.on_unsupported = options.on_unsupported
        self.options = options
        self.guard = guard      # jaggc.Guard: probes some calls against the exact gradient (runtime/guard.py)
        self.config = CompileConfig(window=window, options=options.window_options(weights, backward, guard),
                                    routing=routing, split_batches=bool(options.split_batches),
                                    check_passes=bool(options.check_passes))
        self._report: Report | None = None
        self.traces = 0
        self._path: str | None = None if capture == "auto" else capture
        self.capture_failures: list[str] = []   # why earlier paths of capture="auto" were left
        self._warned_no_dit = False
        self._one_step_calls = 0         # consecutive calls with one trained DiT call (-1: not per-step)
        self._per_step_warned = False
        self.frontends: dict[str, Frontend] = {
            "fx": FxFrontend(self, self.__qualname__),
            "dynamo": DynamoFrontend(self, self.__qualname__),
            "intercept": InterceptFrontend(self, self.__qualname__),
        }

    @property
    def report(self) -> Report | None:
        """The inspection report of the current compiled graph (timesteps from the latest run)."""
        refresh_times(self._report)
        if self.guard is not None and self._report is not None:
            self._report.guard = self.guard.summary()
        return self._report

    # --- entry --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.guard is not None:
            return self.guard.call(self._call, self.fn, args, kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        if self._path == "uncompiled" or not torch.is_grad_enabled():
            # under torch.no_grad() / inference_mode() (a validation loss, a logged value) there is
            # no backward to make cheaper: the undecorated loss is the value, at its own cost
            return self.fn(*args, **kwargs)
        if self.capture != "auto":
            order = [self.capture]
        elif self.backend is not None:
            order = ["dynamo"]
        else:
            order = list(AUTO_ORDER[AUTO_ORDER.index(self._path) if self._path else 0:])
        failed = []
        for path in order:
            try:
                out = self._run(path, args, kwargs)
            except JaggCaptureError as e:
                if len(order) == 1:
                    return self._unsupported(e, args, kwargs)
                failed.append(f"{path}: {e}")
                self.frontends[path].reset()
                continue
            except JaggUnsupportedError as e:
                return self._unsupported(e, args, kwargs)
            if failed:
                self._announce_fallback(path, failed)
            self._path = path
            self._check_trains_the_dit(out)
            self._check_not_per_step()
            return out
        return self._unsupported(JaggCaptureError(
            "no capture path could take the loss:\n  " + "\n  ".join(failed)), args, kwargs)

    def _announce_fallback(self, path: str, failed: list[str]) -> None:
        """``capture="auto"`` took a slower path: say which, why, and what it costs."""
        self.capture_failures.extend(failed)
        if self._report is not None:
            self._report.capture_failures = list(self.capture_failures)
        warnings.warn(
            f"jaggc: {self.__qualname__} runs through capture path {path!r} ({_FALLBACK_COST.get(path, '')}) "
            f"because earlier paths could not capture it:\n  " + "\n  ".join(failed)
            + "\n(report.capture_failures lists these; pass capture=... to choose a path)", stacklevel=3)

    def _check_trains_the_dit(self, out) -> None:
        """A loss without a DiT call is fine when it has nothing to train (an empty trajectory); one
        whose value still requires grad trains something jaggc did not see, so it runs without JAGG:
        never silently, the DiT may be called where jaggc does not watch (a closed-over module)."""
        if self._report is None or self._report.trained_calls or self._warned_no_dit:
            return
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in _compat.tree_flatten(out)[0]):
            self._warned_no_dit = True
            watched = ", ".join(getattr(self, "_watched", [])) or "none"
            warnings.warn(
                f"jaggc: {self.__qualname__} makes no grad-enabled call of the module(s) jaggc watched ({watched}), "
                f"but its value requires grad: it trains something else and runs as written, without JAGG. If the "
                f"DiT is called inside, pass it as an argument of the loss or with jagg_compile(dit=model)",
                stacklevel=3)

    def _check_not_per_step(self) -> None:
        """Never silently slow: a loss whose every call makes ONE trained DiT call is a trainer's
        per-step function (its loop calls backward after each step): no window can form, so each
        call runs exactly, at the undecorated cost. Said once, from the second such call on (a
        trajectory's one-step tail, as MixGRPO's window ends, is a single call among longer ones)."""
        if self._per_step_warned or self._report is None:
            return
        if self._report.trained_calls != 1:
            self._one_step_calls = -1            # a call with several trained steps: not per-step
            return
        if self._one_step_calls < 0:
            return
        self._one_step_calls += 1
        if self._one_step_calls < 2:
            return
        self._per_step_warned = True
        code = getattr(self.fn, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        warnings.warn(
            f"jaggc: {self.__qualname__}{where} makes one trained DiT call per call, so no JAGG window can form and "
            f"every call runs exactly, at the undecorated cost: it looks like a trainer's per-step function, called once "
            f"per timestep with backward() after each. Leave it undecorated and let the loop's own per-step backward "
            f"run JAGG: jaggc.stepwise(transformer, window=4) once, then `for j in jaggc.stepwise(transformer)"
            f".steps(train_timesteps, timesteps_of_those_steps):` (docs/trainers.md)", stacklevel=4)

    def _unsupported(self, err: JaggUnsupportedError, args, kwargs):
        if self.on_unsupported == "raise":
            raise err
        warnings.warn(f"jaggc: running {self.__qualname__} uncompiled (exact per-step gradient): {err}",
                      stacklevel=3)
        self._path = "uncompiled"
        self._report = Report(path="uncompiled", notes=[str(err)])
        return self.fn(*args, **kwargs)

    def _run(self, path, args, kwargs):
        return self.frontends[path].run(args, kwargs)

    def candidates(self, args, kwargs) -> list[nn.Module]:
        """The modules the frontends keep opaque: ``dit=``, else every module argument."""
        if self.dit is not None:
            self._watched = [f"{type(self.dit).__name__} (jagg_compile(dit=...))"]
            return [self.dit]
        found = []
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, nn.Module):
                found.append(v)
        try:
            names = {id(v): k for k, v in bind_loss(self.fn, args, kwargs).arguments.items()}
        except TypeError:
            names = {}
        self._watched = [f"{type(m).__name__} (argument {names.get(id(m), '?')!r})" for m in found]
        if not found:
            raise JaggUnsupportedError(
                f"{self.__qualname__} takes no nn.Module argument, so jaggc cannot tell which module is "
                f"the DiT; pass it: jagg_compile(fn, dit=model)")
        return found

    # --- what the frontends need (frontends/contract.Session) -----------------------------------
    def show(self, report: Report) -> None:
        self._report = report

    def empty_report(self, path: str, note: str) -> Report:
        return Report(path=path, traces=self.traces, notes=[note])

    def intercept_report(self, loss: InterceptedLoss) -> Report:
        self.traces += 1
        return intercept_report(loss, self.config, self.traces)

    def rewrite(self, captured: Captured, frontend: str):
        """The passes over a capture, and its report; a Dynamo graph's glue compiled by
        ``Options(backend=...)``."""
        ctx = PassContext(config=self.config, dit=self.dit, frontend=frontend,
                                 watched=list(getattr(self, "_watched", [])), entry_grad=captured.entry_grad,
                                 entry_autocast=captured.entry_autocast)
        gm, stages = run_passes(captured.gm, ctx)
        self.traces += 1
        report = self._report = build_report(frontend, gm, stages, ctx, self.traces)
        report.capture_failures = list(self.capture_failures)
        if frontend == "dynamo" and self.backend is not None:
            gm = self._dynamo_split = compile_glue(gm, self.backend)
            report.notes.append(f"backend={self.backend!r}: {gm.jaggc_segments['glue']} glue segment(s) compiled, "
                                f"{gm.jaggc_segments['runtime']} runtime segment(s) eager")
        return gm, self.report


def jagg_compile(fn: Callable | None = None, *, dit: nn.Module | None = None, window: int = 4,
                 weights=DEFAULT_WEIGHTS, backward: str = "joint", capture: str = "auto", guard: Guard | None = None,
                 options: Options | None = None, routing: Routing | None = None, **deprecated) -> Any:
    """Decorate a GRPO loss so its DiT calls run as JAGG windows of ``window`` steps.

    ``dit``: the module that is the DiT (default: the loss's one ``nn.Module`` argument).
    ``weights``: how interior steps' Jacobians are interpolated ("t", "index" or a ``Basis``;
    default plain JAGG with σ-aware placement). ``backward``: "joint" (one joint backward per
    window in the loss's backward), "per_window" (one window's activations at a time, two more
    forwards per window) or "lowmem" (each window's backward inside the forward; sums of per-step
    terms). ``capture``: "auto" (FX, then Dynamo, then intercept, announcing each fallback), or one
    of them. ``guard``: a ``jaggc.Guard`` that measures JAGG against the exact gradient on one call
    in ``every`` (docs/guard.md). ``options``: ``jaggc.Options`` (time argument, chunking, rollout cache, CFG split,
    glue backend, what to do when nothing can capture). ``routing``: ``jaggc.Routing`` (which
    windows run exactly, chosen at run time). Release-0.1 keywords warn and still work."""
    settings = dict(dit=dit, window=window, weights=weights, backward=backward, capture=capture, guard=guard,
                    options=options, routing=routing, **deprecated)
    if fn is None:
        return lambda f: JaggCompiled(f, **settings)
    return JaggCompiled(fn, **settings)


def explain(fn: Callable, *args, **kwargs) -> Report:
    """Compile ``fn`` with the ``jagg_compile`` settings in ``kwargs`` (its keywords, ``options=``
    and ``routing=``), run its forward once on ``args`` (no backward), and return the inspection
    report. ``fn`` may also be a loss already compiled (``@jagg_compile``): it runs with its own
    settings."""
    settings = {k: kwargs.pop(k) for k in list(kwargs) if k in KEYWORDS or k in DEPRECATED}
    if isinstance(fn, JaggCompiled) and settings:
        raise JaggInputError(f"explain: {fn.__name__} is already compiled with its own settings; "
                             f"drop {sorted(settings)} or pass the undecorated loss (its __wrapped__)")
    compiled = fn if isinstance(fn, JaggCompiled) else JaggCompiled(fn, **settings)
    compiled(*args, **kwargs)
    return compiled.report
