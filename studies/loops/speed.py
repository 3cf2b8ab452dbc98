"""The trainers' loops with ``jaggc.stepwise``, timed against the unchanged loop, beside a cost model.

Variants of each loop (``variants``): the unchanged loop; ``jaggc.stepwise(window=4, weights="t")``
per backward form ("joint", "lowmem", "per_window"); with the CFG slice (``cfg_slice=True``: the
loops that call the DiT on ``[uncond; cond]``, Flow-GRPO); and on-policy with the rollout cache
(``rollout_cache=True``, and the slice where there is CFG), each epoch sampled by the trainer's own
sampler (``rollouts.py``) right before it is trained, against the unchanged loop trained right after
its own sampling. Off-policy variants train the setup's stored samples (one optimizer step per epoch
moves the parameters away from them).

Timing: one epoch of the loop per round, every variant once per round in a rotated order, process
CPU time, one thread; the sampling is timed apart (``rollout_s``: what recording the rollout costs).
Ratios: unchanged / variant, median and range over the rounds.

The cost model (``cost_model``) prices what each variant runs per window of W trained steps with
this machine's measured forward F and backward B of one step's call as the loop makes it (the CFG
batch; and, for the slice, Fh and Bh of its half), R the KL reference forward (Flow-GRPO; = F):

| variant | JAGG window (W >= 3) | exact step |
|---|---|---|
| unchanged | W (F + B + R) | F + B + R |
| joint, lowmem in σ order | W F + 2 B + W R | F + B + R |
| per_window, lowmem out of order | (W + 2) F + 2 B + W R | F + B + R |
| + slice, held knots | (W - 2) F + 4 Fh + 2 Bh + W R | 2 Fh + Bh + R |
| + slice, re-run knots | W F + 2 Fh + 2 Bh + W R | 2 Fh + Bh + R |
| + cache (on-policy), held knots | 2 Fh + 2 Bh + W R (no CFG: 2 F + 2 B) | Fh + Bh + R (F + B) |
| + cache, re-run knots | 2 Fh + 2 Bh + W R (no CFG: 2 F + 2 B) | Fh + Bh + R (F + B) |

(a re-run knot's forward at its own step is no-grad, so the cache serves it whole).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

import jaggc
from jaggc.runtime.module_state import unwrap
from jaggc.testing import cuda_autocast_on_cpu
from jaggc_studies.bench.device import CudaPeakMemory, SyncedClock
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg, rollouts
from jaggc_studies.trainers.sizes import Where

FORMS = ("joint", "lowmem", "per_window")
WINDOW = 4


@dataclass(frozen=True)
class LoopSetup:
    """How a loop is built, trained, sampled, and what its trajectories look like to jaggc."""

    setup: Callable              # setup(stepwise=...) -> run
    unchanged: Callable
    changed: Callable
    sample: Callable             # sample(run, seed=...): the trainer's sampling epoch
    windows: tuple[int, ...]     # the trained steps of one trajectory, as W=4 windows cut them
    cfg: bool                    # the DiT call is [uncond; cond] (the CFG slice applies)
    reference: bool              # a KL reference forward per step
    in_order: bool               # the steps come in σ order (lowmem holds its knots)


def loop_setup(name: str, where: Where) -> LoopSetup:
    """The loop ``name`` on ``where`` (trainers/sizes.py). The Flux loops' latents are 8 x 8 packed
    tokens at 10m (64: 16 tokens leave a CPU latency-bound, where a backward costs 1.25 forwards
    instead of the 2 it costs at 64 tokens and beyond, and at the thousands of a real image), 4 x 4
    on the tiny model, FLUX.1-dev's at ``where.resolution`` for the published one."""
    side = 8 if where.size == "10m" else 4
    if name == "flow_grpo":
        # Flow-GRPO's SD3 configs: 10 sampling steps, timestep_fraction 0.99 (9 trained: windows 4, 4, 1)
        return LoopSetup(lambda **kw: fg.setup(num_steps=9, batch=2, trajectories=1, where=where, **kw),
                         fg.train_unchanged, fg.train_jaggc, rollouts.flow_grpo_epoch, (4, 4, 1), cfg=True,
                         reference=True, in_order=True)
    if name == "dance_grpo":
        # its finetune_flux_grpo.sh: 16 sampling steps (15 stored), 60% trained (9: windows of 4, 4, 1),
        # an optimizer step every 4 samples, gradient checkpointing
        return LoopSetup(lambda **kw: dg.setup(num_steps=15, samples=4, fraction=0.6, gradient_accumulation_steps=4,
                                               checkpointing=True, side=side, where=where, **kw),
                         dg.train_unchanged, dg.train_jaggc, rollouts.dance_grpo_epoch, (4, 4, 1), cfg=False,
                         reference=False, in_order=False)
    # its 4-step window at the start of the run, an optimizer step every 3 samples
    return LoopSetup(lambda **kw: mg.setup(samples=3, gradient_accumulation_steps=3, side=side, where=where, **kw),
                     mg.train_unchanged, mg.train_jaggc, rollouts.mix_grpo_epoch, (4,), cfg=False, reference=False,
                     in_order=True)


def on_cuda(where: Where) -> bool:
    return torch.device(where.device).type == "cuda"


def clock(where: Where) -> Callable[[], float]:
    """Process CPU time on the CPU (one thread: stable on a shared machine); on CUDA the wall clock
    read after the device finished its queued work."""
    return SyncedClock(where.device) if on_cuda(where) else time.process_time


@contextlib.contextmanager
def run_on(where: Where):
    """Where the loops run: one thread on the CPU, quiet; a half-precision run on the CPU is the
    trainers' GPU form (their CUDA autocast blocks made live CPU blocks, ``cuda_autocast_on_cpu``)."""
    threads = torch.get_num_threads()
    gpu_form = not on_cuda(where) and where.dtype in (torch.bfloat16, torch.float16)
    with quiet(), (cuda_autocast_on_cpu() if gpu_form else contextlib.nullcontext()):
        if not on_cuda(where):
            torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def variants(loop: LoopSetup, forms=FORMS) -> dict[str, tuple[dict | None, bool]]:
    """label -> (the stepwise keywords or None for the unchanged loop, on-policy)."""
    out: dict[str, tuple[dict | None, bool]] = {"unchanged": (None, False), "unchanged/on-policy": (None, True)}
    for form in forms:
        base = dict(window=WINDOW, weights="t", backward=form)
        out[form] = (base, False)
        if loop.cfg:
            out[f"{form}/slice"] = (dict(base, cfg_slice=True), False)
        out[f"{form}/cache"] = (dict(base, cfg_slice=loop.cfg, rollout_cache=True), True)
        if form == "joint":
            # every trajectory probed by the guard: what a probed trajectory costs beside an unprobed
            # one (at Guard(every=8) an eighth of it, amortised)
            out[f"{form}/probe"] = (dict(base, guard=jaggc.Guard(every=1, probes=10**9)), False)
    return out


def baseline(label: str) -> str:
    if label.endswith("/probe"):
        return label.rsplit("/", 1)[0]
    return "unchanged/on-policy" if label.endswith("/cache") else "unchanged"


def guard_overhead(ratio: float, every: int = 8) -> float:
    """The amortised time a ``Guard(every=every)`` adds to a trajectory, from the measured ratio
    unprobed / probed: (t_probed - t) / (every t)."""
    return (1.0 / ratio - 1.0) / every


def quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def epoch(loop: LoopSetup, run, on_policy: bool, seed: int, changed: bool,
          now: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """One epoch (sampled first when on-policy): (sampling s, training s) on the clock ``now``."""
    start = now()
    if on_policy:
        loop.sample(run, seed=seed)
    sampled = now()
    (loop.changed if changed else loop.unchanged)(run)
    return sampled - start, now() - sampled


def speed(name: str, where: Where, *, rounds: int = 5, forms=FORMS) -> dict:
    """Interleaved rounds of every variant (module docstring): per variant the seconds per
    trajectory, the ratio to its unchanged baseline and, on CUDA, the training epoch's peak memory."""
    loop = loop_setup(name, where)
    now = clock(where)
    with run_on(where):
        table = variants(loop, forms)
        runs = {label: loop.setup(stepwise=kw) if kw is not None else loop.setup() for label, (kw, _) in table.items()}
        for warm in range(2):          # the first trajectories' one-off costs; the slice learned
            for label, (kw, on_policy) in table.items():
                epoch(loop, runs[label], on_policy, seed=100 + warm, changed=kw is not None, now=now)
        train = {label: [] for label in table}
        sample = {label: [] for label in table}
        peak = {}
        order = list(table)
        for r in range(rounds):
            for label in order[r % len(order):] + order[:r % len(order)]:
                kw, on_policy = table[label]
                meter = CudaPeakMemory(where.device) if on_cuda(where) and r == 0 else contextlib.nullcontext()
                with meter:
                    s, t = epoch(loop, runs[label], on_policy, seed=r, changed=kw is not None, now=now)
                if isinstance(meter, CudaPeakMemory):
                    peak[label] = meter.peak_bytes
                sample[label].append(s)
                train[label].append(t)
        counts = {label: vars(jaggc.stepwise(run.transformer).counts).copy()
                  for label, run in runs.items() if table[label][0] is not None}
        for label, run in runs.items():
            if table[label][0] is not None:
                jaggc.stepwise(run.transformer).close()
        costs = cost_model(name, where, forms)
    trajectories = _trajectories(runs["unchanged"])
    costs = with_shared_costs(costs, statistics.median(train["unchanged"]) / trajectories)
    ratios = {label: [u / v for u, v in zip(train[baseline(label)], train[label])]
              for label in table if not label.startswith("unchanged")}
    model = runs["unchanged"].transformer
    return dict(model=f"{type(unwrap(model)).__name__}-{where.size}", device=str(where.device),
                dtype=str(where.dtype).removeprefix("torch."), clock="wall, synchronised" if on_cuda(where) else
                "process CPU", params=sum(p.numel() for p in model.parameters()),
                trainable=sum(p.numel() for p in model.parameters() if p.requires_grad), rounds=rounds,
                median={k: statistics.median(v) for k, v in ratios.items()},
                min={k: min(v) for k, v in ratios.items()}, max={k: max(v) for k, v in ratios.items()},
                seconds_per_trajectory={k: statistics.median(v) / trajectories for k, v in train.items()},
                rollout_s={k: statistics.median(v) for k, v in sample.items() if table[k][1]},
                cuda_peak_bytes=peak, counts=counts, cost_model=costs)


def whole_epoch(name: str, where: Where, *, rounds: int = 5, form: str = "joint") -> dict:
    """An epoch as the trainer runs it, sampling included: the unchanged loop against stepwise with
    the slice (where there is CFG) and the rollout cache, interleaved rounds. Flow-GRPO's epoch is
    two sample batches with an optimizer step after each (its gradient_accumulation_steps of half
    the batches per epoch): the first trains on-policy (the cache serves), the second after the
    step (the cache is stale, every forward runs); DanceGRPO's and MixGRPO's epochs step once, after
    all their samples: every sample on-policy."""
    loop = loop_setup(name, where)
    if name == "flow_grpo":
        loop = LoopSetup(lambda **kw: fg.setup(num_steps=9, batch=2, trajectories=2, where=where,
                                               config=fg.TrainConfig(gradient_accumulation_steps=1), **kw),
                         loop.unchanged, loop.changed, loop.sample, loop.windows, loop.cfg, loop.reference,
                         loop.in_order)
    now = clock(where)
    kw = dict(window=WINDOW, weights="t", backward=form, cfg_slice=loop.cfg, rollout_cache=True)
    with run_on(where):
        runs = {"unchanged": loop.setup(), "stepwise": loop.setup(stepwise=kw)}
        for label, run in runs.items():
            epoch(loop, run, True, seed=100, changed=label == "stepwise", now=now)      # warm; the slice learned
        times = {label: [] for label in runs}
        for r in range(rounds):
            for label in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                s, t = epoch(loop, runs[label], True, seed=r, changed=label == "stepwise", now=now)
                times[label].append((s, t))
        counts = vars(jaggc.stepwise(runs["stepwise"].transformer).counts).copy()
        jaggc.stepwise(runs["stepwise"].transformer).close()
    train = [u[1] / v[1] for u, v in zip(times["unchanged"], times["stepwise"])]
    whole = [sum(u) / sum(v) for u, v in zip(times["unchanged"], times["stepwise"])]
    return dict(variant=f"{form}" + ("/slice" if loop.cfg else "") + "/cache", rounds=rounds,
                training=dict(median=statistics.median(train), min=min(train), max=max(train)),
                epoch=dict(median=statistics.median(whole), min=min(whole), max=max(whole)),
                seconds={k: [statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)]
                         for k, v in times.items()}, counts=counts)


@contextlib.contextmanager
def ledger_marks_off():
    """Measurement only: the ledger's negative-zero marks (steps/ledger.py ``GradMarks``) as no-ops.
    Without them the ledger cannot see a ``zero_grad`` or a clip of a gradient that was None or zero
    while a step's gradient is withheld, so no run goes without them; the loops here never do either
    inside a window, so the gradient is the same and the difference is what the marks cost."""
    from jaggc.steps import ledger

    mark, unmark = ledger.GradMarks.mark, ledger.GradMarks.unmark
    ledger.GradMarks.mark = ledger.GradMarks.unmark = lambda self: None
    try:
        yield
    finally:
        ledger.GradMarks.mark, ledger.GradMarks.unmark = mark, unmark


def ledger_ab(name: str, where: Where, *, rounds: int = 5, form: str = "joint") -> dict:
    """The ledger's share of a stepwise trajectory: the off-policy ``form`` with the ledger's marks on
    (as jaggc runs) and off (``ledger_marks_off``), interleaved rounds, process CPU time; the same
    rounds time the unchanged loop, so both ratios come with the cost model's."""
    loop = loop_setup(name, where)
    now = clock(where)
    kw = dict(window=WINDOW, weights="t", backward=form)
    with run_on(where):
        runs = {"unchanged": loop.setup(), "marks on": loop.setup(stepwise=kw), "marks off": loop.setup(stepwise=kw)}

        def one(label: str, seed: int) -> float:
            with ledger_marks_off() if label == "marks off" else contextlib.nullcontext():
                return epoch(loop, runs[label], False, seed=seed, changed=label != "unchanged", now=now)[1]

        for label in runs:
            one(label, 100)                   # warm
        times: dict[str, list[float]] = {label: [] for label in runs}
        order = list(runs)
        for r in range(rounds):
            for label in order[r % len(order):] + order[:r % len(order)]:
                times[label].append(one(label, r))
        for label in ("marks on", "marks off"):
            jaggc.stepwise(runs[label].transformer).close()
        costs = cost_model(name, where, (form,))
    share = [1.0 - off / on for on, off in zip(times["marks on"], times["marks off"])]
    speedup = {label: [u / v for u, v in zip(times["unchanged"], times[label])] for label in ("marks on", "marks off")}
    return dict(loop=name, form=form, rounds=rounds, marks_share=dict(median=statistics.median(share), min=min(share),
                                                                      max=max(share)),
                speedup={k: dict(median=statistics.median(v), min=min(v), max=max(v)) for k, v in speedup.items()},
                seconds_per_trajectory={k: statistics.median(v) / _trajectories(runs[k]) for k, v in times.items()},
                cost_model=costs)


def guard_cost(name: str, where: Where, *, rounds: int = 5, every: int = 8) -> dict:
    """What ``Guard(every=every)`` adds to the joint form, amortised: the joint form with every
    trajectory probed (``Guard(every=1)``) against the unprobed one, interleaved rounds."""
    loop = loop_setup(name, where)
    now = clock(where)
    kw = dict(window=WINDOW, weights="t", backward="joint")
    with run_on(where):
        runs = {"joint": loop.setup(stepwise=kw),
                "probed": loop.setup(stepwise=dict(kw, guard=jaggc.Guard(every=1, probes=10**9)))}
        for label in runs:
            epoch(loop, runs[label], False, seed=100, changed=True, now=now)
        times: dict[str, list[float]] = {label: [] for label in runs}
        for r in range(rounds):
            for label in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                times[label].append(epoch(loop, runs[label], False, seed=r, changed=True, now=now)[1])
        for run in runs.values():
            jaggc.stepwise(run.transformer).close()
    overhead = [guard_overhead(u / v, every) for u, v in zip(times["joint"], times["probed"])]
    return dict(loop=name, every=every, rounds=rounds,
                overhead=dict(median=statistics.median(overhead), min=min(overhead), max=max(overhead)),
                seconds_per_trajectory={k: statistics.median(v) / _trajectories(runs[k]) for k, v in times.items()})


def _trajectories(run) -> int:
    return len(run.samples_batched) if hasattr(run, "samples_batched") else len(run.samples_batched_list)


# --- the cost model ------------------------------------------------------------------------------

def unit_costs(name: str, where: Where) -> dict:
    """F and B (and, for a CFG loop, Fh and Bh of its half batch) of one step's call, as the loop
    makes it, on this machine: median of 5 on the loop's clock (call it inside ``run_on``)."""
    loop = loop_setup(name, where)
    now = clock(where)
    run = loop.setup()
    calls = {"": _one_call(name, run)}
    if loop.cfg:
        calls["h"] = _one_call(name, run, half=True)
    out = {}
    for suffix, call in calls.items():
        g = torch.randn_like(call())

        def median_s(fn, n=5):
            fn()
            ts = []
            for _ in range(n):
                t = now()
                fn()
                ts.append(now() - t)
            return statistics.median(ts)

        with torch.no_grad():
            forward = median_s(call)
        both = median_s(lambda: call().backward(g))
        out["F" + suffix], out["B" + suffix] = forward, max(both - forward, 1e-9)
    return out


def cost_model(name: str, where: Where, forms=FORMS, units: dict | None = None) -> dict:
    """Each variant's modelled ratio to the unchanged loop (module docstring's table), and the units."""
    loop = loop_setup(name, where)
    u = units if units is not None else unit_costs(name, where)
    f, b = u["F"], u["B"]
    fh, bh = u.get("Fh", f), u.get("Bh", b)
    r = f if loop.reference else 0.0

    def trajectory(label: str) -> float:
        if label.startswith("unchanged"):
            return sum(w * (f + b + r) for w in loop.windows)
        form, _, extra = label.partition("/")
        held = form == "joint" or (form == "lowmem" and loop.in_order)
        total = 0.0
        for w in loop.windows:
            if w <= 2:                                   # an exact window: every step as written (or sliced)
                if extra == "cache":
                    step = (fh + bh if loop.cfg else f + b) + r
                elif extra == "slice":
                    step = 2 * fh + bh + r
                else:
                    step = f + b + r
                total += w * step
            elif extra == "cache":
                total += (2 * fh + 2 * bh if loop.cfg else 2 * f + 2 * b) + w * r
            elif extra == "slice":
                total += ((w - 2) * f + 4 * fh if held else w * f + 2 * fh) + 2 * bh + w * r
            else:
                total += (w if held else w + 2) * f + 2 * b + w * r
        return total

    labels = variants(loop, forms)
    # a probed trajectory adds one backward of each JAGG window's W steps (in-window probe: steps/probe.py)
    probe = sum(w * b for w in loop.windows if w > 2)
    seconds = {label: trajectory(baseline(label)) + probe if label.endswith("/probe") else trajectory(label)
               for label in labels}
    ratio = {label: seconds[baseline(label)] / seconds[label] for label in labels if not label.startswith("unchanged")}
    return dict(units=u, ratio=ratio, seconds=seconds)


def with_shared_costs(costs: dict, unchanged_s: float) -> dict:
    """The cost model with what the loop runs besides its DiT passes: the unchanged loop's measured
    seconds per trajectory minus its modelled passes (the loss and log-prob arithmetic, the clip and
    optimizer steps, Python; and any misfit of F and B measured on one call alone), which every
    variant runs as well. ``ratio_with_shared``: (U + c) / (V + c); measured / that ratio is then
    what jaggc's own work and its backward's structure cost beyond the passes it runs."""
    shared = max(unchanged_s - costs["seconds"]["unchanged"], 0.0)
    ratio = {label: (costs["seconds"][baseline(label)] + shared) / (costs["seconds"][label] + shared)
             for label in costs["ratio"]}
    return dict(costs, shared_s=shared, ratio_with_shared=ratio)


def _one_call(name: str, run, half: bool = False) -> Callable:
    """One step's DiT call of the loop, as it calls it (the CFG batch for Flow-GRPO; ``half``: its cond rows)."""
    if name == "flow_grpo":
        s = run.samples_batched[0]
        copies = 1 if half else 2
        embeds = torch.cat([run.train_neg_prompt_embeds[:len(s["prompt_embeds"])], s["prompt_embeds"]])[-copies * len(s["prompt_embeds"]):]
        pooled = torch.cat([run.train_neg_pooled_prompt_embeds[:len(s["pooled_prompt_embeds"])],
                            s["pooled_prompt_embeds"]])[-copies * len(s["pooled_prompt_embeds"]):]
        return lambda: run.transformer(hidden_states=torch.cat([s["latents"][:, 0]] * copies),
                                       timestep=torch.cat([s["timesteps"][:, 0]] * copies), encoder_hidden_states=embeds,
                                       pooled_projections=pooled, return_dict=False)[0]
    s = run.samples_batched_list[0]
    guidance = torch.tensor([3.5], device=s["latents"].device)

    def call():
        with torch.autocast("cuda", torch.bfloat16):        # the trainers' block around the Flux call
            return run.transformer(hidden_states=s["latents"][:, 0], encoder_hidden_states=s["encoder_hidden_states"],
                                   timestep=s["timesteps"][:, 0] / 1000, guidance=guidance,
                                   txt_ids=s["text_ids"], pooled_projections=s["pooled_prompt_embeds"],
                                   img_ids=s["image_ids"], return_dict=False)[0]
    return call


__all__ = ["FORMS", "LoopSetup", "baseline", "clock", "guard_cost", "guard_overhead", "ledger_ab", "ledger_marks_off", "whole_epoch", "cost_model", "with_shared_costs", "epoch", "loop_setup", "on_cuda", "run_on", "speed",
           "unit_costs", "variants"]


def main(argv=None) -> None:
    """``python -m jaggc_studies.loops.speed {ledger,guard} --loops dance_grpo,mix_grpo --rounds 5``."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["ledger", "guard"], help="ledger: the marks' A/B; guard: Guard(every=8)'s cost")
    p.add_argument("--loops", default="flow_grpo,dance_grpo,mix_grpo")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", default="10m")
    args = p.parse_args(argv)
    for name in args.loops.split(","):
        fn = ledger_ab if args.what == "ledger" else guard_cost
        print(json.dumps(fn(name, Where(args.size), rounds=args.rounds), default=str), flush=True)


if __name__ == "__main__":
    main()
