"""The compile session: what the frontends of one compiled loss share (``frontends/contract.Session``).

A ``jaggc.JaggCompiled`` is the user's object: its call, ``.report`` and a few read-only
counters. Everything the capture paths need of it lives here instead: the loss and its DiT, the
settings (``CompileConfig``), the frontends made from the registry, which modules are kept opaque
(``candidates``), the pass pipeline over a capture (``rewrite``), the trace count, and the report of
the graph that runs now (``show``).
"""

from __future__ import annotations

from typing import Callable

from torch import fx, nn

from .backends import compile_glue
from .config import CompileConfig
from .errors import JaggUnsupportedError
from .frontends.contract import Captured, Frontend, bind_loss
from .frontends.intercept import InterceptedLoss
from .frontends import registry
from .passes import PassContext, run_passes    # passes/, installed as jaggc.passes
from .report import Report
from .report_build import build_report, intercept_report


class CompileSession:
    """The state one compiled loss's frontends share (module docstring)."""

    def __init__(self, fn: Callable, *, dit: nn.Module | None, config: CompileConfig, backend: str | None,
                 qualname: str):
        self.fn = fn
        self.dit = dit
        self.config = config
        self.backend = backend          # Options(backend=...): compiles a Dynamo graph's glue
        self.qualname = qualname
        self.traces = 0                 # captures made (rewrites and intercept recordings)
        self.capture_failures: list[str] = []   # why earlier paths of capture="auto" were left
        self.failed_now: list[str] = []         # why this call's earlier paths were left, so far
        self.report: Report | None = None       # the report of the graph that runs now
        self.watched: list[str] = []    # the modules kept opaque, described (for warnings)
        self.dynamo_split: fx.GraphModule | None = None   # the glue-compiled graph (Options(backend=...))
        self.frontends: dict[str, Frontend] = {name: entry.make(self, qualname)
                                                for name, entry in registry.FRONTENDS.items()}

    def candidates(self, args: tuple, kwargs: dict) -> list[nn.Module]:
        """The modules the frontends keep opaque: ``dit=``, else every module argument."""
        if self.dit is not None:
            self.watched = [f"{type(self.dit).__name__} (jagg_compile(dit=...))"]
            return [self.dit]
        found = [v for v in list(args) + list(kwargs.values()) if isinstance(v, nn.Module)]
        try:
            names = {id(v): k for k, v in bind_loss(self.fn, args, kwargs).arguments.items()}
        except TypeError:
            names = {}
        self.watched = [f"{type(m).__name__} (argument {names.get(id(m), '?')!r})" for m in found]
        if not found:
            raise JaggUnsupportedError(
                f"{self.qualname} takes no nn.Module argument, so jaggc cannot tell which module is "
                f"the DiT; pass it: jagg_compile(fn, dit=model)")
        return found

    def show(self, report: Report) -> None:
        self.report = report

    def empty_report(self, path: str, note: str) -> Report:
        return Report(path=path, traces=self.traces, notes=[note])

    def intercept_report(self, loss: InterceptedLoss) -> Report:
        self.traces += 1
        return intercept_report(loss, self.config, self.traces)

    def rewrite(self, captured: Captured, frontend: str) -> tuple[fx.GraphModule, Report]:
        """The passes over a capture, and its report; a Dynamo graph's glue compiled by
        ``Options(backend=...)``."""
        ctx = PassContext(config=self.config, dit=self.dit, frontend=frontend, watched=list(self.watched),
                          entry_grad=captured.entry_grad, entry_autocast=captured.entry_autocast)
        gm, stages = run_passes(captured.gm, ctx)
        self.traces += 1
        report = self.report = build_report(frontend, gm, stages, ctx, self.traces)
        report.capture_failures = list(self.capture_failures)
        if frontend == "dynamo" and self.backend is not None:
            gm = self.dynamo_split = compile_glue(gm, self.backend)
            report.notes.append(f"backend={self.backend!r}: {gm.jaggc_segments['glue']} glue segment(s) compiled, "
                                f"{gm.jaggc_segments['runtime']} runtime segment(s) eager")
        return gm, report


__all__ = ["CompileSession"]
