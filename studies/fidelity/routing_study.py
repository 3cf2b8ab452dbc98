"""Does the routing score (docs/fidelity.md) predict how well JAGG approximates a window?

    python -m jaggc_studies.fidelity.routing_study [--bases digits,shapes] [--rollouts 16] [--steps 10,25]
                                           [--conditions on,off1] [--json PATH] [--out PATH]

For every window w of a batch (windows of ≥ 3 steps; shorter ones always run exact) two numbers:

- the routing score s_w = ``estimators.routing_scores(rec, W, weights)[w]``: the minimum over the
  window's interior steps of cos(v_k − v_a, α_k (v_b − v_a)), from the DiT outputs alone (what a
  router can compute before any backward pass);
- the window's gradient fidelity c_w = cos(ĝ_w, g_w): ``g_w = Σ_{k∈w} J_kᵀ g_k`` is the window's exact
  contribution to the gradient, ``ĝ_w`` JAGG's estimate of it (two knots, the same upstream
  gradients; ``estimators.basis_estimate`` on that window alone), both sums of VJPs.

Rank correlations (Spearman, average ranks for ties) between s and c:
- ``within``: per batch across its windows, then the mean over batches (needs ≥ 3 windows per batch
  to mean anything: at T = 10, W = 4 there are two JAGG windows, so there ``top1`` — the fraction of
  batches whose lowest-score window is also the lowest-fidelity one — is the within-batch test;
  chance is 1 / #windows);
- ``pooled``: over every (batch, window) pair (mixes window position into it);
- ``by position``: per window index across batches, then the mean over positions (position held
  fixed: does the score see which batches are hard at that place of the trajectory?).

Batches follow ``jaggc_studies.fidelity.study``'s protocol (GRPOTrainer with warm-up iterations, the
trainer's rollout, reward and group-normalised advantages; ``on``: minibatch 1 at θ0, ``off1``: one
real optimizer step on minibatch 1, then minibatch 2; θ restored after every rollout).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch

from jaggc.fidelity import estimators as E
from jaggc.runtime import Basis


def ranks(x) -> torch.Tensor:
    """Ranks 1..n of ``x`` (float64), ties get their average rank."""
    x = torch.as_tensor(x, dtype=torch.float64).reshape(-1)
    order = torch.argsort(x, stable=True)
    r = torch.empty_like(x)
    r[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    for v in torch.unique(x):
        tie = x == v
        if int(tie.sum()) > 1:
            r[tie] = r[tie].mean()
    return r


def spearman(x, y) -> float:
    """Spearman rank correlation of two equal-length sequences; nan if either is constant or n < 2."""
    x, y = ranks(x), ranks(y)
    if len(x) != len(y):
        raise ValueError(f"lengths differ: {len(x)} vs {len(y)}")
    if len(x) < 2:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    den = float(x.norm() * y.norm())
    return float(x.dot(y)) / den if den > 0 else float("nan")


def window_fidelity(rec: E.Recording, dit, *, window: int, weights: str = "t") -> list[dict]:
    """Per JAGG window (≥ 3 steps) of one recorded batch: its steps, routing score, the cosine and
    relative error of JAGG's estimate of the window's gradient contribution to the exact one, and
    the window's exact contribution norm."""
    scores = E.routing_scores(rec, window, weights)
    basis = Basis("linear", weights)
    out = []
    for w, idx in enumerate(E.windows_of(rec, window)):
        if len(idx) <= 2:
            continue
        exact_plan, jagg_plan = E._Plan(rec), E._Plan(rec)
        exact_plan.exact_steps(idx)
        jagg_plan.basis_window(idx, basis)
        g_w = exact_plan.run(dit, "exact-window").grad
        est = jagg_plan.run(dit, "jagg-window").grad
        out.append(dict(window=w, steps=list(idx), score=scores[w], cos=E.cosine(est, g_w),
                        rel=E.rel_error(est, g_w), norm=float(g_w.norm())))
    return out


def correlations(batches: list[list[dict]]) -> dict:
    """Rank statistics between score and cos over ``batches`` (each a ``window_fidelity`` list)."""
    within = [spearman([r["score"] for r in b], [r["cos"] for r in b]) for b in batches if len(b) >= 3]
    within = [x for x in within if not math.isnan(x)]
    multi = [b for b in batches if len(b) >= 2]
    top1 = [float(min(b, key=lambda r: r["score"])["window"] == min(b, key=lambda r: r["cos"])["window"])
            for b in multi]
    pooled = spearman([r["score"] for b in batches for r in b], [r["cos"] for b in batches for r in b])
    positions = sorted({r["window"] for b in batches for r in b})
    by_pos, per_pos = [], {}
    for w in positions:
        rows = [r for b in batches for r in b if r["window"] == w]
        rho = spearman([r["score"] for r in rows], [r["cos"] for r in rows])
        per_pos[w] = dict(steps=rows[0]["steps"], n=len(rows), rho=rho,
                          score_mean=sum(r["score"] for r in rows) / len(rows),
                          cos_mean=sum(r["cos"] for r in rows) / len(rows),
                          cos_min=min(r["cos"] for r in rows))
        if not math.isnan(rho):
            by_pos.append(rho)
    n_windows = max((len(b) for b in batches), default=0)
    return dict(batches=len(batches), windows_per_batch=n_windows,
                within=sum(within) / len(within) if within else float("nan"), within_n=len(within),
                top1=sum(top1) / len(top1) if top1 else float("nan"),
                top1_chance=1.0 / n_windows if n_windows else float("nan"),
                pooled=pooled, by_position=sum(by_pos) / len(by_pos) if by_pos else float("nan"),
                positions=per_pos)


def run_routing_study(*, base: str = "digits", rollouts: int = 16, num_steps: int = 10, window: int = 4,
                      weights: str = "t", conditions=("on", "off1"), warmup: int = 2, seed: int = 0,
                      log=print) -> dict:
    """The per-window (score, cosine) pairs and their rank statistics for one base and config."""
    from jaggc_studies.digits.trainer import GRPOTrainer, TrainerConfig, grpo_loss

    from jaggc_studies.fidelity.study import FrozenStart, named_base

    torch.manual_seed(seed)
    dit0, tkw = named_base(base)
    cfg = TrainerConfig(strategy="exact", seed=seed, num_steps=num_steps, window=window)
    dit = copy.deepcopy(dit0)
    trainer = GRPOTrainer(dit, cfg, **tkw)
    bad = [c for c in conditions if c not in ("on", "off1")]
    if bad:
        raise ValueError(f"condition {bad[0]!r}: use on / off1")
    frozen = FrozenStart(trainer, warmup)
    per_cond: dict[str, list[list[dict]]] = {c: [] for c in conditions}
    start = time.perf_counter()
    for r, cond, mb in frozen.measured_batches(rollouts, conditions):
        rec = E.record(grpo_loss, dit, mb)
        per_cond[cond].append(window_fidelity(rec, dit, window=window, weights=weights))
        if cond == conditions[-1]:
            log(f"  {base} T={num_steps} W={window}: rollout {r + 1}/{rollouts} ({time.perf_counter() - start:.0f} s)")
    return dict(base=base, num_steps=num_steps, window=window, weights=weights, rollouts=rollouts, warmup=warmup,
                conditions={c: dict(stats=correlations(b), batches=b) for c, b in per_cond.items()})


def _f(x, nd=2):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def to_markdown(results: list[dict]) -> str:
    lines = ["| base | T | W | data | N | windows / batch | within-batch ρ | top-1 (chance) | pooled ρ "
             "| by-position ρ |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for cond, c in res["conditions"].items():
            s = c["stats"]
            lines.append(f"| {res['base']} | {res['num_steps']} | {res['window']} | {cond} | {s['batches']} | "
                         f"{s['windows_per_batch']} | {_f(s['within'])} | {_f(s['top1'])} ({_f(s['top1_chance'])}) "
                         f"| {_f(s['pooled'])} | {_f(s['by_position'])} |")
    lines += ["", "Per window position (mean score, mean (min) JAGG window cosine, ρ across batches):", "",
              "| base | T | W | data | window steps | score | cos mean (min) | ρ |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for cond, c in res["conditions"].items():
            for w, p in c["stats"]["positions"].items():
                steps = p["steps"]
                lines.append(f"| {res['base']} | {res['num_steps']} | {res['window']} | {cond} | "
                             f"{steps[0]}–{steps[-1]} | {_f(p['score_mean'], 3)} | {_f(p['cos_mean'], 3)} "
                             f"({_f(p['cos_min'])}) | {_f(p['rho'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaggc_studies.fidelity.routing_study", description=__doc__.splitlines()[0])
    p.add_argument("--bases", default="digits,shapes")
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--steps", default="10,25", help="comma list of sampling-step counts T")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--weights", default="t")
    p.add_argument("--conditions", default="on,off1")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="write the markdown tables here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for base in args.bases.split(","):
        for T in (int(x) for x in args.steps.split(",")):
            results.append(run_routing_study(base=base, rollouts=args.rollouts, num_steps=T, window=args.window,
                                             weights=args.weights, conditions=tuple(args.conditions.split(",")),
                                             warmup=args.warmup, seed=args.seed))
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    md = to_markdown(results)
    print(md)
    if args.out:
        Path(args.out).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
