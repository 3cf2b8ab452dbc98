"""Flow-GRPO training of a LoRA on a tiny diffusers SD3 transformer with ``@jagg_compile``.

    torchrun --nproc_per_node 2 examples/lora_grpo_trainer.py              # 2 CPU processes (gloo)
    accelerate launch --multi_gpu --num_processes 2 examples/lora_grpo_trainer.py   # the same via accelerate
    python examples/lora_grpo_trainer.py                                    # one process

(``accelerate launch --num_processes 2 --cpu`` starts ONE process in accelerate 1.15: with
``--cpu`` its launcher is the single-process one unless MPI is used. ``--multi_gpu`` goes through
torch.distributed.run, and the script's ``Accelerator(cpu=True)`` then trains on 2 CPU processes.)
About 30 s for the default 12 iterations on 2 CPU cores (of which ~15 s Dynamo capture).

What it does, per iteration (the structure of Flow-GRPO's scripts/train_sd3.py, at toy size):

  1. rollout, no grad: every rank samples ``--prompts`` prompts x ``--group`` images with the
     Flow-GRPO SDE sampler (``jaggc.grpo.flow_grpo_sde_step``, shift-3 schedule, ``--steps`` + 1
     steps) from the current LoRA policy, storing states, next states and log-probs;
  2. reward without gradients: the negative mean square of the final latent (an "image
     statistic"; no VAE or reward model is needed offline), gathered over ranks; advantages are
     Flow-GRPO's per-prompt normalised rewards (global std);
  3. training: ``--inner-epochs`` passes over the rollout in micro-batches of ``--micro-batch``
     samples under ``accelerator.accumulate`` (gradient accumulation over all micro-batches of an
     epoch), the Flow-GRPO SDE log-prob + PPO clip loss compiled with ``@jagg_compile(window=W)``
     (one joint DiT backward per window), gradient checkpointing on, LoRA (peft ``LoraConfig``)
     on the attention projections, gradient clipping, AdamW;
  4. logs: reward mean/std, clip fraction, approx KL, ratio mean/min/max, DiT backward passes
     (jagg vs what the exact per-step loop would run) and, every ``--cos-every`` iterations, the
     cosine between the JAGG and the exact gradient of the LoRA parameters on the first
     micro-batch (computed on the local module, outside DDP, before the update).

Every number is from a random-init toy DiT: it shows the machinery runs end to end (accelerate,
DDP, accumulation, checkpointing, LoRA), not JAGG's fidelity on trained models (README, spec §3).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch

import jaggc
from jaggc import grpo, models
from jaggc.runtime import count_dit_passes

NOISE_LEVEL = 0.7
CLIP_RANGE = 0.1          # the JAGG author's runs (Flow-GRPO SD3 itself uses 1e-4)
ADV_CLIP_MAX = 5.0
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


# --------------------------------------------------------------------------------- the loss


def sde_log_prob(model_output, sample, sigma, sigma_next, prev_sample, sigma_max):
    """Flow-GRPO's sde_step_with_logprob on a stored transition (per-sample sigmas)."""
    shape = (-1,) + (1,) * (sample.ndim - 1)
    sigma, sigma_prev = sigma.view(shape), sigma_next.view(shape)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * NOISE_LEVEL
    mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + model_output.float() * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    std = std_dev_t * torch.sqrt(-1 * dt)
    log_prob = -((prev_sample - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def grpo_loss(transformer, batch):
    """Flow-GRPO's training loss over all stored steps; also returns the new log-probs (detached)
    for the ratio statistics."""
    num_steps = batch["timesteps"].shape[1]
    total = 0.0
    log_probs = []
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        noise_pred = transformer(hidden_states=latents, timestep=batch["timesteps"][:, j],
                                 encoder_hidden_states=batch["prompt_embeds"],
                                 pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
        log_prob = sde_log_prob(noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                batch["next_latents"][:, j], batch["sigma_max"])
        advantages = torch.clamp(batch["advantages"][:, j], -ADV_CLIP_MAX, ADV_CLIP_MAX)
        ratio = torch.exp(log_prob - batch["log_probs"][:, j])
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1.0 - CLIP_RANGE, 1.0 + CLIP_RANGE)
        total = total + torch.mean(torch.maximum(unclipped, clipped))
        log_probs.append(log_prob.detach())
    return total / num_steps, torch.stack(log_probs, 1)


# --------------------------------------------------------------------------------- set-up


def build_dit(seed: int, checkpointing: bool):
    from peft import LoraConfig

    dit = models.sd3("tiny", seed=seed)
    dit.requires_grad_(False)
    dit.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    if checkpointing:
        dit.enable_gradient_checkpointing()
    dit.train()
    return dit


def prompt_bank(dit, num: int, seed: int):
    cfg = dit.config
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num, 5, cfg.joint_attention_dim, generator=g),
            torch.randn(num, cfg.pooled_projection_dim, generator=g))


@torch.no_grad()
def rollout(dit, embeds, pooled, prompt_ids, num_steps: int, seed: int) -> dict:
    """Flow-GRPO SDE rollout of num_steps + 1 steps; the last (tiny-sigma) step is not trained."""
    sigmas = grpo.flow_match_sigmas(num_steps + 1).float()
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_ids)
    cond_e, cond_p = embeds[prompt_ids], pooled[prompt_ids]
    z = torch.randn(models.sd3_latent_shape(dit, b), generator=g)
    lat, nxt, lps, sig, sig_next = [], [], [], [], []
    for k in range(num_steps + 1):
        s, sn = sigmas[k].expand(b).contiguous(), sigmas[k + 1].expand(b).contiguous()
        v = dit(hidden_states=z, timestep=s * 1000, encoder_hidden_states=cond_e, pooled_projections=cond_p,
                return_dict=False)[0]
        step = grpo.flow_grpo_sde_step(v, z, s, sn, noise_level=NOISE_LEVEL, sigma_max=float(sigmas[1]), generator=g)
        lat.append(z), nxt.append(step.prev_sample), lps.append(step.log_prob), sig.append(s), sig_next.append(sn)
        z = step.prev_sample
    keep = slice(0, num_steps)
    sigma = torch.stack(sig, 1)[:, keep].contiguous()
    return dict(latents=torch.stack(lat, 1)[:, keep].contiguous(),
                next_latents=torch.stack(nxt, 1)[:, keep].contiguous(),
                timesteps=(sigma * 1000).contiguous(), sigmas=sigma,
                sigmas_next=torch.stack(sig_next, 1)[:, keep].contiguous(), sigma_max=sigmas[1].clone(),
                log_probs=torch.stack(lps, 1)[:, keep].contiguous(),
                prompt_embeds=cond_e, pooled_prompt_embeds=cond_p, final=z)


def reward_fn(final_latents: torch.Tensor) -> torch.Tensor:
    """Negative mean square of the 'image' (no gradient needed: a black-box score)."""
    return -(final_latents.float() ** 2).mean(dim=tuple(range(1, final_latents.ndim)))


def micro_batches(data: dict, size: int) -> list[dict]:
    n = data["latents"].shape[0]
    out = []
    for lo in range(0, n, size):
        out.append({k: (v[lo:lo + size] if k != "sigma_max" else v) for k, v in data.items() if k != "final"})
    return out


def lora_grad(dit) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for n, p in dit.named_parameters() if "lora_" in n and p.grad is not None])


def gradient_cosine(local_dit, compiled, mb) -> float:
    """cos(JAGG gradient, exact gradient) of the LoRA parameters on one micro-batch, on the local
    module (no DDP hooks fire: nothing is all-reduced, the training .grad is untouched)."""
    saved = {n: p.grad for n, p in local_dit.named_parameters() if p.requires_grad}
    for p in local_dit.parameters():
        p.grad = None
    grpo_loss(local_dit, mb)[0].backward()
    exact = lora_grad(local_dit).clone()
    for p in local_dit.parameters():
        p.grad = None
    compiled(local_dit, mb)[0].backward()
    jagg = lora_grad(local_dit).clone()
    for n, p in local_dit.named_parameters():
        if p.requires_grad:
            p.grad = saved[n]
    return float(torch.nn.functional.cosine_similarity(jagg.double(), exact.double(), dim=0))


# --------------------------------------------------------------------------------- main


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8, help="trained SDE steps per trajectory")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per rank and iteration")
    ap.add_argument("--group", type=int, default=2, help="samples per prompt")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--inner-epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--cos-every", type=int, default=4)
    ap.add_argument("--backward", choices=("joint", "per_window"), default="joint")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    local_samples = args.prompts * args.group
    accum = max(1, local_samples // args.micro_batch)      # one optimizer step per inner epoch
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accum)
    set_seed(args.seed)
    torch.set_num_threads(1)
    rank, world = accelerator.process_index, accelerator.num_processes

    dit = build_dit(args.seed, checkpointing=not args.no_checkpointing)
    params = [p for p in dit.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    dit, optimizer = accelerator.prepare(dit, optimizer)
    local = accelerator.unwrap_model(dit)
    embeds, pooled = prompt_bank(local, 64, seed=args.seed)

    compiled = jaggc.jagg_compile(grpo_loss, window=args.window, backward=args.backward)
    diag = jaggc.jagg_compile(grpo_loss, window=args.window)          # for the cosine, on the local module
    log = accelerator.print
    log(f"processes={world} samples/rank={local_samples} micro-batch={args.micro_batch} accumulation={accum} "
        f"steps={args.steps} window={args.window} backward={args.backward} "
        f"checkpointing={not args.no_checkpointing} LoRA params={sum(p.numel() for p in params)}")
    history = []
    for it in range(args.iterations):
        t0 = time.perf_counter()
        # 1. rollout (each rank its own prompts) -------------------------------------------
        prompt_ids = torch.tensor([(it * world * args.prompts + rank * args.prompts + i) % len(embeds)
                                   for i in range(args.prompts) for _ in range(args.group)])
        data = rollout(local, embeds, pooled, prompt_ids, args.steps, seed=args.seed * 1000 + it * world + rank)
        # 2. rewards and advantages over all ranks -----------------------------------------
        rewards = reward_fn(data["final"])
        all_rewards = accelerator.gather(rewards)
        all_ids = accelerator.gather(prompt_ids)
        adv = grpo.flow_grpo_advantages(all_rewards, all_ids.tolist())
        data["advantages"] = adv.view(world, -1)[rank].float()[:, None].expand(-1, args.steps).contiguous()
        mbs = micro_batches(data, args.micro_batch)
        cosine = None
        if args.cos_every and it % args.cos_every == 0:
            cosine = gradient_cosine(local, diag, mbs[0])
        # 3. training ------------------------------------------------------------------------
        stats, backwards, grad_norm = [], 0, float("nan")
        for _epoch in range(args.inner_epochs):
            for mb in mbs:
                with accelerator.accumulate(dit), count_dit_passes(local) as passes:
                    # a step that raises leaves .grad as the earlier micro-batches made it
                    with jaggc.atomic_step(dit):
                        loss, log_probs = compiled(dit, mb)
                        accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grad_norm = float(accelerator.clip_grad_norm_(params, 1.0))
                    optimizer.step()
                    optimizer.zero_grad()
                backwards += passes.backwards
                stats.append(grpo.ppo_clip_stats(log_probs.reshape(-1), mb["log_probs"].reshape(-1),
                                                 mb["advantages"].reshape(-1), clip_range=CLIP_RANGE,
                                                 adv_clip_max=ADV_CLIP_MAX))
        # 4. logs ----------------------------------------------------------------------------
        row = dict(iteration=it, reward_mean=float(all_rewards.mean()), reward_std=float(all_rewards.std()),
                   clipfrac=float(torch.stack([s["clipfrac"] for s in stats]).mean()),
                   approx_kl=float(torch.stack([s["approx_kl"] for s in stats]).mean()),
                   ratio_mean=float(torch.stack([s["ratio_mean"] for s in stats]).mean()),
                   ratio_min=float(min(s["ratio_min"] for s in stats)),
                   ratio_max=float(max(s["ratio_max"] for s in stats)),
                   dit_backwards=backwards, exact_backwards=args.steps * len(mbs) * args.inner_epochs,
                   grad_norm=grad_norm, cosine=cosine, seconds=time.perf_counter() - t0)
        history.append(row)
        cos = f" cos(jagg,exact)={cosine:.4f}" if cosine is not None else ""
        log(f"it {it:3d} reward {row['reward_mean']:+.4f}±{row['reward_std']:.4f} clipfrac {row['clipfrac']:.3f} "
            f"approx_kl {row['approx_kl']:.2e} ratio {row['ratio_mean']:.4f} [{row['ratio_min']:.4f}, "
            f"{row['ratio_max']:.4f}] grad_norm {grad_norm:.3g} DiT backwards {backwards} (exact loop: "
            f"{row['exact_backwards']}){cos} {row['seconds']:.1f}s")
    accelerator.wait_for_everyone()
    log(f"capture path: {compiled.report.path}; windows per loss: {len(compiled.report.windows)}")
    accelerator.end_training()
    return history


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
