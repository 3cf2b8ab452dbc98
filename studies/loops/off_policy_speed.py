"""Off-policy serving (``rollout_cache="first_order"``) in the trainers' loops, timed against the unchanged loop.

Each loop trains what the rollout stored after optimizer steps moved the parameters, as the trainers
schedule it (issue 53):

* ``flow_grpo``: Flow-GRPO under accelerate (SD3 with its LoRA, CFG with the slice, the KL reference),
  2 optimizer steps per epoch: the first minibatch on-policy, the second after a step;
* ``dance_grpo``, ``mix_grpo``: their loops (DanceGRPO: a random 60% of 15 steps in a random order,
  gradient checkpointing; MixGRPO: its 4-step window), every trajectory off-policy: one optimizer step
  of the loop's own optimizer between the rollout and the training (AdamW on a small random gradient);
* ``verl_omni``: verl-omni's engine loop on a batch: the old-log-prob pass (the same loop under
  ``no_grad``), then the update pass with its optimizer step, the old pass's time counted.

Variants: the unchanged loop, ``jaggc.stepwise(window=4, weights="t")`` with ``rollout_cache=True`` (it
serves on-policy calls only) and with ``rollout_cache="first_order"``. Per round every variant samples its
own epoch (untimed: ``rollout_s`` apart), then trains it, in a rotated order; process CPU time, one
thread; ratios unchanged / variant, median [min-max] over the rounds.

    python -m jaggc_studies.loops.off_policy_speed --rounds 5 [--size 10m] [--loops flow_grpo,dance_grpo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

import jaggc
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg, rollouts, verl_omni as vo
from jaggc_studies.trainers.sizes import Where

VARIANTS = ("unchanged", "cache", "first_order")
CACHE = {"unchanged": None, "cache": True, "first_order": "first_order"}


def _stepwise(variant: str, cfg: bool) -> dict | None:
    if variant == "unchanged":
        return None
    return dict(window=4, weights="t", cfg_slice=cfg, rollout_cache=CACHE[variant])


def _optimizer_step(model, optimizer, seed: int) -> None:
    """One step of the loop's own optimizer on a small random gradient (what the rollout's parameters
    are off by once the trainer stepped: serving accounts for optimizer steps only)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = 1e-3 * torch.randn(p.shape, generator=g).to(p.dtype)
    optimizer.step()
    optimizer.zero_grad()


class Loop:
    """A loop's run per variant: ``sample(seed)`` (untimed), ``train()`` (timed)."""

    def __init__(self, name: str, variant: str, size: str):
        self.name, self.variant = name, variant
        flux = Where(size)
        if name == "flow_grpo":
            # two minibatches, an optimizer step after each (Flow-GRPO: 2 steps per epoch); SD3 with its LoRA
            self.run = fg.setup(num_steps=9, batch=2, trajectories=2, where=flux,
                                config=fg.TrainConfig(gradient_accumulation_steps=1),
                                stepwise=_stepwise(variant, cfg=True))
        elif name == "dance_grpo":
            self.run = dg.setup(num_steps=15, samples=4, fraction=0.6, gradient_accumulation_steps=4,
                                checkpointing=True, side=8 if size == "10m" else 4, where=flux,
                                stepwise=_stepwise(variant, cfg=False))
        elif name == "mix_grpo":
            self.run = mg.setup(samples=3, gradient_accumulation_steps=3, side=8 if size == "10m" else 4, where=flux,
                                stepwise=_stepwise(variant, cfg=False))
        else:
            self.engine, self.data = vo.setup(num_timesteps=4, batch=4, size=size if size != "tiny" else "tiny",
                                              stepwise=_stepwise(variant, cfg=False))

    def sample(self, seed: int) -> None:
        if self.name == "flow_grpo":
            rollouts.flow_grpo_epoch(self.run, seed=seed)
        elif self.name in ("dance_grpo", "mix_grpo"):
            (rollouts.dance_grpo_epoch if self.name == "dance_grpo" else rollouts.mix_grpo_epoch)(self.run, seed=seed)
            _optimizer_step(self.run.transformer, self.run.optimizer, seed)

    def train(self) -> None:
        unchanged = self.variant == "unchanged"
        if self.name == "flow_grpo":
            (fg.train_unchanged if unchanged else fg.train_jaggc)(self.run)
        elif self.name == "dance_grpo":
            (dg.train_unchanged if unchanged else dg.train_jaggc)(self.run)
        elif self.name == "mix_grpo":
            (mg.train_unchanged if unchanged else mg.train_jaggc)(self.run)
        else:
            vo.train_batch(self.engine, self.data, vo.train_unchanged if unchanged else vo.train_jaggc)

    def counts(self) -> dict:
        if self.variant == "unchanged":
            return {}
        module = self.engine.module if self.name == "verl_omni" else self.run.transformer
        return {k: v for k, v in vars(jaggc.stepwise(module).counts).items() if v}


def measure(names, size: str, rounds: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in names:
        loops = {v: Loop(name, v, size) for v in VARIANTS}
        times = {v: [] for v in VARIANTS}
        rollout = {v: [] for v in VARIANTS}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for r in range(rounds + 1):                # round 0 warms up (first calls, the CFG slice learns)
                order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
                for v in order:
                    t0 = time.process_time()
                    loops[v].sample(seed=100 + r)
                    t1 = time.process_time()
                    loops[v].train()
                    t2 = time.process_time()
                    if r:
                        rollout[v].append(t1 - t0)
                        times[v].append(t2 - t1)
        base = times["unchanged"]
        out[name] = {v: dict(train_s=statistics.median(times[v]), rollout_s=statistics.median(rollout[v]),
                             ratio=statistics.median([b / t for b, t in zip(base, times[v])]),
                             ratio_range=[min(b / t for b, t in zip(base, times[v])),
                                          max(b / t for b, t in zip(base, times[v]))],
                             counts=loops[v].counts())
                     for v in VARIANTS}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loops", default="flow_grpo,dance_grpo,mix_grpo,verl_omni")
    parser.add_argument("--size", default="10m", choices=("tiny", "10m"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = measure(args.loops.split(","), args.size, args.rounds)
    for name, by in result.items():
        print(f"{name}: " + "; ".join(f"{v} {d['ratio']:.2f}x [{d['ratio_range'][0]:.2f}-{d['ratio_range'][1]:.2f}] "
                                     f"(train {d['train_s']:.2f} s)" for v, d in by.items()))
        for v, d in by.items():
            if d["counts"]:
                print(f"    {v}: {d['counts']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
