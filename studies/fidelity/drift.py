"""How far off-policy do the real optimizer steps of the fidelity protocol move the policy?

    python -m jaggc_studies.fidelity.drift [--base digits|shapes] [--trainable attention|all] [--rollouts 6]

Same protocol as ``jaggc_studies.fidelity.study`` (GRPOTrainer, strategy exact, ``warmup`` iterations — default
2 for attention-only training, 0 for all parameters, as in the study — then θ0 frozen; per rollout the
trainer's rollout, reward, group-normalised advantages and minibatches; θ and the optimizer restored
after every rollout). For ``off1`` one real AdamW step on minibatch 1 (exact gradient, clipping), for
``off4`` four (minibatches 1, 2, 1, 2); then, on the measured minibatch (minibatch 2, the one the
study's estimators see), the PPO ratio r = exp(log π_θ(x_{k+1}|x_k) − log π_θ0(x_{k+1}|x_k)) of every
sample and trained step:

- clip fraction: share of (sample, step) pairs with |r − 1| > the trainer's clip range (Flow-GRPO's clipfrac);
- mean |r − 1|;
- relative parameter change ‖θ − θ0‖ / ‖θ0‖: ``rel_param_change`` with ‖θ0‖ the norm of the whole model
  (the definition of the table in docs/fidelity.md), ``rel_trained_change`` with ‖θ0‖ over the trained
  parameters only (attention-only: ~2x larger on the digits DiT, whose attention projections carry
  half of its parameter norm); ‖θ − θ0‖ is over the trained parameters either way.

Reported as the mean over rollouts.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def measure_drift(*, base: str = "digits", trainable: str = "attention", rollouts: int = 6,
                  warmup: int | None = None, seed: int = 0, config=None, log=print) -> dict:
    from jaggc_studies.digits.trainer import GRPOTrainer, TrainerConfig, grpo_loss

    from jaggc_studies.fidelity.study import FrozenStart, named_base

    torch.manual_seed(seed)
    warmup = (2 if trainable == "attention" else 0) if warmup is None else warmup
    cfg = config or TrainerConfig(strategy="exact", seed=seed, trainable=trainable)
    dit0, tkw = named_base(base)
    dit = copy.deepcopy(dit0)
    trainer = GRPOTrainer(dit, cfg, **tkw)
    frozen = FrozenStart(trainer, warmup)
    p0 = _flat(trainer.params)
    model_norm = float(_flat(dit.parameters()).norm())
    sums = {c: dict(clipfrac=0.0, mean_abs_ratio_dev=0.0, rel_param_change=0.0, rel_trained_change=0.0)
            for c in ("off1", "off4")}
    for r in range(rollouts):
        it = 1000 + r
        mbs = frozen.minibatches(it)
        measured = mbs[1 % len(mbs)]
        plan = {"off1": [0], "off4": [1, 0, 1]}   # off4 continues from off1: steps on mbs 1, 2, 1, 2
        for cond, steps in plan.items():
            for j in steps:
                trainer._optimize(mbs[j % len(mbs)])
            with torch.no_grad():
                _, new_lp = grpo_loss(dit, measured)
            old_lp = measured["log_probs"][:, list(measured["train_steps"])]
            dev = (torch.exp(new_lp - old_lp) - 1).abs()
            s = sums[cond]
            s["clipfrac"] += float((dev > cfg.clip_range).float().mean())
            s["mean_abs_ratio_dev"] += float(dev.mean())
            step = float((_flat(trainer.params) - p0).norm())
            s["rel_param_change"] += step / model_norm
            s["rel_trained_change"] += step / float(p0.norm())
        frozen.restore()
        log(f"  drift {base}/{trainable}: rollout {r + 1}/{rollouts}")
    return dict(base=base, trainable=trainable, rollouts=rollouts, warmup=warmup, clip_range=cfg.clip_range,
                lr=cfg.lr, **{c: {k: v / rollouts for k, v in s.items()} for c, s in sums.items()})


def to_markdown(rows: list[dict]) -> str:
    lines = ["| base | trained parameters | N | off1: clip fraction, mean abs(r − 1), rel. parameter change "
             "(whole model / trained parameters) | off4: same |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[c]['clipfrac']:.3f}, {r[c]['mean_abs_ratio_dev']:.1e}, {r[c]['rel_param_change']:.1e} / "
                 f"{r[c]['rel_trained_change']:.1e}" for c in ("off1", "off4")]
        lines.append(f"| {r['base']} | {r['trainable']} | {r['rollouts']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaggc_studies.fidelity.drift", description=__doc__.splitlines()[0])
    p.add_argument("--base", default="digits", help="comma list of digits, shapes")
    p.add_argument("--trainable", default="attention", help="comma list of attention, all")
    p.add_argument("--rollouts", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure_drift(base=b, trainable=t, rollouts=args.rollouts, seed=args.seed)
            for b in args.base.split(",") for t in args.trainable.split(",")]
    print(to_markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
