"""One ``jaggc bench`` run: build the problem, run every mode's first call (counted and
memory-metered), the compile probes, the optional modes the time budget allows, then the
interleaved timed rounds (every round runs every mode once, in a rotated order, so drift and
neighbours on a shared machine hit all modes alike), and hand everything to ``report.summarize``.
What is measured and the cost model behind it: the package docstring (``studies/bench/__init__.py``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from jaggc.runtime import count_dit_passes
from jaggc.runtime.memory import track_saved_tensors
from jaggc_studies.bench.compile import compile_probes
from jaggc_studies.bench.config import CLOCKS, BenchConfig, ModeResult
from jaggc_studies.bench.device import CudaPeakMemory, default_clocks, resolve_device, resolve_dtype
from jaggc_studies.bench.memory import measure_rss
from jaggc_studies.bench.problems import build_problem
from jaggc_studies.bench.report import summarize
from jaggc_studies.bench.strategies import parse_mode


class _Runner:
    """Holds the problem, the built steps and the clocks of one bench run."""

    def __init__(self, config: BenchConfig, clock_factories: dict):
        self.config = config
        self.t_start = time.perf_counter()
        self.log = config.progress or (lambda msg: None)
        self.device, self.dtype = resolve_device(config.device), resolve_dtype(config.dtype)
        self.problem = build_problem(config.family, config.size, num_steps=config.num_steps, batch=config.batch,
                                     seed=config.seed, cfg=config.cfg, device=self.device, dtype=self.dtype,
                                     layers=config.layers, resolution=config.resolution)
        self.clocks = {name: clock_factories[name](self.problem) for name in config.clocks}
        self.steps: dict[str, Any] = {}
        self.results: dict[str, ModeResult] = {}
        self.failed: dict[str, str] = {}     # mode -> why it did not run (out of memory)

    def read(self) -> dict[str, float]:
        return {name: clock() for name, clock in self.clocks.items()}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def add_mode(self, text: str) -> None:
        """Build the mode and run its first call (trace + passes for a compiled mode), counted and
        memory-metered; the first call is timed but never enters the speedups."""
        mode = parse_mode(text)
        cost = mode.strategy.cost_for(self.problem, mode.window)
        step = mode.strategy.build(self.problem, mode.window)
        result = ModeResult(mode.name, mode.strategy.name, mode.window, mode.strategy.about,
                            dict(forward=cost.forward, backward=cost.backward, step=cost.step))
        self.log(f"  first call of {mode.name} ...")
        wall = time.perf_counter()
        try:
            result.first_call, _, counts, peak = self._run_step(step, counted=True)
            result.first_call_wall_s = time.perf_counter() - wall
            if _traces(step):
                # while Dynamo traced, the DiT also ran on fake tensors and count_dit_passes counted
                # those forwards: count (and meter) a second call instead
                _, _, counts, peak = self._run_step(step, counted=True)
        except torch.OutOfMemoryError as e:
            self._out_of_memory(text, e)
            return
        result.activation_peak_bytes = peak
        result.passes = dict(grad_forwards=counts.grad_forwards, nograd_forwards=counts.nograd_forwards,
                             backwards=counts.backwards, backward_samples=counts.backward_samples,
                             forward_samples=sum(counts.grad_forward_batches) + sum(counts.nograd_forward_batches))
        self.steps[text], self.results[text] = step, result

    def _out_of_memory(self, text: str, error: Exception) -> None:
        """A mode that does not fit is a result ("out of memory"), not the end of the run; the
        exact mode is every ratio's base, so without it the run cannot go on."""
        self.problem.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        message = f"out of memory: {str(error).splitlines()[0]}"
        if text == "exact":
            raise RuntimeError(f"{self.problem.name}: the exact mode (every speedup's base) ran {message}; "
                               f"use fewer --steps, a smaller --batch or --layers") from error
        self.log(f"  {text}: {message}")
        self.failed[text] = message

    def _run_step(self, step, *, counted: bool = False, memory: ModeResult | None = None):
        """One step; ``memory``: record its CUDA peak into that result (the max over its steps)."""
        self.problem.model.zero_grad(set_to_none=True)
        gc.collect()   # a collection inside a timed step would land on one mode at random
        counts = peak = None
        meter = CudaPeakMemory(self.device) if memory is not None and self.device.type == "cuda" else _NullMeter()
        with meter:
            if counted:
                with count_dit_passes(self.problem.model) as counts, _saved_tensor_meter(self.config) as saved:
                    start, mid, end = step.run(self.read)
                peak = saved.peak_bytes if saved is not None else None
            else:
                start, mid, end = step.run(self.read)
        if getattr(meter, "peak_bytes", None) is not None:
            memory.peak_memory_bytes = max(memory.peak_memory_bytes or 0, meter.peak_bytes)
            memory.step_memory_bytes = max(memory.step_memory_bytes or 0, meter.step_bytes)
        whole = {k: end[k] - start[k] for k in end}
        backward = {k: end[k] - mid[k] for k in end}
        return whole, backward, counts, peak

    def warmup_rounds(self) -> None:
        """Untimed rounds (CUDA: allocator, cuBLAS/cuDNN heuristics and autotuning settle)."""
        rounds = self.config.warmup if self.config.warmup is not None else int(self.device.type == "cuda")
        for r in range(rounds):
            self.log(f"  warm-up round {r + 1}/{rounds}")
            for name in list(self.steps):
                self._guarded_step(name)

    def _guarded_step(self, name: str, memory: ModeResult | None = None):
        try:
            return self._run_step(self.steps[name], memory=memory)
        except torch.OutOfMemoryError as e:
            self._out_of_memory(name, e)
            del self.steps[name], self.results[name]
            return None

    def timed_rounds(self) -> None:
        names = list(self.steps)
        for r in range(self.config.repeats):
            order = names[r % len(names):] + names[:r % len(names)]   # rotate: no mode always first
            self.log(f"  round {r + 1}/{self.config.repeats}: {', '.join(order)}")
            for name in order:
                if name not in self.steps:
                    continue
                res = self.results[name]
                ran = self._guarded_step(name, memory=res)
                if ran is None:
                    continue
                whole, backward, _, _ = ran
                for clock in whole:
                    res.whole.setdefault(clock, []).append(whole[clock])
                    res.backward.setdefault(clock, []).append(backward[clock])

    def estimated_round_s(self, extra: str | None = None) -> float:
        """Wall seconds of one timed round, from the exact mode's first call and the cost model."""
        exact = self.results["exact"]
        per_unit = exact.first_call_wall_s / exact.cost["step"]
        names = list(self.results) + ([extra] if extra else [])
        return sum(per_unit * parse_mode(n).strategy.cost_for(self.problem, parse_mode(n).window).step
                   for n in names)


def _traces(step) -> int | None:
    """How many times a compiled step's loss was traced (None: not a compiled loss)."""
    return getattr(getattr(step, "loss_fn", None), "traces", None)


class _NullMeter:
    peak_bytes = None

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _saved_tensor_meter(config: BenchConfig):
    if not config.activation_memory:
        return _NullMeter()
    return track_saved_tensors()


def run_bench(config: BenchConfig, clock_factories: dict | None = None) -> dict:
    """Run the benchmark and return the JSON-ready results (see ``summarize``)."""
    factories = {**CLOCKS, **(clock_factories or {})}
    if config.clocks is None:
        config.clocks = default_clocks(resolve_device(config.device))
    torch.manual_seed(config.seed)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    modes = list(config.modes)
    if "exact" not in modes:
        modes.insert(0, "exact")   # every speedup is a ratio to it
    log = config.progress or (lambda msg: None)
    log(f"building {config.family}-{config.size} ({config.num_steps} steps, batch {config.batch}) ...")
    runner = _Runner(config, factories)
    try:
        for text in modes:
            runner.add_mode(text)
        log("compile probes ...")
        compile_info = compile_probes(config)
        skipped = _add_optional_modes(runner)
        runner.warmup_rounds()
        runner.timed_rounds()
        for text, step in runner.steps.items():
            runner.results[text].traces = _traces(step)
        if config.rss:
            for text in runner.steps:
                log(f"  peak RSS of {text} (fresh process) ...")
                runner.results[text].rss = measure_rss(config, text)
    finally:
        for clock in runner.clocks.values():
            getattr(clock, "close", lambda: None)()
    return summarize(config, runner, compile_info, skipped)


def _add_optional_modes(runner: _Runner) -> list[str]:
    """Add each optional mode if its compile plus all timed rounds still fit the budget."""
    config, skipped = runner.config, []
    for text in config.optional_modes:
        first_calls = [r.first_call_wall_s for r in runner.results.values() if r.window]
        compile_s = max(first_calls, default=0.0)
        projected = runner.elapsed() + compile_s + config.repeats * runner.estimated_round_s(extra=text)
        if config.budget_s is not None and projected > config.budget_s:
            runner.log(f"  skipping {text}: projected {projected:.0f} s > budget {config.budget_s:.0f} s")
            skipped.append(text)
            continue
        runner.add_mode(text)
    return skipped
