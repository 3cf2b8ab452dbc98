"""``@jagg_compile`` and ``explain``: capture a GRPO loss, rewrite its DiT windows, run it.

The compiled loss returns the same value as the undecorated function; its backward runs one
joint DiT backward per window instead of one per step. ``.report`` shows what was rewritten.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn

from . import _compat
from .backends import BACKENDS, compile_glue
from .errors import JaggCaptureError, JaggInputError, JaggUnsupportedError
from .frontends.aliasing import storage_groups
from .frontends.dynamo import STATE_CHANGE_MARK, opaque_modules
from .frontends.dynamo_backend import copy_graph_module, running_loss, shared_backend
from .frontends.fake_boundary import check_real_grads_after_backward, check_real_output
from .frontends.fx import capture_fx
from .frontends.fx_cache import FxEntry, FxGraphCache
from .frontends.fx_guards import constant_reads, is_constant, object_fingerprint
from .frontends.intercept import InterceptedLoss
from .report import Report
from .report_build import build_report, intercept_report, refresh_times
from .runtime.autocast import AUTOCAST_OFF, AutocastState, current_autocast, reset_graph_autocast
from .runtime.module_state import module_state
from .runtime.routing import Routing
from .runtime.weights import Basis
from .runtime.window import WindowOptions, check_window_size

#: jagg_compile's default weights: plain JAGG (t-weights) with σ-aware placement, windows reaching
#: σ < 0.5 run exactly; the cheapest candidate whose bias stayed within 1.5x its noise floor (with
#: a margin) and whose cosine beat subsampling in every cell of the bias study (README, Fidelity;
#: docs/bias_study.md). weights="t" is the paper's plain JAGG.
DEFAULT_WEIGHTS = Basis("linear", "t", exact_below=0.5)

_CAPTURES = ("auto", "dynamo", "fx", "intercept")
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


def _passes():
    # jaggc.passes is a separate source folder (passes/); import lazily to keep import order simple
    from jaggc import passes

    return passes


class JaggCompiled:
    """A GRPO loss whose DiT calls run in JAGG windows. Call it like the original function."""

    def __init__(self, fn: Callable, *, dit: nn.Module | None = None, window: int = 4, weights=DEFAULT_WEIGHTS,
                 jagg_frac: float = 1.0, time_arg: str | int | None = None, capture: str = "auto",
                 backend: str | None = None, on_unsupported: str = "raise", interior_chunk: int | None = None,
                 batch_knots: bool = True, check_inputs: bool = True, backward: str = "joint",
                 rollout_cache=None, jagg_threshold: float | None = None, exact_below_t: float | None = None,
                 split_batches: bool = True, guard=None):
        if capture not in _CAPTURES:
            raise JaggInputError(f"capture={capture!r}: use one of {_CAPTURES}")
        if on_unsupported not in ("raise", "exact"):
            raise JaggInputError(f"on_unsupported={on_unsupported!r}: use 'raise' or 'exact'")
        if backend is not None and backend not in BACKENDS:
            raise JaggInputError(f"backend={backend!r}: use None (run the rewritten graph eagerly) or one of {BACKENDS}")
        if backend is not None and capture not in ("auto", "dynamo"):
            raise JaggUnsupportedError(
                f"backend={backend!r} compiles the glue of a Dynamo-captured graph; capture={capture!r} "
                f"has no such graph. Use capture='dynamo' (or 'auto'), or backend=None")
        check_window_size(window)
        routing = Routing(jagg_frac=float(jagg_frac), threshold=jagg_threshold, exact_below_t=exact_below_t)
        routing.check_backward(backward)
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.dit = dit
        self.capture = capture
        self.backend = backend
        self.on_unsupported = on_unsupported
        options = WindowOptions(weights=weights, time_arg=time_arg, interior_chunk=interior_chunk,
                                batch_knots=batch_knots, check_inputs=check_inputs, backward=backward,
                                rollout_cache=rollout_cache, guard=guard)
        self.guard = guard      # jaggc.Guard: probes some calls against the exact gradient (runtime/guard.py)
        self.config = _passes().CompileConfig(window=window, weights=weights, jagg_frac=float(jagg_frac),
                                              time_arg=time_arg, options=options, routing=routing,
                                              split_batches=bool(split_batches))
        self._report: Report | None = None
        self.traces = 0
        self._path: str | None = None if capture == "auto" else capture
        self._dynamo_fn = None
        self._dynamo_graphs: dict[int, tuple] = {}
        self._fx_cache = FxGraphCache(self.__qualname__)
        self._fx_reads = None
        self.capture_failures: list[str] = []   # why earlier paths of capture="auto" were left
        self._warned_no_dit = False

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
                self._reset_dynamo()
                continue
            except JaggUnsupportedError as e:
                return self._unsupported(e, args, kwargs)
            if failed:
                self._announce_fallback(path, failed)
            self._path = path
            self._check_trains_the_dit(out)
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

    def _unsupported(self, err: JaggUnsupportedError, args, kwargs):
        if self.on_unsupported == "raise":
            raise err
        warnings.warn(f"jaggc: running {self.__qualname__} uncompiled (exact per-step gradient): {err}",
                      stacklevel=3)
        self._path = "uncompiled"
        self._report = Report(path="uncompiled", notes=[str(err)])
        return self.fn(*args, **kwargs)

    def _run(self, path, args, kwargs):
        if path == "intercept":
            return self._run_intercept(args, kwargs)
        return self._run_dynamo(args, kwargs) if path == "dynamo" else self._run_fx(args, kwargs)

    def _candidates(self, args, kwargs) -> list[nn.Module]:
        if self.dit is not None:
            self._watched = [f"{type(self.dit).__name__} (jagg_compile(dit=...))"]
            return [self.dit]
        found = []
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, nn.Module):
                found.append(v)
        try:
            names = {id(v): k for k, v in inspect.signature(self.fn).bind(*args, **kwargs).arguments.items()}
        except TypeError:
            names = {}
        self._watched = [f"{type(m).__name__} (argument {names.get(id(m), '?')!r})" for m in found]
        if not found:
            raise JaggUnsupportedError(
                f"{self.__qualname__} takes no nn.Module argument, so jaggc cannot tell which module is "
                f"the DiT; pass it: jagg_compile(fn, dit=model)")
        return found

    # --- dynamo -------------------------------------------------------------------------------
    def _reset_dynamo(self):
        self._dynamo_fn = None

    def _run_dynamo(self, args, kwargs):
        candidates = self._candidates(args, kwargs)
        modules = tuple(id(m) for m in candidates)
        if self._dynamo_fn is not None and modules != self._dynamo_modules:
            # Dynamo's cached graph holds the module it traced; another module (same class) must
            # not silently reuse it (it would compute the first module's loss and gradient)
            self._reset_dynamo()
        self._dynamo_modules = modules
        if self._dynamo_fn is None:
            # one backend object per module set, shared by every compiled loss: Dynamo's cache
            # entries only match their own backend, and a backend per jagg_compile made each compiled
            # loss of one function a recompile of its code (dynamo_backend.py)
            self._dynamo_fn = torch.compile(self.fn, backend=shared_backend(candidates), fullgraph=True,
                                            dynamic=False)
        try:
            self._graph_ran = False
            self._dynamo_entry_autocast = current_autocast()   # the backend's graph is entered in it
            traces = self.traces
            with opaque_modules(candidates), running_loss(self):
                out = self._dynamo_fn(*args, **kwargs)
            if not self._graph_ran:
                # Dynamo built no graph for these inputs (an empty trajectory: no DiT call, no tensor
                # op): the loss is a Python constant of its inputs, and it is what Dynamo returned
                self._report = Report(path="dynamo", traces=self.traces, notes=[
                    "no graph: the loss made no tensor op on these inputs (no DiT call); it ran as written"])
                return out
            check_real_output(out, self.__qualname__)
            if self.traces != traces:
                check_real_grads_after_backward(out, [p for m in candidates for p in m.parameters()],
                                                self.__qualname__)
            return out
        except _compat.backend_failed_type() as e:
            raise _compat.unwrap_backend_error(e) from None
        except _compat.dynamo_unsupported_types() as e:
            user_error = self._user_exception(e, candidates, args, kwargs)
            if user_error is not None:
                raise user_error from e
            where = _compat.dynamo_user_location(e)
            if STATE_CHANGE_MARK in str(e):
                raise JaggCaptureError(
                    f"{where + ': ' if where else ''}{self.__qualname__} changes the DiT's state (train/eval, "
                    f"adapters, requires_grad or hooks); Dynamo would replay the change after its graph, so every "
                    f"DiT call in the graph would run in the state the loss was entered in. The FX capture "
                    f"replays such changes (capture='fx')", path="dynamo", where=where) from e
            raise JaggCaptureError(
                f"{where + ': ' if where else ''}Dynamo could not capture {self.__qualname__} in one graph "
                f"(a graph break would hide DiT calls from the rewrite). Move data-dependent Python "
                f"(`.item()`, `if` on a tensor, print) out of the loss or compute it with tensor ops "
                f"(torch.where), or pass on_unsupported='exact' to run it uncompiled. "
                f"Dynamo says: {_first_lines(e)}", path="dynamo", where=where) from e
        except _compat.recompile_limit_types() as e:
            guard = _compat.recompile_reason(e)
            changing = f"`{guard.split('==')[0].strip()}` (last failed guard: {guard})" if guard else "a guarded input"
            raise JaggCaptureError(
                f"Dynamo's recompile limit for {self.__qualname__} was hit: each new value of "
                f"{changing} compiled another graph of its code. "
                f"{_RECOMPILE_FIX} Dynamo says: {_first_lines(e, 3)}", path="dynamo") from e

    def _user_exception(self, err: BaseException, candidates, args, kwargs) -> JaggInputError | None:
        """Dynamo reports an exception raised by the user's own code (a ZeroDivisionError when a
        loss divides by an empty trajectory's step count) as an 'Observed exception' graph break,
        which reads like a jaggc limitation. Run the loss eagerly (no grad, nothing accumulated)
        to surface the user's exception, counting DiT calls; None if it does not raise."""
        if "observed exception" not in str(err).lower():
            return None
        calls = [0]

        def count(*_):
            calls[0] += 1

        handles = [m.register_forward_pre_hook(count) for m in candidates]
        try:
            with torch.no_grad():
                self.fn(*args, **kwargs)
        except Exception as raised:  # noqa: BLE001 - the user's own error, re-raised with context
            empty = (" It made no DiT call: an empty trajectory (no trained step) has nothing to train; "
                     "check the step count of the batch." if calls[0] == 0 else "")
            return JaggInputError(f"{self.__qualname__} itself raises {type(raised).__name__}: {raised} "
                                  f"(run uncompiled on these inputs).{empty}")
        finally:
            for h in handles:
                h.remove()
        return None

    def _dynamo_graph(self, pristine: fx.GraphModule, own: fx.GraphModule | None = None):
        """This loss's rewrite of a graph Dynamo captured and cached, possibly for another compiled
        loss of the same function (dynamo_backend.py): made once per captured graph, from ``own``
        (the capture itself, when this loss compiled it) or a copy of ``pristine``."""
        known = self._dynamo_graphs.get(id(pristine))
        if known is None:
            gm = own if own is not None else copy_graph_module(pristine)
            known = self._dynamo_graphs[id(pristine)] = (pristine, self._dynamo_backend(gm))
        return known[1]

    def _dynamo_backend(self, gm: fx.GraphModule):
        traced_aliasing = _input_aliasing(gm)
        # Dynamo guards the autocast state: a cached graph only runs in the state it was captured in
        gm, report = self._rewrite(gm, "dynamo", entry_autocast=self._dynamo_entry_autocast)
        if self.backend is not None:
            gm = self._dynamo_split = compile_glue(gm, self.backend)
            report.notes.append(f"backend={self.backend!r}: {gm.jaggc_segments['glue']} glue segment(s) compiled, "
                                f"{gm.jaggc_segments['runtime']} runtime segment(s) eager")
        forward = gm.forward

        def run_graph(*args):
            if traced_aliasing is not None and storage_groups(args) != traced_aliasing:
                raise JaggCaptureError(
                    f"{self.__qualname__} writes in place into its inputs, and this call's inputs share storage "
                    f"differently from the call Dynamo traced; the graph's order of those writes would not hold. "
                    f"Pass the inputs as they were (or copies), or use capture='fx' (it traces each aliasing)",
                    path="dynamo")
            # Dynamo keeps one compiled graph per guard set; .report follows the one that runs
            self._report = report
            self._graph_ran = True
            try:
                return forward(*args)
            finally:
                reset_graph_autocast()   # a refusal raised inside an autocast switch of the graph

        return run_graph

    # --- fx -----------------------------------------------------------------------------------
    def _run_fx(self, args, kwargs):
        if self._fx_reads is None:
            self._fx_reads = constant_reads(self.fn)
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()          # the trace bakes defaults in as well
        candidates = self._candidates(args, kwargs)
        # the trace baked in the constants it read and the modules' states: a change selects (or
        # makes) another graph; values it read from tensors are checked by the entries' guards
        # the graph's mode switches are absolute, from the modes it was traced in: another caller
        # autocast state (a whole-loss autocast) is another graph
        key = (_structure_key(bound.arguments), tuple(read.value() for read in self._fx_reads),
               torch.is_grad_enabled(), current_autocast(), tuple(module_state(m, hooks=False) for m in candidates))
        values = tuple(bound.arguments.values())
        entry = self._fx_cache.lookup(key, values)
        new = entry is None
        if new:
            capture = capture_fx(self.fn, args, kwargs, candidates)
            gm, report = self._rewrite(capture.gm, "fx", entry_grad=capture.entry_grad,
                                       entry_autocast=capture.entry_autocast)
            report.guarded_reads = len(capture.guard) if capture.guard is not None else 0
            entry = FxEntry(gm, report, capture.guard,
                            aliasing=storage_groups(values) if _passes().input_writes(gm) else None)
            changed = self._fx_cache.add(key, entry, values)
            if changed:
                report.notes.append("re-traced: values read as Python numbers changed: " + "; ".join(changed[:3]))
        self._report = entry.report
        grad = torch.is_grad_enabled()
        try:
            out = entry.gm(*values)
        finally:
            # the graph switches grad mode and autocast around no-grad and autocast blocks; a refusal
            # raised inside one must not leave the caller in it
            torch.set_grad_enabled(grad)
            reset_graph_autocast()
        check_real_output(out, self.__qualname__)
        if new:
            check_real_grads_after_backward(out, [p for m in candidates for p in m.parameters()], self.__qualname__)
        return out

    # --- intercept (no tracing) -----------------------------------------------------------------
    def _run_intercept(self, args, kwargs):
        if self.config.options.backward == "lowmem":
            raise JaggUnsupportedError(
                f"backward='lowmem' needs a captured graph (it proves the loss is a sum of per-step terms), "
                f"but no capture path took {self.__qualname__}: {'; '.join(self.capture_failures) or 'see above'}. "
                f"Use backward='joint' or 'per_window'")
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        candidates = self._candidates(args, kwargs)
        dit = self.dit if self.dit is not None else candidates[0] if len(candidates) == 1 else None
        names = [k for k, v in bound.arguments.items() if dit is not None and v is dit]
        if not names:
            raise JaggCaptureError(
                f"the intercept fallback swaps the DiT argument of {self.__qualname__} for a recording proxy, "
                f"so the DiT must be exactly one argument of the loss (pass it as an argument; with several "
                f"module arguments also pass jagg_compile(dit=model))")
        cfg = self.config
        loss = InterceptedLoss(self.fn, names[0], cfg.window, cfg.options,
                               exact=cfg.jagg_frac == 0.0 and not cfg.routing.active, routing=cfg.routing)
        out = loss(dit, bound)
        self.traces += 1
        self._report = intercept_report(loss, cfg, self.traces)
        return out

    # --- shared ---------------------------------------------------------------------------------
    def _rewrite(self, gm: fx.GraphModule, frontend: str, entry_grad: bool = True,
                 entry_autocast: AutocastState = AUTOCAST_OFF):
        passes = _passes()
        ctx = passes.PassContext(config=self.config, dit=self.dit, frontend=frontend,
                                 watched=list(getattr(self, "_watched", [])), entry_grad=entry_grad,
                                 entry_autocast=entry_autocast)
        gm, stages = passes.run_passes(gm, ctx)
        self.traces += 1
        self._report = build_report(frontend, gm, stages, ctx, self.traces)
        self._report.capture_failures = list(self.capture_failures)
        return gm, self.report


def _input_aliasing(gm: fx.GraphModule) -> tuple | None:
    """Which of a Dynamo graph's inputs share storage, if the graph writes into its inputs (the
    effects analysis assumed that sharing; aliasing.py), else None."""
    if not _passes().input_writes(gm):
        return None
    return storage_groups([n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"])


def _structure_key(arguments: dict):
    """What the FX trace depends on in the (bound) arguments: tensor metadata, module identity
    and parameter dtypes/devices, constants by value, objects by everything they hold."""
    parts = []
    for name, value in arguments.items():
        leaves, spec = _compat.tree_flatten(value)
        parts.append((name, str(spec)))
        for x in leaves:
            if isinstance(x, torch.Tensor):
                parts.append(("T", tuple(x.shape), x.dtype, x.device.type, x.requires_grad))
            elif isinstance(x, nn.Module):
                # the FX trace answered the loss's dtype/device questions about the DiT's output (and
                # `next(dit.parameters()).dtype`) for these parameters: model.half() must retrace
                parts.append(("M", id(x), tuple(sorted({(str(p.dtype), str(p.device)) for p in x.parameters()}))))
            elif is_constant(x):
                parts.append(("C", type(x).__name__, x))
            else:
                parts.append(("O", object_fingerprint(x, name)))
    return tuple(parts)


_RECOMPILE_FIX = (
    "If that value changes on purpose (a new subset of trained steps per sample, as in DanceGRPO), use "
    "capture='fx' (one graph per value, in a bounded cache) or pass it as a tensor the loss only indexes "
    "with; a new step count or input shape also recompiles. Otherwise reuse one compiled loss or call "
    "torch.compiler.reset().")


def _first_lines(e: BaseException, n: int = 12) -> str:
    return "\n".join(str(e).strip().splitlines()[:n])


def jagg_compile(fn: Callable | None = None, **options) -> Any:
    """Decorate a GRPO loss so its DiT calls run as JAGG windows (see README for the options)."""
    if fn is None:
        return lambda f: JaggCompiled(f, **options)
    return JaggCompiled(fn, **options)


def explain(fn: Callable, *args, **kwargs) -> Report:
    """Compile ``fn`` with the jagg_compile options in ``kwargs``, run its forward once on
    ``args`` (no backward), and return the inspection report. ``fn`` may also be a loss already
    compiled (``@jagg_compile``): it runs with its own options."""
    option_names = ("dit", "window", "weights", "jagg_frac", "time_arg", "capture", "backend",
                    "on_unsupported", "interior_chunk", "batch_knots", "check_inputs", "backward", "rollout_cache",
                    "jagg_threshold", "exact_below_t", "split_batches", "guard")
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names}
    if isinstance(fn, JaggCompiled) and options:
        raise JaggInputError(f"explain: {fn.__name__} is already compiled with its own options; "
                             f"drop {sorted(options)} or pass the undecorated loss (its __wrapped__)")
    compiled = fn if isinstance(fn, JaggCompiled) else JaggCompiled(fn, **options)
    compiled(*args, **kwargs)
    return compiled.report

