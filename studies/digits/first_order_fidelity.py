"""How close off-policy serving's outputs are on a trained model, by optimizer steps since the rollout.

``python -m jaggc_studies.digits.first_order_fidelity [--steps 1,2,4,8] [--seeds 3] [--min-sigma 0.5]``

The digits base (shipped weights), its attention projections trained (Flow-GRPO's LoRA targets),
Flow-GRPO's SDE rollout of 9 steps (8 trained, W=4: two windows), PPO clip 1e-2, AdamW lr 3e-4. After
the rollout, ``n`` trajectories each followed by an optimizer step run through
``jaggc.stepwise(rollout_cache="first_order")``; then one more trajectory, whose interior outputs are
served first-order, is compared with a forward of the stepped model (a jaggc-free copy), per served
step:

* ``served_rel``: |served − true| / |true|; ``stale_rel``: the recorded output's (no correction);
* ``cos_served``: the cosine of the PPO loss's upstream gradients dL_k/dv_k at the served outputs to
  those at the true ones; ``cos_stale``: at the recorded outputs;
* ``clip_true`` / ``clip_served``: the fraction of samples whose PPO ratio is clipped there.

Two placements: the default σ-aware one (the window that reaches σ < 0.5 runs exactly, nothing
served there) and ``weights="t"`` (every window JAGG; the low-σ one served too with ``--min-sigma 0``).
Prints JSON lines, with the served outputs' relative error (median, max) and the lowest per-step
cosine over the seeds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import warnings

import torch

import jaggc
from jaggc_studies.digits import trainer as tr
from jaggc_studies.digits.model import load_base
from jaggc_studies.example_losses import sde_step_with_logprob

W, T, LR, CLIP = 4, 9, 3e-4, 1e-2


def _log_ratio(v, batch, j):
    _, log_prob, _, _ = sde_step_with_logprob(v, batch["latents"][:, j], batch["sigmas"][:, j],
                                              batch["sigmas_next"][:, j], batch["next_latents"][:, j],
                                              batch["sigma_max"], noise_level=batch["noise_level"])
    return log_prob - batch["log_probs"][:, j]


def step_loss(v, batch, j):
    """Flow-GRPO's PPO term of step ``j`` at the output ``v`` (trainer.grpo_loss's, one step)."""
    ratio = torch.exp(_log_ratio(v, batch, j))
    adv = batch["advantages"]
    return torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)))


def step_call(dit, batch, j):
    """The loop's DiT call of step ``j`` on the stored state."""
    return dit(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
               encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"],
               return_dict=False)[0]


def _upstream(v, batch, j):
    v = v.detach().double().requires_grad_(True)
    (g,) = torch.autograd.grad(step_loss(v, batch, j), v)
    return g.flatten()


def _cos(a, b) -> float:
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else float("nan")


def off_policy_run(rollout_cache, *, steps: int, labels: torch.Tensor, generator_seed: int, **settings):
    """A rollout recorded by ``jaggc.stepwise(dit, window=W, rollout_cache=..., **settings)`` on the digits
    base, ``steps`` trajectories each followed by an AdamW step, then one more trajectory. Returns the
    rollout's outputs per step, the batch, the stepwise (open), the outputs the loop saw in the last
    trajectory, the steps of its JAGG windows' interiors and how many of them were served."""
    dit = load_base()
    params = tr.trainable_parameters(dit, "attention")
    config = tr.TrainerConfig(num_steps=T, group_size=8, classes_per_iter=2, clip_range=CLIP)
    jagg = jaggc.stepwise(dit, window=W, rollout_cache=rollout_cache, **settings)
    recorded = {}

    def hook(module, args, kwargs, output):
        if not torch.is_grad_enabled():
            recorded[len(recorded)] = output[0].detach().clone()

    handle = dit.register_forward_hook(hook, with_kwargs=True)
    g = torch.Generator().manual_seed(generator_seed)
    with torch.no_grad():
        batch = tr.rollout(dit, labels, config, g)
    handle.remove()
    adv = torch.randn(labels.shape[0], generator=g)
    batch["advantages"] = (adv - adv.mean()) / adv.std()
    batch["clip_range"] = CLIP
    opt = torch.optim.AdamW(params, lr=LR)
    trained = range(T - 1)

    def trajectory(seen):
        for j in jagg.steps(trained, batch["timesteps"][:, :T - 1]):
            v = step_call(dit, batch, j)
            seen[j] = v.detach().clone()
            (step_loss(v, batch, j) / len(trained)).backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            trajectory({})
            opt.step()
            opt.zero_grad()
        before = jagg.counts.first_order_served
        served = {}
        trajectory(served)
    served_now = jagg.counts.first_order_served - before
    interior = sorted(k for w in jagg.report.windows if w["mode"] == "jagg" for k in w["steps"] if k not in w["knots"])
    return recorded, batch, jagg, served, interior, served_now


def measure(steps: int, weights: str | None, seed: int, min_sigma: float = jaggc.FirstOrder.min_sigma) -> dict:
    torch.manual_seed(seed)
    kw = {} if weights is None else {"weights": weights}
    cache = jaggc.FirstOrder(max_optimizer_steps=max(steps, 1), min_sigma=min_sigma)
    labels = torch.tensor([seed % 10] * 8 + [(seed + 5) % 10] * 8)
    recorded, batch, jagg, served, served_steps, n_served = off_policy_run(cache, steps=steps, labels=labels,
                                                                           generator_seed=100 + seed, **kw)
    dit = jagg.module
    jagg.close()
    now = copy.deepcopy(dit)
    with torch.no_grad():
        true = {j: step_call(now, batch, j) for j in served_steps}
    rows = []
    for k in served_steps:
        sigma = float(batch["sigmas"][0, k])
        up_true, up_served, up_stale = (_upstream(x, batch, k) for x in (true[k], served[k], recorded[k]))
        clip = lambda v: float(((_log_ratio(v, batch, k).exp() - 1).abs() > CLIP).double().mean())
        rows.append(dict(step=k, sigma=round(sigma, 3),
                         served_rel=float((served[k] - true[k]).norm() / true[k].norm()),
                         stale_rel=float((recorded[k] - true[k]).norm() / true[k].norm()),
                         cos_served=_cos(up_served, up_true), cos_stale=_cos(up_stale, up_true),
                         clip_true=clip(true[k]), clip_served=clip(served[k])))
    cat = lambda outs: torch.cat([_upstream(outs[k], batch, k) for k in served_steps])
    return dict(steps=steps, weights=weights or "default (σ-aware)", seed=seed, served=n_served, per_step=rows,
                cos_served=_cos(cat(served), cat(true)), cos_stale=_cos(cat(recorded), cat(true)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="1,2,4,8", help="optimizer steps since the rollout")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--weights", default="default,t")
    p.add_argument("--min-sigma", type=float, default=jaggc.FirstOrder.min_sigma,
                   help="FirstOrder(min_sigma=...): 0 serves the window reaching low σ too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for weights in args.weights.split(","):
        for n in (int(s) for s in args.steps.split(",")):
            runs = [measure(n, None if weights == "default" else weights, seed, args.min_sigma)
                    for seed in range(args.seeds)]
            summary = {key: statistics.median(r[key] for r in runs) for key in ("cos_served", "cos_stale")}
            rows = [row for r in runs for row in r["per_step"]]
            print(json.dumps(dict(steps=n, weights=runs[0]["weights"], min_sigma=args.min_sigma, median=summary,
                                  min_cos_served=min(r["cos_served"] for r in runs),
                                  min_step_cos_served=min((row["cos_served"] for row in rows), default=None),
                                  served_rel_median=statistics.median(row["served_rel"] for row in rows) if rows else None,
                                  served_rel_max=max((row["served_rel"] for row in rows), default=None),
                                  runs=runs)), flush=True)


if __name__ == "__main__":
    main()
