"""First-call overhead and recompiles of ``@jagg_compile`` (part of ``jaggc bench``).

The first call of a compiled loss captures it (the FX capture, which ``capture="auto"`` takes
first, or Dynamo: both run the DiT once per call signature on fake tensors to learn its output),
runs jaggc's passes, then runs the rewritten graph. Its overhead is measured as first forward minus
a second forward of the same loss, for each capture in ``BenchConfig.compile_captures`` ("auto" is
the default a user gets: ``compile_overhead_default_s``, with the path it took); the passes' share
is timed on their own. Both are measured on the tiny model of the benchmarked family for
losses of ``BenchConfig.compile_steps`` steps: the capture cost grows with the number of DiT calls
and the DiT's op count, not with its parameter count (the 10M model's own first call is in the
main results as ``first_call``).

Where the overhead goes: ``passes`` (jaggc's graph passes, timed on their own) and ``glue_trace``:
Dynamo compiling the same loss with the DiT replaced by a plain Python stand-in that returns a
precomputed output (no module, no opaque call, no passes), i.e. what tracing the loss's own ops
costs whoever captures it. The rest is the opaque DiT calls (Dynamo's nonstrict_trace machinery,
and one fake DiT forward per call signature).

Recompiles: the smallest probe's default-capture loss then runs ``recompile_iterations`` training
iterations of fixed shape (forward, backward, an SGD step so the parameter values change as in
training); any new trace is a recompile. Dynamo's own graph counter is reported next to it.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from jaggc._compat import dynamo_unique_graphs, tree_map
from jaggc_studies.bench.device import resolve_device, resolve_dtype
from jaggc_studies.bench.problems import build_problem, family_of, own_code
from jaggc_studies.bench.strategies import compiled_loss

_TIME_CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def compile_probes(config) -> dict:
    """``compile_overhead_default_s`` (``capture="auto"``, primary clock; ``compile_default_path``:
    the path it took), ``compile_overhead_s`` (Dynamo), ``compile_overhead_fx_s`` (FX), per-clock
    details, ``recompiles``."""
    primary = config.clocks[0] if config.clocks[0] in _TIME_CLOCKS else "cpu"
    overhead = {capture: {} for capture in config.compile_captures}
    details, recompiles = {}, None
    for i, num_steps in enumerate(config.compile_steps):
        problem = build_problem(family_of(config.family, config.size), "tiny", num_steps=num_steps, batch=config.batch,
                                seed=config.seed, device=resolve_device(config.device), dtype=resolve_dtype(config.dtype))
        details[str(num_steps)] = {}
        for capture in config.compile_captures:
            if config.progress:
                config.progress(f"  first-call overhead, {num_steps}-step loss, capture={capture} ...")
            probe = _first_call(problem, num_steps, capture, primary)
            overhead[capture][str(num_steps)] = probe.pop("overhead")
            details[str(num_steps)][capture] = probe
            if i == 0 and capture == "auto" and config.recompile_iterations:
                recompiles = _recompiles(probe.pop("compiled"), problem, config.recompile_iterations)
            probe.pop("compiled", None)
        if "dynamo" in config.compile_captures:
            details[str(num_steps)]["glue_trace"] = _glue_trace_time(problem)
    result = dict(compile_overhead_default_s=overhead.get("auto", {}), compile_overhead_s=overhead.get("dynamo", {}),
                  compile_overhead_fx_s=overhead.get("fx", {}), compile_overhead_model=f"{family_of(config.family, config.size)}-tiny",
                  compile_overhead_clock=primary, compile_details=details,
                  compile_default_path=sorted({d["auto"]["path"] for d in details.values() if "auto" in d}))
    if recompiles is not None:
        result.update(recompiles=recompiles["traces"], recompile_detail=recompiles)
    return result


def _first_call(problem, num_steps: int, capture: str, primary: str) -> dict:
    """First call minus second call of the compiled loss, and the passes' share of it."""
    compiled = compiled_loss(problem, min(4, num_steps), capture=capture)   # a window may not exceed the steps
    passes_time = _time_passes(compiled)
    first = _timed(lambda: compiled(problem.model, problem.batch))
    second = _timed(lambda: compiled(problem.model, problem.batch))
    if compiled.report.path != capture and not (capture == "auto" and compiled.report.path in ("fx", "dynamo")):
        raise RuntimeError(f"the {num_steps}-step probe ran path {compiled.report.path!r}, not {capture!r}")
    return dict(overhead=first[primary] - second[primary], compiled=compiled, path=compiled.report.path,
                first_call={c: first[c] for c in _TIME_CLOCKS}, second_call={c: second[c] for c in _TIME_CLOCKS},
                passes=dict(passes_time), per_dit_call_s=(first[primary] - second[primary]) / num_steps)


def _timed(fn: Callable) -> dict[str, float]:
    start = {c: clock() for c, clock in _TIME_CLOCKS.items()}
    fn()
    return {c: clock() - start[c] for c, clock in _TIME_CLOCKS.items()}


class _StandIn:
    """Returns one precomputed DiT output for every call: the loss's glue is all Dynamo traces."""

    def __init__(self, output):
        self.output = output

    def __call__(self, *args, **kwargs):
        return self.output


def _glue_trace_time(problem) -> dict[str, float]:
    """First call minus second call of the loss compiled by Dynamo (eager backend) with the DiT
    replaced by a ``_StandIn``."""
    with torch.no_grad():
        output = problem.dit_calls(problem.batch)[0](problem.model)
    output = tree_map(lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                      output)
    # dynamic=False as jagg_compile does: a probe after a shorter one would otherwise trace with
    # symbolic shapes (Dynamo's automatic dynamic shapes key on the source location), a slower trace
    fn = torch.compile(own_code(problem.loss_fn), backend="eager", fullgraph=True, dynamic=False)
    stand_in = _StandIn(output)
    first = _timed(lambda: fn(stand_in, problem.batch))
    second = _timed(lambda: fn(stand_in, problem.batch))
    return {c: first[c] - second[c] for c in _TIME_CLOCKS}


def _time_passes(compiled) -> dict[str, float]:
    """Accumulate the time spent in the compiled loss's graph passes (its session's ``rewrite``,
    which every graph frontend calls; the session is private to the user, this probe is jaggc's own)."""
    spent = dict.fromkeys(_TIME_CLOCKS, 0.0)
    session = compiled._session
    rewrite = session.rewrite

    def timed_rewrite(*args, **kwargs):
        start = {c: clock() for c, clock in _TIME_CLOCKS.items()}
        try:
            return rewrite(*args, **kwargs)
        finally:
            for c, clock in _TIME_CLOCKS.items():
                spent[c] += clock() - start[c]

    session.rewrite = timed_rewrite   # the frontends call session.rewrite
    return spent


def _recompiles(compiled, problem, iterations: int) -> dict:
    graphs_before = dynamo_unique_graphs()
    traces_before = compiled.traces
    optimizer = torch.optim.SGD(problem.model.parameters(), lr=1e-3)
    for _ in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        compiled(problem.model, problem.batch).backward()
        optimizer.step()
    return dict(iterations=iterations, traces=compiled.traces - traces_before,
                dynamo_unique_graphs=dynamo_unique_graphs() - graphs_before)
