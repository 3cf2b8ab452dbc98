"""Pick a JAGG setting from measured gradient fidelity and bias: ``jaggc.calibrate``.

For each candidate setting (window W, weights, jagg_frac, variant, optional σ-aware exact_below)
it measures, on a few stored batches, the cosine of the estimator's gradient to the exact one, the
estimator's DiT backward fraction, and its **bias**: the norm of its mean error over the batches
against the noise floor, the mean error an unbiased estimator with the same per-batch spread would
show (``floor = sqrt(tr Cov(error) / N)``). A GRPO run averages gradients over many batches, so a
setting whose error does not average out is what training follows; one whose bias exceeds
``BIAS_LIMIT`` floors is flagged (``biased``) even if it wins on cosine. The same is measured for
random step subsampling at the same backward budget (the baseline any approximation must beat).

It recommends, by the rule that chose jagg_compile's default (``bias_study``), the cheapest
setting whose mean cosine reaches ``target_cosine``, that beats subsampling at its budget and is
not flagged biased (ties: the higher cosine); if none does, ``recommended`` is None and the advice
is exact training (``jagg_frac=0``). With few batches the floor is wide and little is flagged: bias
needs tens of batches to resolve (docs/fidelity.md measures it at N = 64).

The recommendation is only as good as the batches: pass batches from the training regime you will
run (on-policy first inner steps AND later, off-policy inner steps — JAGG's error grows once the
parameters leave the rollout's).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Sequence

import torch

from . import estimators as E

#: settings ``@jagg_compile`` can run (causal = Basis("constant"), lagrange = Basis("lagrange"),
#: random3 = Basis("randomized"), control = Basis("control"))
RUNNABLE = ("jagg", "causal", "lagrange", "random3", "control")
#: a setting whose mean error exceeds this many noise floors is flagged biased
BIAS_LIMIT = 1.5


def default_candidates(max_time: float | None = None) -> list[E.Setting]:
    """W ∈ {3, 4, 6} × {plain t, plain index, causal, lagrange} × jagg_frac ∈ {1, 0.5}, the σ-aware
    hybrids (exact below half the largest timestep: σ < 0.5 for timestep = 1000σ), and the unbiased
    ones: the control-variate correction per interior step (p = 0.25) at W ∈ {4, 6} and the
    randomized third knot at W = 6."""
    out = []
    t0 = None if max_time is None else 0.5 * max_time
    for w in (3, 4, 6):
        for variant, weights in (("jagg", "t"), ("jagg", "index"), ("causal", "t"), ("lagrange", "t")):
            if variant == "lagrange" and w < 4:
                continue
            for frac in (1.0, 0.5):
                out.append(E.Setting(variant, w, weights, frac))
            if t0 is not None:
                out.append(E.Setting(variant, w, weights, 1.0, exact_below=t0))
    out += [E.Setting("control", w, "t", p=0.25, per="step") for w in (4, 6)]
    out.append(E.Setting("random3", 6, "t"))
    return out


def _as_setting(c: Any) -> E.Setting:
    if isinstance(c, E.Setting):
        return c
    if isinstance(c, dict):
        return E.Setting(**c)
    raise TypeError(f"a candidate must be a jaggc.fidelity.Setting or a dict of its fields, not {type(c).__name__}")


class ErrorStats:
    """Running per-batch cosines, backward fractions and error moments of one setting."""

    def __init__(self):
        self.fracs, self.cosines = [], []
        self.err_sum = self.exact_sum = None
        self.err_sq = 0.0

    def add(self, ests: list, exact: torch.Tensor) -> None:
        n = len(ests)
        self.fracs.append(sum(e.backward_fraction for e in ests) / n)
        self.cosines.append(sum(E.cosine(e.grad, exact) for e in ests) / n)
        err = sum(e.grad for e in ests) / n - exact
        self.err_sum = err.clone() if self.err_sum is None else self.err_sum + err
        self.exact_sum = exact.clone() if self.exact_sum is None else self.exact_sum + exact
        self.err_sq += float(err.pow(2).sum())

    def bias(self) -> tuple[float, float]:
        """(|mean error|, noise floor), both over |mean exact gradient|; the floor is inf for one batch."""
        n = len(self.cosines)
        mean_exact = float(self.exact_sum.norm()) / n
        mean_err2 = float(self.err_sum.pow(2).sum()) / n ** 2
        if n < 2:
            return math.sqrt(mean_err2) / mean_exact, math.inf
        trcov = max(self.err_sq / n - mean_err2, 0.0) * n / (n - 1)
        return math.sqrt(mean_err2) / mean_exact, math.sqrt(trcov / n) / mean_exact

    def row(self, setting: E.Setting) -> dict:
        bias, floor = self.bias()
        return dict(window=setting.window, weights=setting.weights, jagg_frac=setting.jagg_frac,
                    variant=setting.variant, exact_below=setting.exact_below, label=setting.label(),
                    backward_fraction=sum(self.fracs) / len(self.fracs),
                    cosine_mean=sum(self.cosines) / len(self.cosines), cosine_min=min(self.cosines),
                    bias=bias, floor=floor, bias_over_floor=bias / floor if floor > 0 else math.inf,
                    biased=bias > BIAS_LIMIT * floor)


def calibrate(loss_fn: Callable, dit: torch.nn.Module, batch: Any, target_cosine: float = 0.95,
              candidates: Sequence[Any] | None = None, *, draws: int = 3, seed: int = 0,
              extras: Callable | None = None, states: Sequence[dict] | None = None) -> dict:
    """Measure candidates on ``batch`` (one batch or a list of batches) and recommend one.

    ``loss_fn(dit, batch)`` is the plain (uncompiled) GRPO loss; it may return the loss or a tuple
    whose first element is the loss. ``extras(recording, batch)`` fills what the ``denoised``
    variant needs (``jaggc_studies.fidelity.flow_grpo.flow_grpo_extras`` for the digits trainer's Flow-GRPO batches).
    ``states``: one ``dit`` state dict per batch, loaded before that batch is measured (batches
    taken at different parameters, e.g. after an optimizer step); ``dit`` is left at the last one.
    Returns ``{"settings": [...], "subsample": [...], "recommended": {...} | None, "target_cosine",
    "batches", "bias_limit", "note"}``; every row has window, weights, jagg_frac, variant,
    backward_fraction, cosine_mean, cosine_min (cosine to the exact gradient per batch; random
    estimators averaged over ``draws`` draws), bias, floor, bias_over_floor and biased."""
    batches = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    if states is not None and len(states) != len(batches):
        raise ValueError(f"states: {len(states)} state dicts for {len(batches)} batches")
    gen = torch.Generator().manual_seed(seed)
    settings = None
    stats: dict[str, ErrorStats] = {}
    for i, b in enumerate(batches):
        if states is not None:
            dit.load_state_dict(states[i])
        rec = E.record(loss_fn, dit, b)
        rec = extras(rec, b) if extras is not None else rec
        if settings is None:
            max_time = float(rec.times.max())
            settings = [_as_setting(c) for c in candidates] if candidates is not None else default_candidates(max_time)
            baselines = {s.label(): E.matched_subsample(rec, s) for s in settings}
            measured = settings + list({b.label(): b for b in baselines.values() if b is not None}.values())
        exact = E.exact(rec, dit).grad
        for s in measured:
            n = draws if s.variant in E.RANDOM_VARIANTS else 1
            stats.setdefault(s.label(), ErrorStats()).add([E.estimate(rec, dit, s, generator=gen) for _ in range(n)],
                                                          exact)
    rows = [stats[s.label()].row(s) for s in settings]
    subs = {label: stats[label].row(base) for label, base in
            {b.label(): b for b in baselines.values() if b is not None}.items()}
    for s, row in zip(settings, rows):
        base = baselines[s.label()]
        row["subsample_cosine_mean"] = None if base is None else subs[base.label()]["cosine_mean"]
        if base is not None:
            row["beats_subsample"] = row["cosine_mean"] > row["subsample_cosine_mean"]
    return _recommend(rows, list(subs.values()), target_cosine, len(batches))


def _recommend(rows: list[dict], subs: list[dict], target_cosine: float, batches: int) -> dict:
    """The cheapest setting meeting the target that beats subsampling and is not biased."""
    meeting = [r for r in rows if r["cosine_mean"] >= target_cosine]
    ok = [r for r in meeting if r.get("beats_subsample", True) and not r["biased"]]
    recommended = min(ok, key=lambda r: (r["backward_fraction"], -r["cosine_mean"])) if ok else None
    if recommended is not None:
        note = (f"cheapest candidate with mean cosine >= {target_cosine}, beating subsampling and within "
                f"{BIAS_LIMIT}x its noise floor: {recommended['label']}")
    else:
        note = (f"no candidate reaches mean cosine {target_cosine} while beating subsampling and staying within "
                f"{BIAS_LIMIT}x its noise floor on these batches: train exactly (routing=jaggc.Routing(jagg_frac=0)), or lower the target")
    flagged = [r["label"] for r in meeting if r["biased"]]
    if flagged:
        note += (f"; reach the target but biased (mean error > {BIAS_LIMIT}x the noise floor): "
                 + ", ".join(flagged))
    return dict(settings=rows, subsample=subs, recommended=recommended, target_cosine=target_cosine,
                batches=batches, bias_limit=BIAS_LIMIT, note=note)


def format_table(result: dict) -> str:
    lines = [f"{'setting':36s} {'b':>5s} {'cos mean':>9s} {'cos min':>8s} {'subsample':>9s} {'bias/floor':>10s}"]
    for r in sorted(result["settings"], key=lambda r: (r["backward_fraction"], -r["cosine_mean"])):
        sub = r.get("subsample_cosine_mean")
        ratio = r["bias_over_floor"]
        lines.append(f"{r['label']:36s} {r['backward_fraction']:5.2f} {r['cosine_mean']:9.3f} {r['cosine_min']:8.3f} "
                     f"{'' if sub is None else f'{sub:9.3f}':9s} {ratio:10.2f}" + ("  BIASED" if r["biased"] else ""))
    lines.append("")
    lines.append(f"{result['batches']} batches; bias/floor: |mean error| over the spread an unbiased estimator "
                 f"would show (inf with one batch); BIASED: above {result['bias_limit']}")
    lines.append(result["note"])
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


__all__ = ["BIAS_LIMIT", "RUNNABLE", "ErrorStats", "calibrate", "default_candidates", "format_table",
           "write_json"]
