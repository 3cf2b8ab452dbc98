"""The online guard (``jaggc.Guard``) measured: does it agree with calibrate, and does adapt earn a default?

    python -m jaggc_studies.fidelity.guard_study [--bases digits,shapes,textures] [--trainables all]
        [--batches 64] [--iterations 160] [--every 1] [--json PATH] [--out docs/guard_study.md]

1. Agreement (``agreement``): on each base, the bias study's frozen start (warm-started trainer, θ0
   frozen) and ``batches`` on-policy rollout minibatches; each batch goes once through
   ``jagg_compile(grpo_loss, window=4, weights="t", guard=Guard(every=1, probes=N))`` (a real
   ``loss.backward()``) and once through calibrate's estimator (``estimators.record/exact/estimate``
   with ``Setting("jagg", 4, "t")``, accumulated by ``calibrate.ErrorStats``). Reported: the largest
   per-batch |cos_guard − cos_calibrate| and both bias/floor ratios over the N batches.
2. A GRPO run (``grpo_run``): the Flow-GRPO trainer with plain JAGG (``weights="t"``) and
   ``Guard(every, on_drift="adapt", probes=64)`` for ``iterations`` iterations (two loss calls each);
   reported: the probe at which the guard adapted (if it did), which σ ranges it moved to exact
   windows, every block's figures (the first block is plain JAGG, later ones the adapted estimator),
   the DiT backward passes per iteration before and after adapting, the reward curve.
3. The referee (``referee``): at the run's final parameters, the bias study's own measurement
   (``study.FrozenStart`` at those parameters, ``referee_batches`` rollouts, conditions on and off1)
   of plain JAGG, of the estimator the guard adapted to, and of the σ-aware default.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
import warnings
from pathlib import Path

import torch

from jaggc.fidelity import estimators as E
from jaggc.fidelity.calibrate import BIAS_LIMIT, ErrorStats


def _trainer(base: str, trainable: str, strategy: str = "exact", guard=None, seed: int = 0):
    from jaggc_studies.digits.trainer import GRPOTrainer, TrainerConfig
    from jaggc_studies.fidelity.study import named_base

    dit, kwargs = named_base(base)
    config = TrainerConfig(strategy=strategy, weights="t", seed=seed, trainable=trainable)
    return GRPOTrainer(copy.deepcopy(dit), config, guard=guard, **kwargs)


def agreement(base: str, trainable: str = "all", batches: int = 64, warmup: int = 2, log=print) -> dict:
    """Part 1 of the module docstring."""
    import jaggc
    from jaggc_studies.digits.trainer import grpo_loss
    from jaggc_studies.fidelity.study import FrozenStart

    frozen = FrozenStart(_trainer(base, trainable), warmup)
    dit = frozen.trainer.dit
    params = [p for p in dit.parameters() if p.requires_grad]
    probes = []
    guard = jaggc.Guard(every=1, probes=batches, on_drift="warn", on_probe=probes.append)
    loss_fn = jaggc.jagg_compile(grpo_loss, window=4, weights="t", guard=guard)
    setting = E.Setting("jagg", 4, "t")
    stats = ErrorStats()
    gaps, start = [], time.perf_counter()
    for r in range(batches):
        batch = frozen.minibatches(1000 + r)[0]
        for p in params:
            p.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(dit, batch)[0].backward()
        rec = E.record(grpo_loss, dit, batch)
        exact = E.exact(rec, dit).grad
        est = E.estimate(rec, dit, setting)
        stats.add([est], exact)
        gaps.append(abs(probes[-1].cosine - E.cosine(est.grad, exact)))
        if (r + 1) % 16 == 0:
            log(f"  {base}/{trainable} agreement: {r + 1}/{batches} batches ({time.perf_counter() - start:.0f} s)")
    for p in params:
        p.grad = None
    row = stats.row(setting)
    block = guard.history[-1]["figures"] if guard.history else guard.last_figures
    return dict(base=base, trainable=trainable, batches=batches, max_cosine_gap=max(gaps),
                guard_cosine_mean=block["cosine_mean"], calibrate_cosine_mean=row["cosine_mean"],
                guard_bias_over_floor=block["bias_over_floor"], calibrate_bias_over_floor=row["bias_over_floor"],
                seconds=time.perf_counter() - start)


def grpo_run(base: str, trainable: str = "all", iterations: int = 160, every: int = 1, probes: int = 64,
             log=print) -> tuple[dict, object]:
    """Part 2 of the module docstring; returns (result, trainer)."""
    import jaggc

    guard = jaggc.Guard(every=every, probes=probes, on_drift="adapt")
    trainer = _trainer(base, trainable, strategy="jagg", guard=guard)
    rewards, passes, adapted_at, curve = [], [], None, []
    start = time.perf_counter()
    for it in range(iterations):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            entry = trainer.step()
        if adapted_at is None and guard.exact_ranges:
            adapted_at = dict(iteration=it, probes=guard.probed, message=str(caught[-1].message) if caught else "")
        rewards.append(entry["reward_mean"])
        passes.append(entry["backward_passes"])
        curve.append(dict(iteration=it, reward=entry["reward_mean"], **guard.log()))
        if (it + 1) % 20 == 0:
            log(f"  {base}/{trainable} GRPO+guard: iteration {it + 1}/{iterations}, reward {entry['reward_mean']:.3f}, "
                f"probes {guard.probed}, exact ranges {sorted(guard.exact_ranges)} ({time.perf_counter() - start:.0f} s)")
    split = adapted_at["iteration"] + 1 if adapted_at else iterations
    blocks = [dict(probes=b["probes"], cosine_mean=b["figures"]["cosine_mean"],
                   bias_over_floor=b["figures"]["bias_over_floor"], reasons=b["reasons"], action=b["action"],
                   ranges={v["label"]: v["bias_over_floor"] for v in b["figures"]["ranges"].values()})
              for b in guard.history]
    result = dict(base=base, trainable=trainable, iterations=iterations, every=every, probes_per_block=probes,
                  adapted_at=adapted_at, exact_ranges=[guard.ranges[r] for r in sorted(guard.exact_ranges)],
                  blocks=blocks, passes_before=_mean(passes[:split]), passes_after=_mean(passes[split:]),
                  reward_first=_mean(rewards[:10]), reward_last=_mean(rewards[-10:]), curve=curve,
                  seconds=time.perf_counter() - start)
    return result, trainer


def referee(trainer, exact_ranges, rollouts: int = 32, log=print) -> dict:
    """Part 3: the bias study's measurement at the trainer's current parameters."""
    from jaggc.runtime.weights import noise_levels
    from jaggc_studies.digits.trainer import grpo_loss
    from jaggc_studies.fidelity.study import FrozenStart

    trainer.loss_fn = grpo_loss          # the protocol's optimizer steps take the exact gradient
    frozen = FrozenStart(trainer, warmup=0)
    dit = trainer.dit
    stats = {c: {k: ErrorStats() for k in ("jagg", "adapted", "sigma_aware")} for c in ("on", "off1")}
    start = time.perf_counter()
    for r, cond, mb in frozen.measured_batches(rollouts, ("on", "off1")):
        rec = E.record(grpo_loss, dit, mb)
        exact = E.exact(rec, dit).grad
        windows = E.windows_of(rec, 4)
        lowest = [float(noise_levels(rec.times[idx]).min()) for idx in windows]
        adapted = tuple(w for w, s in enumerate(lowest) if any(lo <= s < hi or (hi >= 1 and s >= lo)
                                                               for lo, hi in exact_ranges))
        sigma_aware = tuple(w for w, s in enumerate(lowest) if s < 0.5)
        for key, ex in (("jagg", ()), ("adapted", adapted), ("sigma_aware", sigma_aware)):
            stats[cond][key].add([E.jagg(rec, dit, window=4, exact_windows=ex)], exact)
        if cond == "off1" and (r + 1) % 8 == 0:
            log(f"  referee: {r + 1}/{rollouts} rollouts ({time.perf_counter() - start:.0f} s)")
    out = {}
    for cond, by in stats.items():
        for key, s in by.items():
            row = s.row(E.Setting("jagg", 4, "t"))
            out[f"{cond}/{key}"] = dict(cosine_mean=row["cosine_mean"], bias_over_floor=row["bias_over_floor"],
                                        backward_fraction=row["backward_fraction"])
    return out


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan


def to_markdown(res: dict) -> str:
    lines = ["# The online guard, measured", "",
             f"Generated by `python -m jaggc_studies.fidelity.guard_study {res['argv']}` (method in its docstring); "
             f"{res['threads']} thread(s), {res['seconds']:.0f} s.", "",
             "## 1. Guard vs calibrate on the same batches (plain JAGG, W = 4, on-policy at the frozen start)", "",
             "| base/trainable | N | max per-batch cosine gap | cosine mean guard / calibrate | bias/floor guard / calibrate |",
             "|---|---|---|---|---|"]
    for a in res["agreement"]:
        lines.append(f"| {a['base']}/{a['trainable']} | {a['batches']} | {a['max_cosine_gap']:.1e} | "
                     f"{a['guard_cosine_mean']:.4f} / {a['calibrate_cosine_mean']:.4f} | "
                     f"{a['guard_bias_over_floor']:.3f} / {a['calibrate_bias_over_floor']:.3f} |")
    lines += ["", "## 2. GRPO with plain JAGG and `Guard(on_drift='adapt')`", "",
              "| base/trainable | adapted at probe (iteration) | exact σ ranges | blocks: bias/floor (cosine) | "
              "DiT backward passes / iteration before → after | reward first 10 → last 10 |", "|---|---|---|---|---|---|"]
    for g in res["runs"]:
        at = g["adapted_at"]
        blocks = "; ".join(f"{b['bias_over_floor']:.2f} ({b['cosine_mean']:.3f})" + (" → adapt" if b["action"] and
                                                                                     b["action"].startswith("exact") else "")
                           for b in g["blocks"])
        when = "never" if at is None else f"{at['probes']} ({at['iteration']})"
        lines.append(f"| {g['base']}/{g['trainable']} | {when} | "
                     f"{', '.join(f'[{lo:g},{hi:g})' for lo, hi in g['exact_ranges']) or '—'} | {blocks} | "
                     f"{g['passes_before']:.1f} → {_fmt(g['passes_after'])} | {g['reward_first']:.3f} → {g['reward_last']:.3f} |")
    lines += ["", "## 3. Referee: the bias study's measurement at each run's final parameters", "",
              "| base/trainable | condition | plain JAGG bias/floor (cos) | adapted | σ-aware default |", "|---|---|---|---|---|"]
    for g in res["runs"]:
        ref = g.get("referee") or {}
        for cond in ("on", "off1"):
            if f"{cond}/jagg" not in ref:
                continue
            cells = [f"{ref[f'{cond}/{k}']['bias_over_floor']:.2f} ({ref[f'{cond}/{k}']['cosine_mean']:.3f})"
                     for k in ("jagg", "adapted", "sigma_aware")]
            lines.append(f"| {g['base']}/{g['trainable']} | {cond} | " + " | ".join(cells) + " |")
    lines += ["", f"Rule: bias/floor ≤ {BIAS_LIMIT} (the bias study's); N rollouts per referee cell: "
              f"{res['referee_batches']}.", ""]
    return "\n".join(lines)


def _fmt(x):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bases", default="digits,shapes,textures")
    p.add_argument("--trainables", default="all")
    p.add_argument("--batches", type=int, default=64, help="agreement: batches per base (N)")
    p.add_argument("--iterations", type=int, default=160, help="GRPO iterations per run (two loss calls each)")
    p.add_argument("--every", type=int, default=1, help="the run's Guard(every=...)")
    p.add_argument("--referee-batches", type=int, default=32)
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    res = dict(argv=" ".join(argv) if argv is not None else "", threads=args.threads, agreement=[], runs=[],
               referee_batches=args.referee_batches)

    def dump():
        res["seconds"] = time.perf_counter() - start
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))

    for base in args.bases.split(","):
        for trainable in args.trainables.split(","):
            if not args.skip_agreement:
                res["agreement"].append(agreement(base, trainable, args.batches))
                print(json.dumps(res["agreement"][-1]))
                dump()
            run, trainer = grpo_run(base, trainable, args.iterations, args.every)
            if args.referee_batches:
                run["referee"] = referee(trainer, run["exact_ranges"], args.referee_batches)
            res["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "curve"}))
            dump()
    dump()
    text = to_markdown(res)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
