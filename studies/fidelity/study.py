"""JAGG gradient fidelity on the trained digits DiT under realistic GRPO conditions.

    python -m jaggc_studies.fidelity.study [--quick] [--out docs/fidelity.md] [--json PATH]

Conditions (jaggc_studies.digits.trainer, its default TrainerConfig unless changed):
- a GRPOTrainer (strategy exact, AdamW at the trainer's lr, grad clipping) runs ``warmup``
  iterations from the pretrained base, so Adam's moments are warm; its state is then frozen as θ0;
- each of N rollouts: the trainer's rollout at θ0, the classifier reward, advantages normalised
  within same-prompt groups (the trainer's flow_grpo_advantages), split into the trainer's
  minibatches. ``on``: estimators on minibatch 1 at θ0 (the first inner step: ratio 1).
  ``off1``: one real optimizer step on minibatch 1 (exact gradient, clipping, AdamW), then the
  estimators on minibatch 2 (the trainer's second inner step). ``off4`` (if not --quick): three
  more real steps (minibatches 2, 1, 2) before measuring on minibatch 2 again. θ is restored to θ0
  (model and optimizer) after every rollout, so all rollouts estimate the same expected gradient.
- per batch: cosine and relative error of each estimator to that batch's exact gradient; random
  estimators (subsample, random3) averaged over ``draws`` draws (cosine per draw, then mean);
- bias over the N rollouts: e_r = est_r − exact_r; |ē| / |mean exact| against the noise floor
  sqrt(tr Cov(e) / N) / |mean exact| (what |ē| would be for an unbiased estimator), the debiased
  bias sqrt(max(|ē|² − trCov/N, 0)) / |mean exact|, and the exact gradient's own split-half
  disagreement |Ē_1 − Ē_2| / |Ē| (halves of the rollouts).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Sequence

import torch

from jaggc.fidelity import estimators as E

from jaggc_studies.fidelity.flow_grpo import flow_grpo_extras
from jaggc_studies.fidelity.frozen_start import FrozenStart

GROUPS = (("patch", ("pos_embed", "proj_out")), ("attention", (".attn.",)), ("mlp", (".ff.", ".ff_context.")),
          ("adaLN", ("norm1", "norm_out")), ("embed", ("time_text_embed", "context_embedder")))


def param_groups(dit) -> dict[str, torch.Tensor]:
    """Boolean masks over the flat trainable-parameter vector, one per parameter group."""
    masks = {g: [] for g, _ in GROUPS}
    for name, p in dit.named_parameters():
        if not p.requires_grad:
            continue
        group = next((g for g, keys in GROUPS if any(k in name for k in keys)), "embed")
        for g in masks:
            masks[g].append(torch.full((p.numel(),), g == group))
    return {g: torch.cat(m) for g, m in masks.items()}


def main_settings(window: int = 4, t0: float = 500.0, full: bool = False) -> list[E.Setting]:
    """The estimators of the main table. ``full`` adds the σ-aware hybrids of every variant, routing
    (jagg_frac 0.5) and the wider hat spacing."""
    S = E.Setting
    out = [
        S("jagg", window, "t"), S("jagg", window, "index"), S("subsample", window, k=2),
        S("denoised", window, "t"), S("hat", spacing=2),
        S("jagg", window, "t", exact_below=t0), S("subsample", window, k=2, exact_below=t0),
        S("causal", window), S("subsample", window, k=1),
        S("lagrange", window, "t"), S("random3", window, "t"), S("subsample", window, k=3),
    ]
    if full:
        out += [S("jagg", window, "t", jagg_frac=0.5), S("denoised", window, "t", exact_below=t0),
                S("causal", window, exact_below=t0), S("subsample", window, k=1, exact_below=t0), S("hat", spacing=3),
                S("extrapolate", window)]
    return out


_BASE = []
BASES = ("digits", "shapes", "textures")


def _base():
    """The pretrained digits DiT, loaded once per process (loading imports diffusers: ~20 s)."""
    if not _BASE:
        from jaggc_studies.digits.model import load_base

        _BASE.append(load_base())
    return _BASE[0]


def named_base(name: str = "digits"):
    """(pretrained DiT, extra GRPOTrainer kwargs) of a shipped base: ``digits`` (SD3 DiT on sklearn
    digits, the trainer's defaults), ``shapes`` (tiny Flux DiT on generated shapes) or ``textures``
    (tiny Qwen-Image DiT on generated textures), each with its own reward classifier, classes and
    conditioning (``jaggc_studies.shapes.trainer_kwargs``, ``jaggc_studies.textures.trainer_kwargs``)."""
    if name == "digits":
        return _base(), {}
    if name == "shapes":
        import jaggc_studies.shapes as shapes

        return shapes.load_base(), shapes.trainer_kwargs()
    if name == "textures":
        import jaggc_studies.textures as textures

        return textures.load_base(), textures.trainer_kwargs()
    raise ValueError(f"base={name!r}: use one of {BASES}")


class Accumulator:
    """Streaming per-batch metrics and bias sums for one (condition, setting)."""

    def __init__(self):
        self.cos, self.rel, self.bfs = [], [], []
        self.n = 0
        self.sum_e = None
        self.sum_e2 = 0.0
        self.group_cos: dict[str, list[float]] = {}

    def add(self, est_list: list[E.Estimate], ref: torch.Tensor, masks: dict | None = None):
        self.bfs += [e.backward_fraction for e in est_list]
        self.cos.append(sum(E.cosine(e.grad, ref) for e in est_list) / len(est_list))
        self.rel.append(sum(E.rel_error(e.grad, ref) for e in est_list) / len(est_list))
        mean = sum(e.grad for e in est_list) / len(est_list)
        err = mean - ref
        self.sum_e = err.clone() if self.sum_e is None else self.sum_e + err
        self.sum_e2 += float(err.dot(err))
        self.n += 1
        if masks:
            for g, m in masks.items():
                if not bool(m.any()):
                    continue
                self.group_cos.setdefault(g, []).append(
                    sum(E.cosine(e.grad[m], ref[m]) for e in est_list) / len(est_list))


def _bias(acc: Accumulator, mean_exact_norm: float) -> dict:
    n = acc.n
    ebar = acc.sum_e / n
    e2 = float(ebar.dot(ebar))
    trcov = (acc.sum_e2 - n * e2) / max(n - 1, 1)
    floor2 = trcov / n
    return dict(bias=math.sqrt(e2) / mean_exact_norm, floor=math.sqrt(max(floor2, 0)) / mean_exact_norm,
                debiased=math.copysign(math.sqrt(abs(e2 - floor2)), e2 - floor2) / mean_exact_norm)


def run_study(*, rollouts: int = 32, conditions=("on", "off1"), settings=None, draws: int = 3, warmup: int = 2,
              config=None, masks_for=("jagg/W4/t", "subsample/W4/2of4"), seed: int = 0, log=print, base=None,
              dump: str | None = None, trainer_kwargs: dict | None = None) -> dict:
    """The protocol of the module docstring. ``base`` (a DiT, copied) defaults to the digits base;
    ``trainer_kwargs`` are extra ``GRPOTrainer`` arguments (another base's reward, classes,
    conditioning: see ``named_base``)."""
    from jaggc_studies.digits.trainer import GRPOTrainer, TrainerConfig, grpo_loss

    torch.manual_seed(seed)
    config = config or TrainerConfig(strategy="exact", seed=seed)
    dit = copy.deepcopy(_base()) if base is None else copy.deepcopy(base)
    trainer = GRPOTrainer(dit, config, **(trainer_kwargs or {}))
    frozen = FrozenStart(trainer, warmup)
    settings = settings or main_settings(config.window)
    masks = param_groups(dit)
    accs = {c: {s.label(): Accumulator() for s in settings} for c in conditions}
    exact_sums = {c: [None, None] for c in conditions}
    exact_norms = {c: [] for c in conditions}
    gen = torch.Generator().manual_seed(seed + 99)
    start = time.perf_counter()
    for r, cond, mb in frozen.measured_batches(rollouts, conditions):
        rec = flow_grpo_extras(E.record(grpo_loss, dit, mb), mb)
        ex = E.exact(rec, dit).grad
        half = r % 2
        exact_sums[cond][half] = ex.clone() if exact_sums[cond][half] is None else exact_sums[cond][half] + ex
        exact_norms[cond].append(float(ex.norm()))
        for s in settings:
            random = s.variant in E.RANDOM_VARIANTS
            ests = [E.estimate(rec, dit, s, generator=gen) for _ in range(draws if random else 1)]
            accs[cond][s.label()].add(ests, ex, masks if s.label() in masks_for else None)
        if cond != conditions[-1]:
            continue
        log(f"  rollout {r + 1}/{rollouts} ({time.perf_counter() - start:.0f} s)")
        if dump and (r + 1) % 4 == 0 and r + 1 < rollouts:
            Path(dump).write_text(json.dumps(dict(study=_summary(config, settings, conditions, accs, exact_sums,
                                                                 exact_norms, r + 1, draws, warmup)), indent=1))
    return _summary(config, settings, conditions, accs, exact_sums, exact_norms, rollouts, draws, warmup)


def _summary(config, settings, conditions, accs, exact_sums, exact_norms, rollouts, draws, warmup) -> dict:
    out = {"config": {k: getattr(config, k, None) for k in ("num_steps", "classes_per_iter", "group_size",
                                                             "minibatches", "lr", "clip_range", "noise_level", "window",
                                                             "trainable")},
           "rollouts": rollouts, "draws": draws, "warmup": warmup, "conditions": {}}
    for cond in conditions:
        s1, s2 = exact_sums[cond]
        total = s1 + (s2 if s2 is not None else 0)
        mean_exact = total / rollouts
        men = float(mean_exact.norm())
        rms = math.sqrt(sum(x * x for x in exact_norms[cond]) / rollouts)
        split = (float(((s1 / ((rollouts + 1) // 2)) - (s2 / (rollouts // 2))).norm()) / men
                 if s2 is not None else float("nan"))
        rows = []
        for s in settings:
            a = accs[cond][s.label()]
            b = _bias(a, men)
            rows.append(dict(setting=s.label(), variant=s.variant, backward_fraction=sum(a.bfs) / len(a.bfs),
                             cos_mean=sum(a.cos) / a.n, cos_min=min(a.cos), rel_mean=sum(a.rel) / a.n,
                             groups={g: sum(v) / len(v) for g, v in a.group_cos.items()}, **b))
        out["conditions"][cond] = dict(mean_exact_over_rms=men / rms, exact_split_half=split, rows=rows)
    return out


def sweep(*, windows=(3, 4, 6), steps=(10, 16, 25), noise_levels=(0.7,), rollouts: int = 6, draws: int = 3,
          warmup: int = 2, seed: int = 0, log=print, cells=None, dump=None) -> list[dict]:
    """Breakdown: per-batch cosine (on / off1) of plain JAGG (t, index), σ-aware hybrid, causal and
    2-of-W subsampling over W, the number of sampling steps T and the noise level."""
    from jaggc_studies.digits.trainer import TrainerConfig

    out = []
    for T in steps:
        for a in noise_levels:
            for W in windows:
                if W > T - 1 or (cells is not None and (T, a, W) not in cells):
                    continue
                S = E.Setting
                settings = [S("jagg", W, "t"), S("jagg", W, "index"), S("subsample", W, k=2),
                            S("jagg", W, "t", exact_below=500.0), S("subsample", W, k=2, exact_below=500.0),
                            S("causal", W), S("subsample", W, k=1)]
                if T > 10:   # at T = 10 W = 4 the main table has these; elsewhere the σ-free denoised too
                    settings.append(S("denoised", W, "t"))
                cfg = TrainerConfig(strategy="exact", seed=seed, num_steps=T, noise_level=a, window=W)
                res = run_study(rollouts=rollouts, settings=settings, draws=draws, warmup=warmup, config=cfg,
                                masks_for=(), seed=seed, log=lambda *_: None)
                for cond, c in res["conditions"].items():
                    for row in c["rows"]:
                        out.append(dict(T=T, noise_level=a, W=W, condition=cond, rollouts=rollouts, **{k: row[k] for k in (
                            "setting", "backward_fraction", "cos_mean", "cos_min")}))
                log(f"  sweep T={T} a={a} W={W} done")
                if dump:
                    Path(dump).write_text(json.dumps(out, indent=1))
    return out


def window_positions(*, rollouts: int = 8, window: int = 4, draws: int = 2, warmup: int = 2, seed: int = 0,
                     config=None, log=print, base=None, trainer_kwargs: dict | None = None) -> list[dict]:
    """Per window w: projection share ⟨g_w, g⟩/|g|² and norm ratio of its exact contribution g_w, and
    the cosine to g_w of JAGG's / 2-of-W subsampling's estimate of that window alone (other windows
    exact); on-policy and after one real optimizer step, same protocol as ``run_study``."""
    from jaggc_studies.digits.trainer import GRPOTrainer, TrainerConfig, grpo_loss

    cfg = config or TrainerConfig(strategy="exact", seed=seed)
    dit = copy.deepcopy(_base() if base is None else base)
    trainer = GRPOTrainer(dit, cfg, **(trainer_kwargs or {}))
    frozen = FrozenStart(trainer, warmup)
    gen = torch.Generator().manual_seed(seed + 5)
    wins: list[list[int]] = []
    acc: dict = {}
    for r in range(rollouts):
        mbs = frozen.minibatches(1000 + r)
        for cond in ("on", "off1"):
            if cond == "off1":
                trainer._optimize(mbs[0])
            rec = E.record(grpo_loss, dit, mbs[0] if cond == "on" else mbs[-1])
            ex = E.exact(rec, dit).grad
            wins = E.windows_of(rec, window)
            for w, idx in enumerate(wins):
                gw = E.vjp_sum(dit, [(rec.calls[k], rec.upstream[k]) for k in idx], rec.time_arg)
                others = tuple(i for i in range(len(wins)) if i != w)
                j = E.jagg(rec, dit, window=window, exact_windows=others).grad
                subs = [E.subsample(rec, dit, window=window, k=2, exact_windows=others, generator=gen).grad
                        for _ in range(draws)]
                d = acc.setdefault((cond, w), dict(share=[], norm=[], jagg_win_cos=[], sub_win_cos=[]))
                d["share"].append(float(gw.dot(ex) / ex.dot(ex)))
                d["norm"].append(float(gw.norm() / ex.norm()))
                d["jagg_win_cos"].append(E.cosine(j - ex + gw, gw))
                d["sub_win_cos"].append(sum(E.cosine(x - ex + gw, gw) for x in subs) / len(subs))
        frozen.restore()
        log(f"  window positions: rollout {r + 1}/{rollouts}")
    return [dict(condition=c, window=w, steps=wins[w], **{k: sum(v) / len(v) for k, v in d.items()})
            for (c, w), d in acc.items()]


def _fmt(x, nd=2):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def to_markdown(res: dict, sweep_rows: list[dict] | None = None, *, title: str | None = None, level: int = 1) -> str:
    cfg = res["config"]
    h = "#" * level
    lines = [f"{h} {title or 'JAGG gradient fidelity on the trained digits DiT (GRPO conditions)'}", "",
             "Generated by `python -m jaggc_studies.fidelity.study` (studies/fidelity/study.py; method in its docstring).",
             f"Trained parameters: {cfg.get('trainable') or 'attention'} (jaggc_studies.digits.trainer.trainable_parameters). "
             f"Trainer config: T = {cfg['num_steps']} sampling steps ({cfg['num_steps'] - 1} trained), "
             f"{cfg['classes_per_iter']} prompts x {cfg['group_size']} samples per rollout, "
             f"{cfg['minibatches']} minibatches (estimators run on one minibatch), lr {cfg['lr']}, "
             f"clip {cfg['clip_range']}, noise level {cfg['noise_level']}; classifier reward, advantages "
             f"normalised within same-prompt groups; {res['warmup']} warm-up GRPO iterations; "
             f"N = {res['rollouts']} rollouts; random estimators: {res['draws']} draws per batch.", "",
             "Columns: b = DiT backward passes / trained steps; cos = mean (min) per-batch cosine to the exact "
             "gradient of the same batch; rel = mean per-batch relative error; bias = |mean error| / |mean exact|; "
             "floor = sqrt(tr Cov(error) / N) / |mean exact| (the |mean error| an unbiased estimator shows); "
             "debiased = sign·sqrt(| |ē|² − floor² |) / |mean exact| (negative: not resolved).", ""]
    for cond, c in res["conditions"].items():
        name = {"on": "on-policy (first inner step)", "off1": "after 1 real optimizer step (second inner step)",
                "off4": "after 4 real optimizer steps"}.get(cond, cond)
        lines += [f"{h}# {name}", "",
                  f"|mean exact| / rms per-batch exact = {c['mean_exact_over_rms']:.3f}; exact split-half "
                  f"disagreement |Ē₁ − Ē₂| / |Ē| = {c['exact_split_half']:.2f}.", "",
                  "| setting | b | cos mean (min) | rel | bias | floor | debiased |", "|---|---|---|---|---|---|---|"]
        for row in c["rows"]:
            lines.append(f"| {row['setting']} | {row['backward_fraction']:.2f} | {_fmt(row['cos_mean'], 3)} "
                         f"({_fmt(row['cos_min'])}) | {_fmt(row['rel_mean'])} | {_fmt(row['bias'])} | "
                         f"{_fmt(row['floor'])} | {_fmt(row['debiased'])} |")
        grows = [r for r in c["rows"] if r["groups"]]
        if grows:
            # (a group with no trainable parameter has no entry; older results stored it as 0.0)
            groups = [g for g in grows[0]["groups"] if any(r["groups"].get(g) for r in grows)]
            lines += ["", "Per parameter group (mean per-batch cosine within the group):", "",
                      "| setting | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
            for r in grows:
                lines.append(f"| {r['setting']} | " + " | ".join(_fmt(r["groups"][g], 3) for g in groups) + " |")
        lines.append("")
    if sweep_rows:
        lines += [f"{h}# Breakdown over W, sampling steps T and noise level (mean (min) per-batch cosine)", "",
                  f"{sweep_rows[0].get('rollouts', 'few')} rollouts per cell; other settings as above.", ""]
        keys = sorted({(r["T"], r["noise_level"], r["W"], r["condition"]) for r in sweep_rows},
                      key=lambda k: (k[0], k[1], k[2], k[3] != "on"))
        lines += ["| T | noise | W | data | b | jagg t | jagg idx | 2-of-W sub | denoised | b hybrid | jagg hybrid "
                  "| sub hybrid | b causal | causal | 1-of-W sub |", "|---" * 15 + "|"]
        for key in keys:
            cell = {r["setting"].split("/W")[0] + "/" + "/".join(r["setting"].split("/")[2:]): r for r in sweep_rows
                    if (r["T"], r["noise_level"], r["W"], r["condition"]) == key}

            def c(name):
                r = cell.get(name)
                return "—" if r is None else f"{r['cos_mean']:.3f}"

            def bf(name):
                r = cell.get(name)
                return "—" if r is None else f"{r['backward_fraction']:.2f}"
            W = key[2]
            lines.append(f"| {key[0]} | {key[1]} | {W} | {key[3]} | {bf('jagg/t')} | {c('jagg/t')} | {c('jagg/index')} | "
                         f"{c(f'subsample/2of{W}')} | {c('denoised/t')} | {bf('jagg/t/exact<500')} | "
                         f"{c('jagg/t/exact<500')} | {c(f'subsample/2of{W}/exact<500')} | {bf('causal/t')} | "
                         f"{c('causal/t')} | {c(f'subsample/1of{W}')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaggc_studies.fidelity.study", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 rollouts, on/off1, no sweep")
    p.add_argument("--rollouts", type=int, default=None)
    p.add_argument("--conditions", default=None, help="comma list of on,off1,off4")
    p.add_argument("--sweep", action="store_true", help="also the W / T / noise breakdown")
    p.add_argument("--sweep-rollouts", type=int, default=6)
    p.add_argument("--positions", action="store_true", help="also the by-window-position breakdown")
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--full", action="store_true", help="more estimators in the main table (hybrids of every variant)")
    p.add_argument("--out", default=None, help="write the markdown tables here (e.g. docs/fidelity.md)")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base", choices=BASES, default="digits", help="the pretrained base (default digits)")
    p.add_argument("--trainable", choices=("attention", "all", "lora"), default="attention",
                   help="trained parameters (the trainer's default: attention projections)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up GRPO iterations before θ0 (default 2 for attention and lora, 0 for all)")
    p.add_argument("--settings", default=None,
                   help="comma list of setting labels of the main table to keep (default: all)")
    args = p.parse_args(argv)
    if args.sweep and args.base != "digits":
        p.error("--sweep runs on the digits base only")
    torch.set_num_threads(1)
    base, tkw = named_base(args.base)
    rollouts = args.rollouts or (4 if args.quick else 32)
    conditions = tuple(args.conditions.split(",")) if args.conditions else (
        ("on", "off1") if args.quick else ("on", "off1", "off4"))
    settings = main_settings(full=args.full)
    if args.settings:
        keep = args.settings.split(",")
        settings = [x for x in settings if x.label() in keep]
        if len(settings) != len(keep):
            p.error(f"--settings: unknown labels {sorted(set(keep) - {x.label() for x in settings})}")
    from jaggc_studies.digits.trainer import TrainerConfig

    warmup = args.warmup if args.warmup is not None else (0 if args.trainable == "all" else 2)
    res = run_study(rollouts=rollouts, conditions=conditions, draws=args.draws, seed=args.seed,
                    settings=settings, dump=args.json, base=base, trainer_kwargs=tkw, warmup=warmup,
                    config=TrainerConfig(strategy="exact", seed=args.seed, trainable=args.trainable))
    sweep_rows = sweep(rollouts=args.sweep_rollouts, draws=args.draws, seed=args.seed) if args.sweep else None
    title = None if args.base == "digits" else f"JAGG gradient fidelity on the trained {args.base} DiT (GRPO conditions)"
    md = to_markdown(res, sweep_rows, title=title)
    if args.positions:
        pos = window_positions(seed=args.seed, base=base, trainer_kwargs=tkw)
        md += "\n\n## By window position\n\n| data | window steps | share | norm | JAGG cos (window) | subsample cos (window) |\n"
        md += "|---|---|---|---|---|---|\n" + "".join(
            f"| {r['condition']} | {r['steps']} | {r['share']:.3f} | {r['norm']:.2f} | {r['jagg_win_cos']:.3f} | "
            f"{r['sub_win_cos']:.3f} |\n" for r in pos)
    print(md)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(study=res, sweep=sweep_rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
