"""What one ``jaggc bench`` run is asked to do (``BenchConfig``), the clocks it reads, and the
record it keeps per mode (``ModeResult``): the data every other bench module shares.

Clocks: ``cpu`` (process CPU time: with one thread it is the least disturbed by other processes on
the machine; CPU runs only), ``wall`` (synchronised with the device on CUDA), ``cuda`` (CUDA events,
``device.py``), and ``passes`` (the counted cost-model units: a deterministic clock for tests and
for checking the accounting).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from jaggc.runtime import count_dit_passes
from jaggc_studies.bench.device import cpu_clock, cuda_clock, wall_clock
from jaggc_studies.bench.problems import Problem

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
    "cpu": cpu_clock,
    "wall": wall_clock,
    "cuda": cuda_clock,
    "passes": PassClock,
}


# ---------------------------------------------------------------------------------------------
# configuration


@dataclass
class BenchConfig:
    family: str | None = None  # None: the size's family (sd3 for tiny/10m)
    size: str = "10m"
    device: str = "cpu"
    dtype: str = "float32"     # the DiT's parameters and stored states; log-densities stay float32
    layers: int | None = None          # published sizes: depth cut (model_configs.depth_cut)
    resolution: int | None = None      # published sizes: image px (512 -> 64x64 latents)
    cfg: bool = False          # Flow-GRPO's train_sd3 CFG loss (guidance 4.5, uncond half detached)
    num_steps: int = 16
    batch: int = 4
    seed: int = 0
    modes: tuple[str, ...] = ("exact", "jagg@2", "jagg@3", "jagg@4", "jagg@6", "jagg@8",
                              "jagg_split_knots@4", "runtime@4", "jagg_per_window@4", "jagg_lowmem@4", "jagg_fast@4",
                              "exact_per_step")
    optional_modes: tuple[str, ...] = ()   # added only if the time budget allows (quick: jagg@8)
    repeats: int = 3
    clocks: tuple[str, ...] | None = None   # the first is the one speedups are reported in; None:
                                            # cpu+wall on the CPU, cuda+wall on CUDA
    warmup: int | None = None   # untimed rounds of every mode before the timed ones (None: 1 on CUDA, 0 on CPU)
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


# ---------------------------------------------------------------------------------------------
# what a run records per mode


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
    peak_memory_bytes: int | None = None                 # CUDA: max_memory_allocated over the timed steps
    step_memory_bytes: int | None = None                 # CUDA: that peak minus what was allocated before the step
