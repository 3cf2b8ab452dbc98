"""Pretrain the digits base DiT with flow matching on the train split (deterministic, CPU).

``python -m jaggc_studies.digits.train_base [--out PATH] [--steps N]`` trains ``build_dit(seed)`` on
sklearn digits with the rectified-flow / SD3 objective: z = (1-sigma) x0 + sigma noise, regress
the velocity noise - x0, with sigma drawn logit-normal (SD3's choice: most weight at mid noise,
where the class structure is decided). AdamW with warmup + cosine decay; the shipped weights are
an exponential moving average of the parameters (smoother samples than the last iterate). Writes
fp16 weights to ``studies/digits/weights/base_dit.pt`` by default.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path
from typing import Callable

import torch

from jaggc_studies.digits.data import load_digits_split
from jaggc_studies.digits.model import BASE_WEIGHTS, DIGITS_CONFIG, build_dit, class_conditioning, save_fp16_state


def sample_sigmas(n: int, g: torch.Generator, scheme: str) -> torch.Tensor:
    """Training noise levels in (0, 1): logit-normal(0, 1) or uniform."""
    if scheme == "logit-normal":
        return torch.sigmoid(torch.randn(n, generator=g))
    if scheme == "uniform":
        return torch.rand(n, generator=g)
    raise ValueError(f"sigma scheme {scheme!r}: use 'logit-normal' or 'uniform'")


def flow_matching_loss(dit, x0: torch.Tensor, labels: torch.Tensor, g: torch.Generator,
                       scheme: str = "logit-normal", conditioning=class_conditioning) -> torch.Tensor:
    """MSE between the DiT velocity and noise - x0 at random noise levels (``conditioning``:
    labels -> the DiT's conditioning keyword arguments; the digits prompt table by default)."""
    noise = torch.randn(x0.shape, generator=g)
    sigma = sample_sigmas(len(x0), g, scheme)
    s = sigma.view(-1, 1, 1, 1)
    z = (1 - s) * x0 + s * noise
    v = dit(hidden_states=z, timestep=1000.0 * sigma, **conditioning(labels), return_dict=False)[0]
    return (v - (noise - x0)).pow(2).mean()


@torch.no_grad()
def ema_update(ema, model, decay: float) -> None:
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.lerp_(pm, 1.0 - decay)


def lr_at(step: int, total: int, base_lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``base_lr``."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_base(*, steps: int = 3000, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
               ema_decay: float = 0.999, scheme: str = "logit-normal", eval_every: int = 0, log_every: int = 250,
               data=None, dit=None, conditioning=class_conditioning, eval_fn=None):
    """Returns the EMA DiT (eval mode). Deterministic in ``seed`` for a fixed thread count.

    Defaults train the digits base; another base passes its own ``data`` (``.images``, ``.labels``),
    freshly built ``dit``, ``conditioning`` (labels -> DiT kwargs) and ``eval_fn(ema) -> str``
    (printed every ``eval_every`` steps; default the digits sample quality)."""
    data = load_digits_split("train") if data is None else data
    dit = (build_dit(seed=seed) if dit is None else dit).train()
    ema = copy.deepcopy(dit).eval().requires_grad_(False)
    opt = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    warmup = min(200, steps // 10 + 1)
    perm, cursor, running, start = torch.randperm(len(data.labels), generator=g), 0, 0.0, time.time()
    for step in range(steps):
        # Epoch-wise shuffling without replacement: every image is seen once per epoch.
        if cursor + batch_size > len(perm):
            perm, cursor = torch.randperm(len(data.labels), generator=g), 0
        idx = perm[cursor:cursor + batch_size]
        cursor += batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = flow_matching_loss(dit, data.images[idx], data.labels[idx], g, scheme, conditioning)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        # EMA warm-up: early on the average would be dominated by the random init.
        ema_update(ema, dit, min(ema_decay, (1 + step) / (10 + step)))
        running += loss.item()
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps}  loss {running / log_every:.4f}  {time.time() - start:.0f}s", flush=True)
            running = 0.0
        if eval_every and (step + 1) % eval_every == 0 and eval_fn is not None:
            print(f"  EMA samples: {eval_fn(ema)}", flush=True)
        elif eval_every and (step + 1) % eval_every == 0:
            from jaggc_studies.digits.quality import sample_quality
            r = sample_quality(ema, per_class=20, seed=123)
            print(f"  EMA samples: mean eval acc {r['mean_eval_accuracy']:.3f} "
                  f"(min {r['min_eval_accuracy']:.2f}), reward p {r['mean_reward_p_target']:.3f}", flush=True)
    return ema


DEFAULTS = dict(steps=3000, batch_size=64, lr=1e-3, seed=0, ema_decay=0.999, sigma_scheme="logit-normal")


def base_training_parser(description: str, defaults: dict, out: Path) -> argparse.ArgumentParser:
    """The command line of a base's training run (digits and shapes)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--steps", type=int, default=defaults["steps"])
    parser.add_argument("--batch-size", type=int, default=defaults["batch_size"])
    parser.add_argument("--lr", type=float, default=defaults["lr"])
    parser.add_argument("--seed", type=int, default=defaults["seed"])
    parser.add_argument("--ema-decay", type=float, default=defaults["ema_decay"])
    parser.add_argument("--sigma-scheme", choices=["logit-normal", "uniform"], default=defaults["sigma_scheme"])
    parser.add_argument("--eval-every", type=int, default=0, help="print EMA sample accuracy every N steps")
    return parser


def run_base_training(args: argparse.Namespace, train: Callable[..., torch.nn.Module], config: dict) -> None:
    """Train with ``args`` on one thread (bit-reproducible) and ship the EMA weights as fp16."""
    torch.set_num_threads(1)  # shared CPU; one thread also makes the run bit-reproducible
    start = time.time()
    hyper = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                 ema_decay=args.ema_decay)
    ema = train(**hyper, scheme=args.sigma_scheme, eval_every=args.eval_every)
    save_fp16_state(ema, args.out, config=config, train_args=dict(hyper, sigma_scheme=args.sigma_scheme))
    print(f"trained {args.steps} steps in {time.time() - start:.0f}s -> {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = base_training_parser(__doc__.splitlines()[0], DEFAULTS, BASE_WEIGHTS).parse_args(argv)
    run_base_training(args, train_base, DIGITS_CONFIG)


if __name__ == "__main__":
    main()
