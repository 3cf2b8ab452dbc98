"""What ``jaggc bench`` compares: the cost model and the table of strategies.

A strategy is a way to run one GRPO training step (``build(problem, window)`` returns an object
whose ``run(read)`` runs the step and reads the clocks at its start, at the forward/backward
boundary and at its end) plus its cost-model prediction. A mode is a strategy at a window size,
written ``name@W`` ("jagg@4"); ``exact`` and ``exact_per_step`` take no window. Adding a mode to
the bench is one line in ``STRATEGIES``.

Cost model (docs/benchmarks.md; F = one DiT forward of batch B, backward = 2F): exact = 3F per step; a JAGG
window of W steps = (W-2)F no-grad interior + 2F knot forward + 4F joint backward = (W+4)F, so the
step speedup is 3W/(W+4) and the backward speedup W/2. ``Cost.backward`` is the work done inside
``loss.backward()`` (where the per-window mode re-runs its knot forward), so that the theory sits
next to the measured backward time.

Two variants of a JAGG window (windows of <= 2 steps run exactly, 3F per step, in all of them):
  * per-window backward (``backward="per_window"``): every step of the window runs without grad for
    the values (W F), and ``loss.backward()`` re-runs the 2B knot forward with grad (2F) and the joint
    backward (4F): (W+6)F, step speedup 3W/(W+6), backward speedup 2W/6 = W/3;
  * on-policy fast path (``rollout_cache=``): the interior outputs come from the rollout's recorded
    DiT calls, so a window costs only the knot forward and the joint backward: 6F, step speedup
    3W/6 = W/2, backward speedup W/2 (the backward is JAGG's);
  * low-memory backward (``backward="lowmem"``): the joint mode's (W+4)F per window, step speedup
    3W/(W+4), but every window's joint backward but the last runs inside the loss's forward call, so
    ``loss.backward()`` holds only the last window's 4F (no per-window backward theory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from jaggc import Options, Routing
from jaggc.api import DEFAULT_WEIGHTS, jagg_compile
from jaggc.runtime.guard import Guard
from jaggc.runtime import RolloutCache, WindowOptions, jagg_calls, partition
from jaggc_studies.bench.problems import Problem, own_code

# ---------------------------------------------------------------------------------------------
# the cost model


@dataclass(frozen=True)
class Cost:
    """DiT work of one training step in units of F (one forward of the problem's batch)."""

    forward: float
    backward: float

    @property
    def step(self) -> float:
        return self.forward + self.backward


def exact_cost(num_steps: int, window: int | None = None) -> Cost:
    return Cost(num_steps, 2 * num_steps)


def jagg_cost(num_steps: int, window: int) -> Cost:
    """(W-2) interior + 2 knot forwards and one backward of 2B (=4F) per window; a window of
    <= 2 steps runs exactly (all its steps are knots)."""
    forward = backward = 0
    for steps in partition(num_steps, window):
        forward += len(steps)
        backward += 2 * len(steps) if len(steps) <= 2 else 4
    return Cost(forward, backward)


def per_window_cost(num_steps: int, window: int) -> Cost:
    """Every step's value from a no-grad forward; inside the backward, per window, the 2B knot
    re-forward (2F) and one joint backward (4F)."""
    forward = backward = 0
    for steps in partition(num_steps, window):
        forward += len(steps)
        backward += 2 * len(steps) if len(steps) <= 2 else 2 + 4
    return Cost(forward, backward)


def lowmem_cost(num_steps: int, window: int) -> Cost:
    """The joint mode's work; each window's backward but the last's runs in the forward call."""
    parts = [(len(steps), 2 * len(steps) if len(steps) <= 2 else 4) for steps in partition(num_steps, window)]
    return Cost(sum(f for f, _ in parts) + sum(b for _, b in parts[:-1]), parts[-1][1])


def fast_cost(num_steps: int, window: int) -> Cost:
    """Interior outputs served from the rollout cache: per window only the 2B knot forward (2F)
    and one joint backward (4F)."""
    forward = backward = 0
    for steps in partition(num_steps, window):
        forward += len(steps) if len(steps) <= 2 else 2
        backward += 2 * len(steps) if len(steps) <= 2 else 4
    return Cost(forward, backward)


def guard_cost(num_steps: int, window: int) -> Cost:
    """``jagg_guard``: every call probed (Guard(every=1)): plain JAGG plus, per JAGG window, one
    backward of its W steps (2W F; its interior forwards run with grad instead of without). The
    overhead at every=k is 1/k of the difference to ``jagg``'s."""
    base = jagg_cost(num_steps, window)
    probe = sum(2 * len(steps) for steps in partition(num_steps, window) if len(steps) > 2)
    return Cost(base.forward, base.backward + probe)


def cfg_unsplit(cost: Callable[[int, int | None], Cost]) -> Callable[[int, int | None], Cost]:
    """With CFG in training every step's call is on [uncond; cond]: twice the work of B samples."""
    return lambda n, w: Cost(2 * cost(n, w).forward, 2 * cost(n, w).backward)


def cfg_split(cost: Callable[[int, int | None], Cost]) -> Callable[[int, int | None], Cost]:
    """With the CFG call split (passes/split_batch.py): the cond halves cost what a plain loss's
    steps cost, plus one no-grad forward of the uncond half per step."""
    return lambda n, w: Cost(cost(n, w).forward + n, cost(n, w).backward)


def exact_compiled_cost(num_steps: int, window: int | None = None) -> Cost:
    """Every window exact through @jagg_compile: on a plain loss the exact cost."""
    return exact_cost(num_steps)


def theory_step_speedup(window: int) -> float:
    return 3 * window / (window + 4)


def theory_backward_speedup(window: int) -> float:
    return window / 2


def theory_per_window_step_speedup(window: int) -> float:
    return 3 * window / (window + 6)


def theory_per_window_backward_speedup(window: int) -> float:
    return 2 * window / 6


def theory_lowmem_step_speedup(window: int) -> float:
    return 3 * window / (window + 4)


def theory_lowmem_backward_speedup(window: int) -> None:
    return None      # its backward work is mostly inside the forward call


def theory_fast_step_speedup(window: int) -> float:
    return 3 * window / 6


def theory_fast_backward_speedup(window: int) -> float:
    return window / 2


# ---------------------------------------------------------------------------------------------
# training steps: how one mode runs a step, reading the clocks at the forward/backward boundary

Read = Callable[[], dict[str, float]]


class LossStep:
    """loss = fn(model, batch); loss.backward(): the shape of every Flow-GRPO-style step."""

    def __init__(self, problem: Problem, loss_fn: Callable):
        self.problem, self.loss_fn = problem, loss_fn

    def run(self, read: Read) -> tuple[dict, dict, dict]:
        start = read()
        loss = self.loss_fn(self.problem.model, self.problem.batch)
        mid = read()
        loss.backward()
        return start, mid, read()


class PerStepBackward:
    """Flow-GRPO's own loop: backward inside the step loop, one step's activations alive at a time.
    Its 'backward' time is the sum of the per-step backward calls."""

    def __init__(self, problem: Problem):
        self.problem = problem

    def run(self, read: Read) -> tuple[dict, dict, dict]:
        p = self.problem
        start = read()
        backward = dict.fromkeys(start, 0.0)
        for j, call in enumerate(p.dit_calls(p.batch)):
            loss = p.step_loss(call(p.model), p.batch, j)
            before = read()
            loss.backward()
            after = read()
            backward = {k: backward[k] + after[k] - before[k] for k in backward}
        end = read()
        # report the same (start, mid, end) triple: backward = end - mid
        return start, {k: end[k] - backward[k] for k in end}, end


def compiled_loss(problem: Problem, window: int, **options) -> Callable:
    """``@jagg_compile`` of the problem's loss; plain JAGG (``weights="t"``, what the cost model
    describes) unless ``options`` say otherwise (``jagg_default`` passes the library default)."""
    options.setdefault("weights", "t")
    return jagg_compile(own_code(problem.loss_fn), window=window, **options)


def sigma_exact_windows(problem: Problem, window: int) -> list[bool]:
    """Per window of the partition: whether the default weights run it exactly (σ-aware placement)."""
    from jaggc.runtime.calls import get_time, resolve_time_arg

    calls = problem.dit_calls(problem.batch)
    times = [get_time(c, resolve_time_arg(c, None)).to(torch.float64).reshape(-1) for c in calls]
    return [DEFAULT_WEIGHTS.runs_exact(torch.stack([times[k] for k in steps])) for steps in
            partition(problem.num_steps, window)]


def default_cost(problem: Problem, window: int) -> Cost:
    """The default weights: windows reaching σ < 0.5 run all their steps as knots (3F per step,
    as exact), the others as plain JAGG."""
    forward = backward = 0
    for steps, exact in zip(partition(problem.num_steps, window), sigma_exact_windows(problem, window)):
        forward += len(steps)
        backward += 2 * len(steps) if exact or len(steps) <= 2 else 4
    if problem.cfg:     # the split uncond halves: one no-grad forward per step
        forward += problem.num_steps
    return Cost(forward, backward)


class RolloutCachedStep(LossStep):
    """The on-policy fast path: ``@jagg_compile(window=W, options=Options(rollout_cache=cache))``.

    ``build`` plays the rollout: it records the DiT's no-grad outputs on exactly the inputs the
    loss will use, with the parameters the timed steps run with (in GRPO the rollout is not part
    of the training step, so this is outside the timed region). The bench never writes a parameter
    in place after this (``zero_grad(set_to_none=True)`` only drops ``.grad``); if something did,
    the cache would drop itself and the runtime would silently run the interior forwards again, so
    every step checks that each interior call was served from the cache and raises otherwise: a
    "fast path" that fell back would time plain JAGG under the wrong name."""

    def __init__(self, problem: Problem, window: int):
        self.cache = RolloutCache(problem.model)
        with torch.no_grad(), self.cache.record():
            for call in problem.dit_calls(problem.batch):
                call(problem.model)
        # one lookup per interior step of every window of > 2 steps (shorter windows run exactly),
        # and with CFG one per step for its split uncond half
        basis = WindowOptions().basis
        self.interior_calls = sum(len(w) - len(basis.knot_positions(len(w)))
                                  for w in partition(problem.num_steps, window) if len(w) > 2)
        self.interior_calls += problem.num_steps if problem.cfg else 0
        super().__init__(problem, compiled_loss(problem, window, options=Options(rollout_cache=self.cache)))

    def run(self, read: Read) -> tuple[dict, dict, dict]:
        stats = self.cache.stats
        hits, misses = stats.hits, stats.misses
        out = super().run(read)
        served, missed = stats.hits - hits, stats.misses - misses
        if missed or served != self.interior_calls:
            raise RuntimeError(
                f"jagg_fast: the rollout cache served {served} of {self.interior_calls} interior calls "
                f"({missed} misses, {stats.invalidations} invalidations): the step fell back to forwards")
        return out


def runtime_loss(problem: Problem, window: int, **options) -> Callable:
    """The same loss with its velocities from ``jagg_calls``: no capture, no graph (the glue's
    baseline)."""
    window_options = WindowOptions(**options)

    def loss(model, batch):
        outs = jagg_calls(model, problem.dit_calls(batch), window=window, options=window_options)
        return sum(problem.step_loss(o, batch, j) for j, o in enumerate(outs))

    return loss


@dataclass(frozen=True)
class Strategy:
    """A way to run one training step. ``build(problem, window)`` returns an object with
    ``run(read)``; ``cost(num_steps, window)`` is its cost-model prediction, ``cfg_cost`` the one
    with CFG in training (``--cfg``; F stays one forward of the B conditional samples)."""

    name: str
    build: Callable[[Problem, int | None], Any]
    cost: Callable[[int, int | None], Cost]
    windowed: bool
    about: str
    cfg_cost: Callable[[int, int | None], Cost] | None = None
    problem_cost: Callable[[Problem, int | None], Cost] | None = None   # a cost that depends on the data

    def cost_for(self, problem: Problem, window: int | None) -> Cost:
        if self.problem_cost is not None:
            return self.problem_cost(problem, window)
        if problem.cfg:
            return (self.cfg_cost or cfg_unsplit(self.cost))(problem.num_steps, window)
        return self.cost(problem.num_steps, window)


# One line per strategy.
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("exact", lambda p, w: LossStep(p, p.loss_fn), exact_cost, False,
             "the undecorated loss, one backward"),
    Strategy("exact_per_step", lambda p, w: PerStepBackward(p), exact_cost, False,
             "Flow-GRPO's loop: backward inside the step loop"),
    Strategy("exact_compiled", lambda p, w: LossStep(p, compiled_loss(p, 2, routing=Routing(jagg_frac=0.0))),
             exact_compiled_cost,
             False, "@jagg_compile with every window exact: only the CFG split applies",
             cfg_cost=cfg_split(exact_compiled_cost)),
    Strategy("jagg", lambda p, w: LossStep(p, compiled_loss(p, w)), jagg_cost, True,
             "@jagg_compile(window=W, weights='t'): plain JAGG", cfg_cost=cfg_split(jagg_cost)),
    Strategy("jagg_default", lambda p, w: LossStep(p, compiled_loss(p, w, weights=DEFAULT_WEIGHTS)), jagg_cost, True,
             "@jagg_compile(window=W) with the default weights (windows reaching σ < 0.5 exact)",
             problem_cost=default_cost),
    Strategy("jagg_split_knots", lambda p, w: LossStep(p, compiled_loss(p, w, options=Options(batch_knots=False))), jagg_cost, True,
             "@jagg_compile(window=W, options=Options(batch_knots=False)): knots as separate passes", cfg_cost=cfg_split(jagg_cost)),
    Strategy("runtime", lambda p, w: LossStep(p, runtime_loss(p, w)), jagg_cost, True,
             "jagg_calls directly in a hand-split loss (no capture, no graph)"),
    Strategy("jagg_per_window", lambda p, w: LossStep(p, compiled_loss(p, w, backward="per_window")),
             per_window_cost, True, "@jagg_compile(window=W, backward='per_window')",
             cfg_cost=cfg_split(per_window_cost)),
    Strategy("jagg_lowmem", lambda p, w: LossStep(p, compiled_loss(p, w, backward="lowmem")),
             lowmem_cost, True, "@jagg_compile(window=W, backward='lowmem'): each window's backward in the forward",
             cfg_cost=cfg_split(lowmem_cost)),
    Strategy("jagg_guard", lambda p, w: LossStep(p, compiled_loss(p, w, guard=Guard(every=1))), guard_cost, True,
             "@jagg_compile(window=W, weights='t', guard=Guard(every=1)): every call probed against the exact "
             "gradient; at every=k the overhead is 1/k of its difference to jagg@W"),
    Strategy("jagg_fast", RolloutCachedStep, fast_cost, True,
             "@jagg_compile(window=W, options=Options(rollout_cache=cache)): interior outputs from the rollout",
             cfg_cost=fast_cost),
)}


@dataclass(frozen=True)
class Mode:
    strategy: Strategy
    window: int | None

    @property
    def name(self) -> str:
        return self.strategy.name if self.window is None else f"{self.strategy.name}@{self.window}"


def parse_mode(text: str) -> Mode:
    """"exact", "jagg@4", "jagg_split_knots@4", ..."""
    name, _, window = text.partition("@")
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose from {sorted(STRATEGIES)}")
    strategy = STRATEGIES[name]
    if strategy.windowed != bool(window):
        raise ValueError(f"mode {text!r}: {name} {'needs' if strategy.windowed else 'takes no'} a window (@W)")
    return Mode(strategy, int(window) if window else None)
