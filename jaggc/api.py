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
from .backends import BACKENDS
from .backward_modes import backward_mode
from .config import CompileConfig
from .errors import JaggCaptureError, JaggInputError, JaggUnsupportedError
from .frontends import registry
from .options import KEYWORDS, DEPRECATED, Options, apply_deprecated
from .report import Report
from .report_build import refresh_times
from .runtime.engines import refuse_whole_loss_guard_on_zero, refuse_zero3
from .runtime.guard import Guard
from .runtime.routing import Routing
from .runtime.weights import DEFAULT_WEIGHTS, Basis
from .runtime.window import check_window_size
from .session import CompileSession


def _modules_of(args, kwargs, dit) -> list[nn.Module]:
    """The modules among a call's arguments and the session's ``dit=``, each once."""
    leaves = _compat.tree_flatten((args, kwargs))[0] + [dit]
    return list({id(m): m for m in leaves if isinstance(m, nn.Module)}.values())


class JaggCompiled:
    """A GRPO loss whose DiT calls run in JAGG windows. Call it like the original function.

    ``.report``: the inspection report of the graph that ran last (a ``jaggc.Report``);
    ``__wrapped__``: the undecorated loss. Read-only: ``traces`` (captures made so far),
    ``capture_failures`` (why ``capture="auto"`` left earlier paths) and ``config`` (the resolved
    settings: window, the windows' options, routing)."""

    def __init__(self, fn: Callable, *, dit: nn.Module | None = None, window: int = 4, weights=DEFAULT_WEIGHTS,
                 backward: str = "joint", capture: str = "auto", guard: Guard | None = None,
                 options: Options | None = None, routing: Routing | None = None, **deprecated):
        options, routing = apply_deprecated(options, routing, deprecated)
        if capture not in registry.capture_choices():
            raise JaggInputError(f"capture={capture!r}: use one of {registry.capture_choices()}")
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
        config = CompileConfig(window=window, options=options.window_options(weights, backward, guard),
                               routing=routing, split_batches=bool(options.split_batches),
                               check_passes=bool(options.check_passes))
        # what the frontends share lives in the session, not on the user's object (session.py)
        self._session = CompileSession(fn, dit=dit, config=config, backend=backend, qualname=self.__qualname__)
        self._capture = capture
        self._on_unsupported = options.on_unsupported
        self._guard = guard      # jaggc.Guard: probes some calls against the exact gradient (runtime/guard.py)
        self._path: str | None = None if capture == "auto" else capture
        self._warned_no_dit = False
        self._one_step_calls = 0         # consecutive calls with one trained DiT call (-1: not per-step)
        self._guard_engines_checked = False
        self._engines_checked = False    # the modules of the first call: an engine jaggc cannot serve refused
        self._per_step_warned = False

    @property
    def traces(self) -> int:
        """Captures made so far (FX traces, Dynamo graphs rewritten, intercept recordings)."""
        return self._session.traces

    @property
    def capture_failures(self) -> list[str]:
        """Why ``capture="auto"`` left earlier paths (also in ``report.capture_failures``)."""
        return list(self._session.capture_failures)

    @property
    def config(self) -> CompileConfig:
        """The resolved settings: window, the windows' options (weights, backward, ...), routing."""
        return self._session.config

    @property
    def report(self) -> Report | None:
        """The inspection report of the current compiled graph (timesteps from the latest run)."""
        report = self._session.report
        refresh_times(report)
        if self._guard is not None and report is not None:
            report.guard = self._guard.summary()
        return report

    # --- entry --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._guard is not None:
            if not self._guard_engines_checked:
                # before the guard snapshots .grad: under ZeRO it would read nothing (engines.py)
                for module in _modules_of(args, kwargs, self._session.dit):
                    refuse_whole_loss_guard_on_zero(module)
                self._guard_engines_checked = True
            return self._guard.call(self._call, self.__wrapped__, args, kwargs, dit=self._session.dit)
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        if self._path == "uncompiled" or not torch.is_grad_enabled():
            # under torch.no_grad() / inference_mode() (a validation loss, a logged value) there is
            # no backward to make cheaper: the undecorated loss is the value, at its own cost
            return self.__wrapped__(*args, **kwargs)
        if not self._engines_checked:
            try:
                self._check_engines(args, kwargs)
            except JaggUnsupportedError as e:
                return self._unsupported(e, args, kwargs)
            self._engines_checked = True
        if self._capture != "auto":
            order = [self._capture]
        elif self._session.backend is not None:
            order = ["dynamo"]
        else:
            auto = registry.auto_order()
            order = list(auto[auto.index(self._path) if self._path else 0:])
        failed = self._session.failed_now = []     # a later path's refusal may name why these were left
        for path in order:
            try:
                out = self._run(path, args, kwargs)
            except JaggCaptureError as e:
                if len(order) == 1:
                    return self._unsupported(e, args, kwargs)
                failed.append(f"{path}: {e}")
                self._session.frontends[path].reset()
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

    def _check_engines(self, args, kwargs) -> None:
        """Refuse, at the first call, a DiT under an engine jaggc cannot serve (runtime/engines.py:
        DeepSpeed ZeRO-3), before any capture touches its partitioned parameters."""
        for module in _modules_of(args, kwargs, self._session.dit):
            refuse_zero3(module, "jagg_compile")

    def _announce_fallback(self, path: str, failed: list[str]) -> None:
        """``capture="auto"`` took a slower path: say which, why, and what it costs."""
        session = self._session
        session.capture_failures.extend(failed)
        if session.report is not None:
            session.report.capture_failures = list(session.capture_failures)
        cost = registry.FRONTENDS[path].fallback_cost
        warnings.warn(
            f"jaggc: {self.__qualname__} runs through capture path {path!r}{f' ({cost})' if cost else ''} "
            f"because earlier paths could not capture it:\n  " + "\n  ".join(failed)
            + "\n(report.capture_failures lists these; pass capture=... to choose a path)", stacklevel=3)

    def _check_trains_the_dit(self, out) -> None:
        """A loss without a DiT call is fine when it has nothing to train (an empty trajectory); one
        whose value still requires grad trains something jaggc did not see, so it runs without JAGG:
        never silently, the DiT may be called where jaggc does not watch (a closed-over module)."""
        report = self._session.report
        if report is None or report.trained_calls or self._warned_no_dit:
            return
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in _compat.tree_flatten(out)[0]):
            self._warned_no_dit = True
            watched = ", ".join(self._session.watched) or "none"
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
        report = self._session.report
        if self._per_step_warned or report is None:
            return
        if report.trained_calls != 1:
            self._one_step_calls = -1            # a call with several trained steps: not per-step
            return
        if self._one_step_calls < 0:
            return
        self._one_step_calls += 1
        if self._one_step_calls < 2:
            return
        self._per_step_warned = True
        code = getattr(self.__wrapped__, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        warnings.warn(
            f"jaggc: {self.__qualname__}{where} makes one trained DiT call per call, so no JAGG window can form and "
            f"every call runs exactly, at the undecorated cost: it looks like a trainer's per-step function, called once "
            f"per timestep with backward() after each. Leave it undecorated and let the loop's own per-step backward "
            f"run JAGG: jaggc.stepwise(transformer, window=4) once, then `for j in jaggc.stepwise(transformer)"
            f".steps(train_timesteps, timesteps_of_those_steps):` (docs/trainers.md)", stacklevel=4)

    def _unsupported(self, err: JaggUnsupportedError, args, kwargs):
        if self._on_unsupported == "raise":
            raise err
        warnings.warn(f"jaggc: running {self.__qualname__} uncompiled (exact per-step gradient): {err}",
                      stacklevel=3)
        self._path = "uncompiled"
        self._session.report = Report(path="uncompiled", notes=[str(err)])
        return self.__wrapped__(*args, **kwargs)

    def _run(self, path, args, kwargs):
        return self._session.frontends[path].run(args, kwargs)


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
