"""``jaggc bench``: one GRPO training step, exact per-step backward vs JAGG through ``@jagg_compile``.

What is measured, per mode (a strategy at a window size, e.g. ``jagg@4``):
  * time of a whole training step (forward + backward) and of the backward alone, over interleaved
    repeats (every round runs every mode once, in a rotated order, so drift and neighbours on a
    shared machine hit all modes alike); speedups are per-round ratios to the exact mode of the
    same round, reported as median with min/max;
  * DiT passes (``count_dit_passes``) and the cost model's prediction next to every measured ratio;
  * activation memory: peak live bytes of autograd-saved tensors (deterministic), and optionally
    the peak RSS of a fresh process running only that mode (``memory.py``);
  * first-call overhead (trace + passes) and recompiles over repeated calls of a fixed shape.

Cost model (docs/benchmarks.md; F = one DiT forward of batch B, backward = 2F): exact = 3F per step;
a JAGG window of W steps = (W-2)F no-grad interior + 2F knot forward + 4F joint backward, so the
step speedup is 3W/(W+4) and the backward speedup W/2. ``theory_*`` holds that formula;
``*_trajectory`` applies it window by window to the actual partition (a shorter tail window);
``counted_*`` uses the passes the run actually made. Clocks: ``config.CLOCKS``.

The package, in import order (each module imports only those before it, never this facade):

  model_configs.py the published architectures (SD3.5-Medium, FLUX.1-dev, Qwen-Image), depth cut
  device.py      the device and dtype, CUDA event / synced clocks, the CUDA peak-memory meter
  problems.py    the benchmarked training step: a DiT, its stored rollout, the loss
  strategies.py  the cost model and the table of strategies (how a mode runs a step)
  config.py      ``BenchConfig``, the clocks, ``ModeResult``
  compile.py     first-call overhead and recompiles of ``@jagg_compile``
  memory.py      peak RSS of one mode, measured in a fresh process (``rss_child.py``)
  report.py      the JSON summary and the printed table
  profile.py     where the time of one JAGG step goes (``jaggc bench --profile W``)
  runner.py      ``run_bench``: the run itself
  onpolicy.py    the on-policy ratio check (per-step loop vs jaggc's batched windows)
  suite.py       ``jaggc bench --suite gpu``: the cases, modes, rows and markdown table
  scaling.py     ``jaggc bench --scaling``: speedup and backward/forward ratio against width
  rss_child.py   the fresh process ``memory.py`` starts (``python -m jaggc_studies.bench.rss_child``);
                 imported by nobody
  sharded.py     the DDP / FSDP1 / FSDP2 table of every backward mode on torchrun ranks
                 (``torchrun --nproc-per-node 2 -m jaggc_studies.bench.sharded``, docs/distributed.md);
                 not re-exported here (``-m`` would run it twice), tests/runtime/test_sharded.py imports it

This module only re-exports the names the CLI, the tests and the README use.
"""

from __future__ import annotations

from jaggc_studies.bench.compile import compile_probes
from jaggc_studies.bench.config import CLOCKS, BenchConfig, ModeResult, PassClock, quick_config
from jaggc_studies.bench.memory import measure_rss
from jaggc_studies.bench.problems import Problem, build_problem
from jaggc_studies.bench.profile import format_profile, profile_window_step
from jaggc_studies.bench.report import format_table, summarize, write_json
from jaggc_studies.bench.runner import run_bench
from jaggc_studies.bench.strategies import STRATEGIES, Cost, LossStep, Mode, PerStepBackward, RolloutCachedStep, Strategy, compiled_loss, exact_cost, fast_cost, jagg_cost, lowmem_cost, parse_mode, per_window_cost, runtime_loss, theory_backward_speedup, theory_fast_backward_speedup, theory_fast_step_speedup, theory_lowmem_backward_speedup, theory_lowmem_step_speedup, theory_per_window_backward_speedup, theory_per_window_step_speedup, theory_step_speedup

__all__ = ["BenchConfig", "CLOCKS", "Cost", "LossStep", "Mode", "ModeResult", "PassClock", "PerStepBackward", "Problem",
           "RolloutCachedStep", "STRATEGIES", "Strategy", "build_problem", "compile_probes", "compiled_loss",
           "exact_cost", "fast_cost", "format_profile", "format_table", "jagg_cost", "lowmem_cost", "measure_rss",
           "parse_mode", "per_window_cost", "profile_window_step", "quick_config", "run_bench", "runtime_loss",
           "summarize", "theory_backward_speedup", "theory_fast_backward_speedup", "theory_fast_step_speedup",
           "theory_lowmem_backward_speedup", "theory_lowmem_step_speedup", "theory_per_window_backward_speedup",
           "theory_per_window_step_speedup", "theory_step_speedup", "write_json"]
