"""``jaggc bench``: one GRPO training step, exact per-step backward vs JAGG through ``@jagg_compile``.

What is measured, per mode (a strategy at a window size, e.g. ``jagg@4``):
  * time of a whole training step (forward + backward) and of the backward alone, over interleaved
    repeats (every round runs every mode once, in a rotated order, so drift and neighbours on a
    shared machine hit all modes alike); speedups are per-round ratios to the exact mode of the
    same round, reported as median with min/max;
  * DiT passes (``count_dit_passes``) and the cost model's prediction next to every measured ratio;
  * activation memory: peak live bytes of autograd-saved tensors (deterministic), and optionally
    the peak RSS of a fresh process running only that mode (``jaggc.bench.memory``);
  * first-call overhead (trace + passes) and recompiles over repeated calls of a fixed shape.

Cost model (spec §2.4; F = one DiT forward of batch B, backward = 2F): exact = 3F per step;
a JAGG window of W steps = (W-2)F no-grad interior + 2F knot forward + 4F joint backward, so the
step speedup is 3W/(W+4) and the backward speedup W/2. ``theory_*`` holds that formula;
``*_trajectory`` applies it window by window to the actual partition (a shorter tail window);
``counted_*`` uses the passes the run actually made. Clocks: ``cpu`` (process CPU time: with one
thread it is the least disturbed by other processes on the machine), ``wall``, and ``passes``
(the counted cost-model units: a deterministic clock for tests and for checking the accounting).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .problems import Problem, build_problem
from .strategies import (STRATEGIES, Cost, LossStep, Mode, PerStepBackward, RolloutCachedStep, Strategy,
                               compiled_loss, exact_cost, fast_cost, jagg_cost, parse_mode, per_window_cost,
                               runtime_loss, theory_backward_speedup, theory_fast_backward_speedup,
                               theory_fast_step_speedup, theory_per_window_backward_speedup,
                               theory_per_window_step_speedup, theory_step_speedup)
from ..runtime import count_dit_passes

__all__ = ["BenchConfig", "CLOCKS", "Cost", "LossStep", "Mode", "ModeResult", "PassClock", "PerStepBackward",
           "RolloutCachedStep", "STRATEGIES", "Strategy", "compiled_loss", "exact_cost", "fast_cost", "jagg_cost",
           "parse_mode", "per_window_cost", "quick_config", "run_bench", "runtime_loss", "theory_backward_speedup",
           "theory_fast_backward_speedup", "theory_fast_step_speedup", "theory_per_window_backward_speedup",
           "theory_per_window_step_speedup", "theory_step_speedup"]

# ---------------------------------------------------------------------------------------------
# clocks


class PassClock:
    """A clock that reads the DiT work done so far in cost-model units (forward of batch B = 1,
    backward = 2): timing a step with it gives the counted cost, independent of the machine."""

    def __init__(self, problem: Problem):
        self.batch = problem.batch_size
        self._ctx = count_dit_passes(problem.model)
        self.counts = self._ctx.__enter__()

    def __call__(self) -> float:
        c = self.counts
        samples = sum(c.grad_forward_batches) + sum(c.nograd_forward_batches) + 2 * sum(c.backward_batches)
        return samples / self.batch

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)


CLOCKS: dict[str, Callable[[Problem], Callable[[], float]]] = {
    "cpu": lambda p: time.process_time,
    "wall": lambda p: time.perf_counter,
    "passes": PassClock,
}


# ---------------------------------------------------------------------------------------------
# configuration and the run


@dataclass
class BenchConfig:
    family: str = "sd3"
    size: str = "10m"
    cfg: bool = False          # Flow-GRPO's train_sd3 CFG loss (guidance 4.5, uncond half detached)
    num_steps: int = 16
    batch: int = 4
    seed: int = 0
    modes: tuple[str, ...] = ("exact", "jagg@2", "jagg@3", "jagg@4", "jagg@6", "jagg@8",
                              "jagg_split_knots@4", "runtime@4", "jagg_per_window@4", "jagg_lowmem@4", "jagg_fast@4",
                              "exact_per_step")
    optional_modes: tuple[str, ...] = ()   # added only if the time budget allows (quick: jagg@8)
    repeats: int = 3
    clocks: tuple[str, ...] = ("cpu", "wall")   # the first is the one speedups are reported in
    threads: int | None = 1
    activation_memory: bool = True
    rss: bool = False
    compile_steps: tuple[int, ...] = (10, 50, 100)   # first-call overhead probes (tiny model)
    compile_captures: tuple[str, ...] = ("auto", "dynamo", "fx")
    recompile_iterations: int = 20
    budget_s: float | None = None                    # wall-clock budget for optional modes
    progress: Callable[[str], None] | None = None


def quick_config(**overrides) -> BenchConfig:
    """``jaggc bench --quick``: the 10M SD3 model, exact vs JAGG and its on-policy fast path at W=4
    (and JAGG at W=8 if the budget allows), in about 3 minutes on 2 shared cores.

    What it trims against the full bench, and why each is safe:
      * 8 trained steps instead of 16: two W=4 windows. The cost model and the JAGG ratios are per
        window, so the ratios are those of the 16-step loss; the step time halves and the trace
        (one fake DiT forward per call) shrinks;
      * one 4-step compile probe instead of the 10/50/100-step sweep: it keeps the recompile check
        (20 training iterations with an optimizer step) at a fraction of the trace cost; the
        benchmarked loss's own first-call overhead is in the main results anyway.
    The main ratios keep 3 interleaved repeats."""
    config = BenchConfig(num_steps=8, modes=("exact", "jagg@4", "jagg_fast@4"), optional_modes=("jagg@8",),
                         repeats=3, compile_steps=(4,), budget_s=170.0)
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


@dataclass
class ModeResult:
    mode: str
    strategy: str
    window: int | None
    about: str
    cost: dict
    first_call: dict = field(default_factory=dict)       # clock -> s (includes trace + passes)
    first_call_wall_s: float = 0.0                       # always wall-clock: for the time budget
    whole: dict = field(default_factory=dict)            # clock -> [per round]
    backward: dict = field(default_factory=dict)
    passes: dict = field(default_factory=dict)
    activation_peak_bytes: int | None = None
    traces: int | None = None                            # compiled modes: traces after all rounds
    rss: dict | None = None


class _Runner:
    """Holds the problem, the built steps and the clocks of one bench run."""

    def __init__(self, config: BenchConfig, clock_factories: dict):
        self.config = config
        self.t_start = time.perf_counter()
        self.log = config.progress or (lambda msg: None)
        self.problem = build_problem(config.family, config.size, num_steps=config.num_steps, batch=config.batch,
                                     seed=config.seed, cfg=config.cfg)
        self.clocks = {name: clock_factories[name](self.problem) for name in config.clocks}
        self.steps: dict[str, Any] = {}
        self.results: dict[str, ModeResult] = {}

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
        result.first_call, _, counts, peak = self._run_step(step, counted=True)
        result.first_call_wall_s = time.perf_counter() - wall
        if _traces(step):
            # while Dynamo traced, the DiT also ran on fake tensors and count_dit_passes counted
            # those forwards: count (and meter) a second call instead
            _, _, counts, peak = self._run_step(step, counted=True)
        result.activation_peak_bytes = peak
        result.passes = dict(grad_forwards=counts.grad_forwards, nograd_forwards=counts.nograd_forwards,
                             backwards=counts.backwards, backward_samples=counts.backward_samples,
                             forward_samples=sum(counts.grad_forward_batches) + sum(counts.nograd_forward_batches))
        self.steps[text], self.results[text] = step, result

    def _run_step(self, step, *, counted: bool = False):
        self.problem.model.zero_grad(set_to_none=True)
        gc.collect()   # a collection inside a timed step would land on one mode at random
        counts = peak = None
        if counted:
            with count_dit_passes(self.problem.model) as counts, _saved_tensor_meter(self.config) as meter:
                start, mid, end = step.run(self.read)
            peak = meter.peak_bytes if meter is not None else None
        else:
            start, mid, end = step.run(self.read)
        whole = {k: end[k] - start[k] for k in end}
        backward = {k: end[k] - mid[k] for k in end}
        return whole, backward, counts, peak

    def timed_rounds(self) -> None:
        names = list(self.steps)
        for r in range(self.config.repeats):
            order = names[r % len(names):] + names[:r % len(names)]   # rotate: no mode always first
            self.log(f"  round {r + 1}/{self.config.repeats}: {', '.join(order)}")
            for name in order:
                whole, backward, _, _ = self._run_step(self.steps[name])
                res = self.results[name]
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
    from ..runtime.memory import track_saved_tensors

    return track_saved_tensors()


def run_bench(config: BenchConfig, clock_factories: dict | None = None) -> dict:
    """Run the benchmark and return the JSON-ready results (see ``summarize``)."""
    from .compile import compile_probes

    factories = {**CLOCKS, **(clock_factories or {})}
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
        runner.timed_rounds()
        for text, step in runner.steps.items():
            runner.results[text].traces = _traces(step)
        if config.rss:
            from .memory import measure_rss

            for text in runner.steps:
                log(f"  peak RSS of {text} (fresh process) ...")
                runner.results[text].rss = measure_rss(config, text)
    finally:
        for clock in runner.clocks.values():
            getattr(clock, "close", lambda: None)()
    from .report import summarize

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
