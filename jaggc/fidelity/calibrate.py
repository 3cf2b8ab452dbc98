"""Pick a JAGG setting from measured gradient fidelity: ``jaggc.calibrate``.

For each candidate setting (window W, weights, jagg_frac, variant, optional σ-aware exact_below)
it measures, on a few stored batches, the cosine of the estimator's gradient to the exact one and
the estimator's DiT backward fraction, and the same for random subsampling at the same backward
budget (the baseline any approximation must beat). It recommends the cheapest setting whose mean
cosine reaches ``target_cosine`` (ties: the higher cosine); if none does, ``recommended`` is None
and the advice is exact training (``jagg_frac=0``).

The recommendation is only as good as the batches: pass batches from the training regime you will
run (on-policy first inner steps AND later, off-policy inner steps — JAGG's error grows once the
parameters leave the rollout's, docs/fidelity.md).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import torch

from . import estimators as E

#: settings ``@jagg_compile`` can run (causal = Basis("constant"), lagrange = Basis("lagrange"))
RUNNABLE = ("jagg", "causal", "lagrange")


def default_candidates(max_time: float | None = None) -> list[E.Setting]:
    """W ∈ {3, 4, 6} × {plain t, plain index, causal, lagrange} × jagg_frac ∈ {1, 0.5}, plus the
    σ-aware hybrids (exact below half the largest timestep: σ < 0.5 for timestep = 1000σ)."""
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
    return out


def _as_setting(c: Any) -> E.Setting:
    if isinstance(c, E.Setting):
        return c
    if isinstance(c, dict):
        return E.Setting(**c)
    raise TypeError(f"a candidate must be a jaggc.fidelity.Setting or a dict of its fields, not {type(c).__name__}")


def _row(setting: E.Setting, fracs: list[float], cosines: list[float]) -> dict:
    return dict(window=setting.window, weights=setting.weights, jagg_frac=setting.jagg_frac, variant=setting.variant,
                exact_below=setting.exact_below, label=setting.label(),
                backward_fraction=sum(fracs) / len(fracs), cosine_mean=sum(cosines) / len(cosines),
                cosine_min=min(cosines))


def calibrate(loss_fn: Callable, dit: torch.nn.Module, batch: Any, target_cosine: float = 0.95,
              candidates: Sequence[Any] | None = None, *, draws: int = 3, seed: int = 0,
              extras: Callable | None = None) -> dict:
    """Measure candidates on ``batch`` (one batch or a list of batches) and recommend one.

    ``loss_fn(dit, batch)`` is the plain (uncompiled) GRPO loss; it may return the loss or a tuple
    whose first element is the loss. ``extras(recording, batch)`` fills what the ``denoised``
    variant needs (``jaggc.fidelity.estimators.flow_grpo_extras`` for Flow-GRPO batches).
    Returns ``{"settings": [...], "subsample": [...], "recommended": {...} | None, "target_cosine",
    "batches", "note"}``; every row has window, weights, jagg_frac, variant, backward_fraction,
    cosine_mean, cosine_min (cosine to the exact gradient per batch; random estimators averaged
    over ``draws`` draws)."""
    batches = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    recs = []
    for b in batches:
        rec = E.record(loss_fn, dit, b)
        if extras is not None:
            rec = extras(rec, b)
        recs.append(rec)
    max_time = max(float(r.times.max()) for r in recs)
    settings = [_as_setting(c) for c in candidates] if candidates is not None else default_candidates(max_time)
    gen = torch.Generator().manual_seed(seed)
    exact = [E.exact(r, dit).grad for r in recs]

    def measure(s: E.Setting) -> dict:
        fracs, cosines = [], []
        n = draws if s.variant in E.RANDOM_VARIANTS else 1
        for rec, ref in zip(recs, exact):
            ests = [E.estimate(rec, dit, s, generator=gen) for _ in range(n)]
            fracs.append(sum(e.backward_fraction for e in ests) / n)
            cosines.append(sum(E.cosine(e.grad, ref) for e in ests) / n)
        return _row(s, fracs, cosines)

    rows = [measure(s) for s in settings]
    subs, seen = [], {}
    for s, row in zip(settings, rows):
        base = E.matched_subsample(recs[0], s)
        if base is None:
            row["subsample_cosine_mean"] = None
            continue
        if base.label() not in seen:
            seen[base.label()] = measure(base)
            subs.append(seen[base.label()])
        row["subsample_cosine_mean"] = seen[base.label()]["cosine_mean"]
        row["beats_subsample"] = row["cosine_mean"] > seen[base.label()]["cosine_mean"]
    meeting = [r for r in rows if r["cosine_mean"] >= target_cosine]
    recommended = min(meeting, key=lambda r: (r["backward_fraction"], -r["cosine_mean"])) if meeting else None
    if recommended is None:
        note = (f"no candidate reaches mean cosine {target_cosine} on these batches: train exactly "
                f"(jagg_frac=0), or lower the target")
    else:
        note = f"cheapest candidate with mean cosine >= {target_cosine}: {recommended['label']}"
        if recommended.get("beats_subsample") is False:
            note += " (random subsampling at the same backward budget measured higher)"
    return dict(settings=rows, subsample=subs, recommended=recommended, target_cosine=target_cosine,
                batches=len(batches), note=note)


def format_table(result: dict) -> str:
    lines = [f"{'setting':36s} {'b':>5s} {'cos mean':>9s} {'cos min':>8s} {'subsample':>9s}"]
    for r in sorted(result["settings"], key=lambda r: (r["backward_fraction"], -r["cosine_mean"])):
        sub = r.get("subsample_cosine_mean")
        lines.append(f"{r['label']:36s} {r['backward_fraction']:5.2f} {r['cosine_mean']:9.3f} {r['cosine_min']:8.3f} "
                     f"{'' if sub is None else f'{sub:9.3f}'}")
    lines.append("")
    lines.append(result["note"])
    return "\n".join(lines)


def digits_batches(num_batches: int = 2, *, seed: int = 0, warmup: int = 1, num_steps: int = 10) -> tuple:
    """Calibration batches for the digits example: per rollout, the trainer's first minibatch
    on-policy and its second minibatch after one real optimizer step (then θ is restored).
    Returns (dit, batches)."""
    import copy

    from jaggc.digits.model import load_base
    from jaggc.digits.trainer import GRPOTrainer, TrainerConfig

    from .study import FrozenStart

    config = TrainerConfig(strategy="exact", seed=seed, num_steps=num_steps)
    dit = load_base()
    trainer = GRPOTrainer(dit, config)
    frozen = FrozenStart(trainer, warmup)
    batches = []
    for r in range(num_batches):
        it = 2000 + r
        mbs = frozen.minibatches(it)
        batches.append(("on", mbs[0], copy.deepcopy(dit.state_dict())))
        trainer._optimize(mbs[0])
        batches.append(("off1", mbs[-1], copy.deepcopy(dit.state_dict())))
        frozen.restore()
    return dit, batches


def calibrate_digits(target_cosine: float = 0.95, num_batches: int = 2, seed: int = 0, candidates=None) -> dict:
    """``calibrate`` on the digits example, over on-policy and one-step-off-policy batches (each
    measured at its own parameters) — the per-batch cosines are pooled."""
    from jaggc.digits.trainer import grpo_loss

    dit, batches = digits_batches(num_batches, seed=seed)
    results = []
    for _, b, state in batches:
        dit.load_state_dict(state)
        results.append(calibrate(grpo_loss, dit, b, target_cosine, candidates, seed=seed,
                                 extras=E.flow_grpo_extras))
    return merge(results, target_cosine)


def merge(results: list[dict], target_cosine: float) -> dict:
    """Pool per-batch results of ``calibrate`` runs with the same candidates (mean of means,
    min of mins) and redo the recommendation."""
    def pool(key):
        out = []
        for rows in zip(*(r[key] for r in results)):
            row = dict(rows[0])
            row["backward_fraction"] = sum(r["backward_fraction"] for r in rows) / len(rows)
            row["cosine_mean"] = sum(r["cosine_mean"] for r in rows) / len(rows)
            row["cosine_min"] = min(r["cosine_min"] for r in rows)
            if row.get("subsample_cosine_mean") is not None:
                row["subsample_cosine_mean"] = sum(r["subsample_cosine_mean"] for r in rows) / len(rows)
                row["beats_subsample"] = row["cosine_mean"] > row["subsample_cosine_mean"]
            out.append(row)
        return out

    settings, subs = pool("settings"), pool("subsample")
    meeting = [r for r in settings if r["cosine_mean"] >= target_cosine]
    recommended = min(meeting, key=lambda r: (r["backward_fraction"], -r["cosine_mean"])) if meeting else None
    note = (f"cheapest candidate with mean cosine >= {target_cosine}: {recommended['label']}" if recommended else
            f"no candidate reaches mean cosine {target_cosine}: train exactly (jagg_frac=0), or lower the target")
    if recommended is not None and recommended.get("beats_subsample") is False:
        note += " (random subsampling at the same backward budget measured higher)"
    return dict(settings=settings, subsample=subs, recommended=recommended, target_cosine=target_cosine,
                batches=sum(r["batches"] for r in results), note=note)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


__all__ = ["RUNNABLE", "calibrate", "calibrate_digits", "default_candidates", "digits_batches", "format_table",
           "merge", "write_json"]
