"""jaggc's own per-trajectory work in a per-step loop, measured against the DiT passes it runs.

One trajectory of W = 4 steps of a plain per-step loop (``v = dit(z_k, t_k); (v * g_k).sum().backward()``)
on the digits DiT (``jaggc_studies.digits``: SD3 at 0.58M parameters, batch 64) and on deeper copies of
it (more parameter tensors, same width), timed three ways, interleaved, process CPU time, one thread:

* ``exact``: the unchanged loop, W (F + B);
* ``jaggc``: ``jaggc.stepwise(dit, window=W, weights="t")`` (joint): W forwards (the interior ones
  without grad) and one backward per knot, 2 B;
* ``predicted``: those passes alone, timed on their own: 2 (F + B) + (W − 2) F_nograd.

``jaggc − predicted`` is jaggc's bookkeeping (the plan, the ledger's snapshots and marks, the
taps, the safety checks); divided by the parameter tensors it says how it grows with them.

    python -m jaggc_studies.loops.bookkeeping --layers 4,8,16 --rounds 7 [--profile]
    python -m jaggc_studies.loops.bookkeeping --layers 4 --wide 8 --batch 16   # the digits-wide base's DiT
    python -m jaggc_studies.loops.bookkeeping --layers 4 --wide 8 --batch 16 --direct --rounds 5
    python -m jaggc_studies.loops.bookkeeping --layers 4 --wide 8 --batch 16 --direct --rounds 5 --iteration blocks

``--wide K``: the feed-forwards widened K times (``jaggc_studies.fewsteps.wide``, the few-step study's
``digits-wide`` base at K = 8); ``--batch``: the rows per pass (16: that study's minibatch).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
import warnings

import torch

import jaggc
from jaggc_studies.digits.model import DIGITS_CONFIG, build_dit, class_conditioning

WINDOW = 4
BATCH = 64


def problem(layers: int, seed: int = 0, wide: int = 1, trainable: str | None = None):
    """(DiT, conditioning, states, upstream gradients, noise levels); ``trainable``: the digits trainer's
    trained set (``trainable_parameters``: "attention", "blocks"), None: every parameter."""
    dit = build_dit(seed=seed, config=dict(DIGITS_CONFIG, num_layers=layers))
    if wide > 1:
        from jaggc_studies.fewsteps.wide import widen_feedforward

        widen_feedforward(dit, wide)
    if trainable is not None:
        from jaggc_studies.digits.trainer import trainable_parameters

        trainable_parameters(dit, trainable)
    g = torch.Generator().manual_seed(seed + 1)
    labels = torch.arange(BATCH) % 10
    cond = class_conditioning(labels)
    zs = torch.randn(WINDOW, BATCH, 1, 8, 8, generator=g)
    gs = torch.randn(WINDOW, BATCH, 1, 8, 8, generator=g)
    sigmas = torch.linspace(0.9, 0.3, WINDOW)
    return dit, cond, zs, gs, sigmas


def trajectory(dit, cond, zs, gs, sigmas, *, stepwise: bool) -> None:
    """The loop as a trainer writes it; with ``stepwise`` the one added line declares the steps."""
    ts = (1000 * sigmas)[:, None].expand(WINDOW, BATCH)
    steps = jaggc.stepwise(dit).steps(range(WINDOW), ts.T) if stepwise else range(WINDOW)
    for k in steps:
        v = dit(hidden_states=zs[k], timestep=ts[k], return_dict=False, **cond)[0]
        (v * gs[k]).sum().backward()
    dit.zero_grad()


def passes(dit, cond, zs, gs, sigmas) -> None:
    """The DiT passes the joint form runs for one W-step window: 2 (F + B) + (W − 2) F without grad, and
    the loop's own loss backward at the interior steps (a backward call through the loss alone, which the
    loop makes at every step with or without jaggc)."""
    ts = (1000 * sigmas)[:, None].expand(WINDOW, BATCH)
    for k in (0, WINDOW - 1):
        v = dit(hidden_states=zs[k], timestep=ts[k], return_dict=False, **cond)[0]
        (v * gs[k]).sum().backward()
    for k in range(1, WINDOW - 1):
        with torch.no_grad():
            v = dit(hidden_states=zs[k], timestep=ts[k], return_dict=False, **cond)[0]
        (v.requires_grad_() * gs[k]).sum().backward()
    dit.zero_grad()


def measure(layers: int, rounds: int, wide: int = 1) -> dict:
    dit, cond, zs, gs, sigmas = problem(layers, wide=wide)
    twin, *_ = problem(layers, wide=wide)
    jaggc.stepwise(twin, window=WINDOW, weights="t")
    runs = {"exact": lambda: trajectory(dit, cond, zs, gs, sigmas, stepwise=False),
            "jaggc": lambda: trajectory(twin, cond, zs, gs, sigmas, stepwise=True),
            "predicted": lambda: passes(dit, cond, zs, gs, sigmas)}
    for fn in runs.values():
        for _ in range(2):
            fn()                                   # warm
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(rounds):
        for label in order[r % 3:] + order[:r % 3]:
            start = time.process_time()
            for _ in range(5):
                runs[label]()
            times[label].append((time.process_time() - start) / 5)
    jaggc.stepwise(twin).close()
    median = {k: statistics.median(v) for k, v in times.items()}
    extra = [j - p for j, p in zip(times["jaggc"], times["predicted"])]
    tensors = sum(1 for p in dit.parameters() if p.requires_grad)
    return dict(layers=layers, wide=wide, batch=BATCH, params=sum(p.numel() for p in dit.parameters()), tensors=tensors,
                ms={k: 1e3 * v for k, v in median.items()}, bookkeeping_ms=1e3 * statistics.median(extra),
                bookkeeping_range_ms=[1e3 * min(extra), 1e3 * max(extra)],
                per_tensor_us=1e6 * statistics.median(extra) / tensors)


def direct(layers: int, wide: int = 1, trajectories: int = 40, rounds: int = 5, iteration=None,
           trainable: str | None = None) -> dict:
    """jaggc's own time per trajectory, timed inside the loops themselves (low noise: no difference of two
    loops' totals). Per loop, its process time minus the time inside the DiT's forward (every call: the
    loop's, jaggc's interior ones without grad) and inside the DiT's backward passes: for the unchanged loop
    each step's ``backward()``, for jaggc's the ``torch.autograd.backward`` nested in the loop's backward
    (its joint backward). The unchanged loop's remainder is the loop's own work (the loss ops, ``zero_grad``,
    Python); jaggc's bookkeeping is its loop's remainder minus that (it still holds the autograd engine's
    entry for each step's ``backward()`` through jaggc's tap, tens of microseconds each). Median over
    ``rounds`` rounds of ``trajectories`` trajectories of each loop, interleaved. ``iteration``: a callable
    returning one training iteration's CPU seconds (``study_iteration``), timed twice per round between the
    loops: the bookkeeping's share of an iteration is then measured in one run, on one machine state.
    ``trainable``: the loops train that set (``problem``), as the study's iteration does."""
    clock = {"forward": 0.0, "outer": 0.0, "inner": 0.0}
    depth = [0]
    real_backward = torch.autograd.backward

    def timed_backward(*args, **kwargs):
        depth[0] += 1
        start = time.process_time()
        try:
            return real_backward(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] < 2:                          # 0: a step's backward() returned; 1: one nested in it
                clock["outer" if depth[0] == 0 else "inner"] += time.process_time() - start

    def timed(dit):
        inner_forward = dit.forward

        def timed_forward(*args, **kwargs):
            start = time.process_time()
            try:
                return inner_forward(*args, **kwargs)
            finally:
                clock["forward"] += time.process_time() - start

        dit.forward = timed_forward                   # before the install: jaggc's original forward is it
        return dit

    unchanged, cond, zs, gs, sigmas = problem(layers, wide=wide, trainable=trainable)
    unchanged = timed(unchanged)
    twin = timed(problem(layers, wide=wide, trainable=trainable)[0])
    jaggc.stepwise(twin, window=WINDOW, weights="t")
    own = {"unchanged": [], "jaggc": []}
    iterations = []
    torch.autograd.backward = timed_backward
    try:
        for r in range(rounds + 1):
            for label, dit in (("unchanged", unchanged), ("jaggc", twin))[::1 if r % 2 else -1]:
                clock.update(forward=0.0, outer=0.0, inner=0.0)
                start = time.process_time()
                for _ in range(trajectories):
                    trajectory(dit, cond, zs, gs, sigmas, stepwise=label == "jaggc")
                total = time.process_time() - start
                dit_backward = clock["outer"] if label == "unchanged" else clock["inner"]
                if r:                                 # round 0 warms up
                    own[label].append((total - clock["forward"] - dit_backward) / trajectories)
            if iteration is not None:
                times = [iteration() for _ in range(2)]
                if r:
                    iterations += times
    finally:
        torch.autograd.backward = real_backward
        jaggc.stepwise(twin).close()
    extra = [j - u for j, u in zip(own["jaggc"], own["unchanged"])]
    out = dict(layers=layers, wide=wide, batch=BATCH, tensors=sum(1 for p in twin.parameters() if p.requires_grad),
               loop_own_ms=1e3 * statistics.median(own["unchanged"]), jaggc_own_ms=1e3 * statistics.median(own["jaggc"]),
               bookkeeping_ms=1e3 * statistics.median(extra), bookkeeping_range_ms=[1e3 * min(extra), 1e3 * max(extra)])
    if iterations:
        # the study runs one trajectory per minibatch, two minibatches per iteration
        out.update(iteration_s=statistics.median(iterations), iteration_range_s=[min(iterations), max(iterations)],
                   share_of_iteration=2 * statistics.median(extra) / statistics.median(iterations))
    return out


def study_iteration(trainable: str, schedule: str = "mix4+jagg4"):
    """One iteration of ``jaggc study fewsteps --base digits-wide`` training ``schedule`` (rollout, reward,
    two minibatches through ``jaggc.stepwise``), as a callable returning its CPU seconds. The bookkeeping
    loops then train the same set (``direct(trainable=...)``: ``attention`` 62 parameter tensors, ``blocks`` 106,
    of 122)."""
    from jaggc_studies.fewsteps.bases import load_base
    from jaggc_studies.fewsteps.schedules import parse_schedule
    from jaggc_studies.fewsteps.study import FewStepsOptions
    from jaggc_studies.fewsteps.trainer import FewStepTrainer

    base, kwargs, _ = load_base("digits-wide")
    options = FewStepsOptions(base="digits-wide", trainable=trainable)
    trainer = FewStepTrainer(base, options.config(0), schedule=parse_schedule(schedule), **kwargs)
    return lambda: trainer.step()["cpu_s"]


def profile(layers: int, trajectories: int = 40, wide: int = 1) -> str:
    dit, cond, zs, gs, sigmas = problem(layers, wide=wide)
    jaggc.stepwise(dit, window=WINDOW, weights="t")
    for _ in range(2):
        trajectory(dit, cond, zs, gs, sigmas, stepwise=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(trajectories):
        trajectory(dit, cond, zs, gs, sigmas, stepwise=True)
    pr.disable()
    jaggc.stepwise(dit).close()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main(argv=None) -> None:
    global BATCH
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,8,16", help="the digits DiT's depth (4: the shipped model)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile", action="store_true", help="cProfile jaggc's trajectories at the first depth")
    p.add_argument("--wide", type=int, default=1, help="widen the feed-forwards K times (digits-wide: 8)")
    p.add_argument("--batch", type=int, default=BATCH, help="rows per pass")
    p.add_argument("--direct", action="store_true", help="jaggc's own time timed inside its loop (direct())")
    p.add_argument("--iteration", choices=("attention", "blocks"),
                   help="with --direct: the loops train this set, and the digits-wide study's mix4+jagg4 iteration "
                        "training it is timed interleaved: the bookkeeping's share of it")
    args = p.parse_args(argv)
    BATCH = args.batch
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        depths = [int(x) for x in args.layers.split(",")]
        for layers in depths:
            if args.direct:
                iteration = study_iteration(args.iteration) if args.iteration else None
                print(json.dumps(direct(layers, args.wide, rounds=args.rounds, iteration=iteration,
                                        trainable=args.iteration)), flush=True)
            else:
                print(json.dumps(measure(layers, args.rounds, args.wide)), flush=True)
        if args.profile:
            print(profile(depths[0], wide=args.wide))


if __name__ == "__main__":
    main()
