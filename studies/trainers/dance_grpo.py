"""DanceGRPO (Flux), ``train_grpo_flux.py``'s shape: ``flux_step`` on a sigma-schedule tensor with a
tensor step index, ``grpo_one_step`` in train mode inside a CUDA bf16 block, each sample training its
own random 60% of the steps. Its ``flux_step``, ``one_step`` and ``clipped_loss`` are also the JAGG
author's and MixGRPO's."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from jaggc import grpo, models
from jaggc.grpo import flux_step_mean

from .common import GRPOConfig, TrainerShape, off_policy_step


def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    """DanceGRPO's ``flux_step`` (also the JAGG author's): ``sigmas`` a schedule tensor, ``index``
    an int or a 0-d tensor, the std read as a Python float with ``math.sqrt``."""
    sigma = sigmas[index]
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    # the mean's arithmetic is jaggc.grpo's (written once); the constructs around it are the trainer's
    prev_sample_mean, pred_original_sample = flux_step_mean(model_output, latents, sigma, sigmas[index + 1], eta,
                                                            sde_solver=sde_solver)
    if grpo and prev_sample is None:
        prev_sample = prev_sample_mean + torch.randn_like(prev_sample_mean) * std_dev_t
    if grpo:
        log_prob = ((-((prev_sample.detach().to(torch.float32) - prev_sample_mean.to(torch.float32)) ** 2)
                     / (2 * (std_dev_t**2)))
                    - math.log(std_dev_t) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
        log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
        return prev_sample, pred_original_sample, log_prob
    return prev_sample_mean, pred_original_sample


def one_step(args, transformer, latents, pre_latents, i, sigma_schedule, **dit_kwargs):
    """The trainers' ``grpo_one_step``: train mode, an autocast block, the DiT on ``latents``, then
    ``flux_step``'s log-prob of the stored next state."""
    transformer.train()
    with torch.autocast("cuda", torch.bfloat16):
        pred = transformer(hidden_states=latents, return_dict=False, **dit_kwargs)[0]
    _, _, log_prob = flux_step(pred, latents.to(torch.float32), args.eta, sigma_schedule, i,
                               prev_sample=pre_latents.to(torch.float32), grpo=True, sde_solver=True)
    return log_prob


def clipped_loss(log_prob, old_log_prob, advantages, args, norm):
    """DanceGRPO's PPO-clip line: mean of max(-A r, -A clip(r)), divided by ``norm``."""
    advantages = torch.clamp(advantages, -args.adv_clip_max, args.adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - args.clip_range, 1.0 + args.clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped)) / norm


def dance_one_step(args, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, text_ids, image_ids,
                   transformer, timesteps, i, sigma_schedule):
    """DanceGRPO's ``grpo_one_step`` on Flux (guidance 3.5, FLUX.1-dev's), ``timesteps / 1000``."""
    return one_step(args, transformer, latents, pre_latents, i, sigma_schedule,
                    encoder_hidden_states=encoder_hidden_states, timestep=timesteps / 1000,
                    guidance=torch.tensor([3.5], device=latents.device, dtype=torch.float32), txt_ids=text_ids,
                    pooled_projections=pooled_prompt_embeds, img_ids=image_ids, joint_attention_kwargs=None)


def dance_grpo_loss(transformer, sample, perm, sigma_schedule, args):
    """DanceGRPO's per-sample loop over its trained steps ``perm`` (indices into the trajectory,
    sorted), each step's loss divided by the number of trained steps, summed."""
    train_timesteps = perm.shape[0]
    latents = sample["latents"][:, perm]
    next_latents = sample["next_latents"][:, perm]
    timesteps = sample["timesteps"][:, perm]
    old_log_probs = sample["log_probs"][:, perm]
    total = 0.0
    for j in range(train_timesteps):
        new_log_probs = dance_one_step(args, latents[:, j], next_latents[:, j], sample["encoder_hidden_states"],
                                       sample["pooled_prompt_embeds"], sample["text_ids"], sample["image_ids"],
                                       transformer, timesteps[:, j], perm[j], sigma_schedule)
        total = total + clipped_loss(new_log_probs, old_log_probs[:, j], sample["advantages"], args,
                                     args.gradient_accumulation_steps * train_timesteps)
    return total


def random_subset(num_steps: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """DanceGRPO's random ``fraction`` of the steps (a permutation's prefix), sorted into the
    sampler's order (JAGG windows follow the trajectory)."""
    count = int(num_steps * fraction)
    return torch.randperm(num_steps, generator=generator)[:count].sort().values


def dance_grpo_flux(*, num_steps: int = 10, seed: int = 0, fraction: float = 0.6) -> TrainerShape:
    """A tiny Flux with guidance embeddings (FLUX.1-dev's), one sample (DanceGRPO trains sample by
    sample), a linspace + shift-3 sigma schedule tensor, timesteps as ints ``int(sigma * 1000)``."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**{**models.FLUX_CONFIGS["tiny"], "guidance_embeds": True})
    cond = models.flux_conditioning(transformer, 1, seed=seed).kwargs
    args = replace(GRPOConfig(), clip_range=1e-4)
    sigma_schedule = sd3_time_shift(3.0, torch.linspace(1, 0, num_steps + 1))
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed + 1)            # flux_step draws its noise with randn_like
    z = torch.randn(models.flux_latent_shape(transformer, 1), generator=g)
    lat, nxt, lps = [], [], []
    transformer.eval()
    with torch.no_grad():
        for i in range(num_steps):
            t = torch.full([1], int(sigma_schedule[i] * 1000), dtype=torch.long)
            pred = transformer(hidden_states=z, encoder_hidden_states=cond["encoder_hidden_states"], timestep=t / 1000,
                               guidance=torch.tensor([3.5]), txt_ids=cond["txt_ids"],
                               pooled_projections=cond["pooled_projections"], img_ids=cond["img_ids"],
                               return_dict=False)[0]
            prev, _, log_prob = flux_step(pred, z, args.eta, sigma_schedule, i, None, True, True)
            lat.append(z)
            nxt.append(prev)
            lps.append(log_prob)
            z = prev
    sample = dict(latents=torch.stack(lat, 1), next_latents=torch.stack(nxt, 1), log_probs=torch.stack(lps, 1),
                  timesteps=torch.tensor([[int(s * 1000) for s in sigma_schedule[:num_steps]]]),
                  advantages=torch.tensor([0.8]), encoder_hidden_states=cond["encoder_hidden_states"],
                  pooled_prompt_embeds=cond["pooled_projections"], text_ids=cond["txt_ids"], image_ids=cond["img_ids"])
    off_policy_step(transformer, seed, lambda name: True)
    perm = random_subset(num_steps, fraction, torch.Generator().manual_seed(seed + 2))
    return TrainerShape("dance_grpo_flux", dance_grpo_loss, transformer, (transformer, sample, perm, sigma_schedule, args),
                        f"DanceGRPO train_grpo_flux on a tiny Flux: flux_step on a sigma-schedule tensor "
                        f"(math.sqrt of a tensor step), transformer.train() in the step, a random "
                        f"{fraction:.0%} of steps per sample",
                        extra=dict(fraction=fraction, num_steps=num_steps))
