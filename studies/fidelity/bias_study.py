"""Which setting is unbiased enough to be the default: bias and cosine of the candidates on every base.

    python -m jaggc_studies.fidelity.bias_study [--rollouts 64] [--bases digits,shapes,textures]
                                        [--trainables attention,all] [--json PATH] [--out docs/bias_study.md]
                                        [--candidates a,b] [--merge EARLIER.json]

The protocol of ``study.run_study`` (warm-started trainer, N rollouts at a frozen θ0, group-centred
advantages, real AdamW steps) on each base (digits SD3, shapes Flux, textures Qwen-Image) with the
attention projections or every parameter trained, in three conditions: on-policy (the first inner
step), after one and after four real optimizer steps. Candidates, each with step subsampling at
its own expected backward budget:

  plain JAGG (W=4, and W=3); σ-aware placement (exact below t = 500) at W = 4, 5 and 6; the
  randomized third knot at W = 6;
  the control-variate correction (``Basis("control")``: JAGG, plus (exact − JAGG)/p on a random
  fraction p of windows) at W = 4, p = 0.25 and W = 6, p = 0.25; the same correction drawn per
  interior step (``per="step"``) at W = 4 and W = 6, p = 0.25.

``choose`` applies the default's rule: the cheapest candidate whose bias is within 1.5x its noise
floor in every cell (with ``MARGIN`` to spare) and whose mean cosine beats its subsampling
baseline in every cell.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from jaggc.fidelity import estimators as E
from jaggc.fidelity.calibrate import BIAS_LIMIT
from jaggc_studies.fidelity.study import named_base, run_study

S = E.Setting
CANDIDATES = {
    "jagg": S("jagg", 4, "t"),
    "sigma_aware": S("jagg", 4, "t", exact_below=500.0),
    "jagg_w3": S("jagg", 3, "t"),
    "sigma_aware_w5": S("jagg", 5, "t", exact_below=500.0),
    "sigma_aware_w6": S("jagg", 6, "t", exact_below=500.0),
    "random3_w6": S("random3", 6, "t"),
    "control_w4": S("control", 4, "t", p=0.25),
    "control_w6": S("control", 6, "t", p=0.25),
    "control_step_w4": S("control", 4, "t", p=0.25, per="step"),
    "control_step_w6": S("control", 6, "t", p=0.25, per="step"),
}
CONDITIONS = ("on", "off1", "off4")
# The default must meet the bias rule with this many floors to spare: a bias/floor ratio is itself
# measured with noise (a few tenths at N = 64), and a resolved bias's ratio grows as sqrt(N), so a
# candidate at the limit would fail the next measurement as often as not.
MARGIN = 0.1


def settings(names=None) -> list[E.Setting]:
    """The candidates (``names``: a subset) and their matched subsampling baselines (duplicates dropped)."""
    out: list[E.Setting] = []
    for s in (CANDIDATES[n] for n in (names or CANDIDATES)):
        for x in (s, E.matched_subsample_setting(s)):
            if x is not None and x.label() not in [o.label() for o in out]:
                out.append(x)
    return out


def run(bases, trainables, rollouts: int, draws: int = 2, log=print, dump: str | None = None,
        candidates=None) -> dict:
    from jaggc_studies.digits.trainer import TrainerConfig

    out = {"rollouts": rollouts, "draws": draws, "cells": {}}
    for base in bases:
        dit, kwargs = named_base(base)
        for trainable in trainables:
            start = time.perf_counter()
            config = TrainerConfig(strategy="exact", seed=0, trainable=trainable)
            res = run_study(rollouts=rollouts, conditions=CONDITIONS, settings=settings(candidates), draws=draws, warmup=2,
                            config=config, masks_for=(), base=dit, trainer_kwargs=kwargs,
                            log=lambda m: log(f"  {base}/{trainable}: {m.strip()}"))
            for cond, c in res["conditions"].items():
                out["cells"][f"{base}/{trainable}/{cond}"] = {row["setting"]: row for row in c["rows"]}
            log(f"{base}/{trainable}: {time.perf_counter() - start:.0f} s")
            if dump:
                Path(dump).write_text(json.dumps(out, indent=1))
    return out


def measured(results: dict) -> dict:
    """The candidates with a row (and a baseline row) in every cell of ``results``."""
    return {name: s for name, s in CANDIDATES.items()
            if all(s.label() in rows and E.matched_subsample_setting(s).label() in rows
                   for rows in results["cells"].values())}


def merge(results: dict, earlier: dict) -> dict:
    """``results`` with the rows of an earlier run on the same rollouts added (its own rows win)."""
    cells = {cell: {**earlier["cells"].get(cell, {}), **rows} for cell, rows in results["cells"].items()}
    return dict(results, cells=cells)


def verdicts(results: dict) -> dict:
    """Per candidate: worst bias / floor over the cells, the cells where it does not beat its
    subsampling baseline, its mean backward fraction, and whether it meets the default's rule."""
    out = {}
    for name, s in measured(results).items():
        base_label = E.matched_subsample_setting(s).label()
        worst, losses, fractions = 0.0, [], []
        for cell, rows in results["cells"].items():
            row, sub = rows[s.label()], rows[base_label]
            worst = max(worst, row["bias"] / row["floor"] if row["floor"] > 0 else float("inf"))
            fractions.append(row["backward_fraction"])
            if row["cos_mean"] <= sub["cos_mean"]:
                losses.append(cell)
        out[name] = dict(setting=s.label(), worst_bias_over_floor=worst, loses_to_subsampling=losses,
                         backward_fraction=sum(fractions) / len(fractions),
                         meets_rule=worst <= BIAS_LIMIT and not losses,
                         meets_rule_with_margin=worst <= BIAS_LIMIT - MARGIN and not losses)
    return out


def choose(results: dict) -> str | None:
    """The cheapest candidate meeting the rule with ``MARGIN`` to spare (None: none does)."""
    ok = {n: v for n, v in verdicts(results).items() if v["meets_rule_with_margin"]}
    return min(ok, key=lambda n: ok[n]["backward_fraction"]) if ok else None


def to_markdown(results: dict) -> str:
    lines = ["# Bias and fidelity of the default candidates", "",
             "Generated by `python -m jaggc_studies.fidelity.bias_study` (method in its docstring). N = "
             f"{results['rollouts']} rollouts per cell, {results['draws']} draws of the random estimators per batch. "
             "cos = mean per-batch cosine to the exact gradient; bias/floor = |mean error| over the noise floor of an "
             "unbiased estimator at this N (≈ 1 for an unbiased one); b = backward passes / trained steps; "
             "sub = step subsampling at the candidate's budget.", ""]
    shown = measured(results)
    head = "| cell | " + " | ".join(f"{n} cos (sub) | bias/floor | b" for n in shown) + " |"
    lines += [head, "|" + "---|" * (1 + 3 * len(shown))]
    for cell, rows in results["cells"].items():
        parts = []
        for s in shown.values():
            row, sub = rows[s.label()], rows[E.matched_subsample_setting(s).label()]
            parts += [f"{row['cos_mean']:.3f} ({sub['cos_mean']:.3f})", f"{row['bias'] / row['floor']:.2f}",
                      f"{row['backward_fraction']:.2f}"]
        lines.append(f"| {cell} | " + " | ".join(parts) + " |")
    lines += ["", f"| candidate | worst bias/floor | loses to subsampling in | b | meets the rule (≤ {BIAS_LIMIT}) | "
                  f"with {MARGIN} to spare |", "|---|---|---|---|---|---|"]
    for name, v in verdicts(results).items():
        losses = v["loses_to_subsampling"]
        lost = "every cell" if len(losses) == len(results["cells"]) else ", ".join(losses) or "—"
        lines.append(f"| {name} ({v['setting']}) | {v['worst_bias_over_floor']:.2f} | {lost} | "
                     f"{v['backward_fraction']:.2f} | {'yes' if v['meets_rule'] else 'no'} | "
                     f"{'yes' if v['meets_rule_with_margin'] else 'no'} |")
    lines += ["", f"Chosen (cheapest meeting the rule with {MARGIN} to spare): **{choose(results) or 'none'}**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--draws", type=int, default=2)
    p.add_argument("--bases", default="digits,shapes,textures")
    p.add_argument("--trainables", default="attention,all")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--candidates", default=None, help=f"a comma-separated subset of {', '.join(CANDIDATES)}")
    p.add_argument("--merge", default=None, help="add the rows of an earlier run's JSON (same rollouts)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.candidates.split(",") if args.candidates else None
    unknown = [n for n in names or () if n not in CANDIDATES]
    if unknown:
        p.error(f"--candidates: unknown {unknown}; choose from {list(CANDIDATES)}")
    res = run(args.bases.split(","), args.trainables.split(","), args.rollouts, args.draws, dump=args.json,
              candidates=names)
    if args.merge:
        res = merge(res, json.loads(Path(args.merge).read_text()))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    text = to_markdown(res)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
