"""MixGRPO (Flux), Tencent-Hunyuan/MixGRPO ``train_grpo_flux.py``'s shape: DanceGRPO's
``grpo_one_step`` with Flow-GRPO's SDE step on a 25-step shift-3 schedule, SDE only on a trained
window of 4 steps that moves along the trajectory."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from jaggc import models

from .common import GRPOConfig, TrainerShape, off_policy_step
from .dance_grpo import sd3_time_shift


MIX_SAMPLING_STEPS = 25
MIX_WINDOW = 4
MIX_LAST_TRAINED = 23          # GRPOTrainingStates trains range(cur, min(cur + 4, 23))


def mix_train_timesteps(cur: int, window: int = MIX_WINDOW, last: int = MIX_LAST_TRAINED) -> range:
    """The steps MixGRPO trains at window position ``cur``: 4, then 3, 2, 1 near the end."""
    return range(cur, min(cur + window, last))


def flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample, determistic=False, noise_level=None):
    """Flow-GRPO's SDE step as MixGRPO's ``flow_grpo_step`` writes it: ``sigmas`` a schedule tensor,
    ``index`` an int, ``sigma_max`` read with ``.item()``; returns (next sample, x0, log-prob, mean, std)."""
    sigma = sigmas[index].to(model_output.device)
    sigma_prev = sigmas[index + 1].to(model_output.device)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    level = eta if noise_level is None else noise_level
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * level
    pred_original_sample = latents - sigma * model_output
    prev_sample_mean = (latents * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * torch.randn_like(prev_sample_mean)
    if determistic:
        prev_sample = latents + dt * model_output
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, device=model_output.device))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, pred_original_sample, log_prob, prev_sample_mean, std_dev_t * torch.sqrt(-1 * dt)


def mix_one_step(args, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, text_ids, image_ids,
                 transformer, timesteps, i, sigma_schedule):
    """MixGRPO's ``grpo_one_step``: ``transformer.train()``, the Flux call in a CUDA bf16 autocast
    block (guidance 3.5 as a bf16 tensor), then Flow-GRPO's SDE log-prob of the stored next state."""
    transformer.train()
    with torch.autocast("cuda", torch.bfloat16):
        pred = transformer(hidden_states=latents, encoder_hidden_states=encoder_hidden_states, timestep=timesteps / 1000,
                           guidance=torch.tensor([3.5], device=latents.device, dtype=torch.bfloat16),
                           txt_ids=text_ids, pooled_projections=pooled_prompt_embeds, img_ids=image_ids,
                           joint_attention_kwargs=None, return_dict=False)[0]
    _, _, log_prob, _, _ = flow_grpo_step(pred, latents.to(torch.float32), args.eta, sigma_schedule, i,
                                          prev_sample=pre_latents.to(torch.float32), noise_level=args.noise_level)
    return log_prob


def mix_step_loss(transformer, sample, step, train_timesteps, sigma_schedule, args):
    """One trained step of MixGRPO's loop: PPO clip at ``clip_range`` on clamped advantages, divided
    by ``accumulation * len(window)``, plus ``kl_coeff`` times half the mean squared log-prob change."""
    new_log_probs = mix_one_step(args, sample["latents"][:, step], sample["next_latents"][:, step],
                                 sample["encoder_hidden_states"], sample["pooled_prompt_embeds"], sample["text_ids"],
                                 sample["image_ids"], transformer, sample["timesteps"][:, step], step, sigma_schedule)
    advantages = torch.clamp(sample["advantages"], -args.adv_clip_max, args.adv_clip_max)
    ratio = torch.exp(new_log_probs - sample["log_probs"][:, step])
    unclipped_loss = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - args.clip_range, 1.0 + args.clip_range)
    norm = args.gradient_accumulation_steps * len(train_timesteps)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped)) / norm
    kl_loss = 0.5 * torch.mean((new_log_probs - sample["log_probs"][:, step]) ** 2) / norm
    return policy_loss + args.kl_coeff * kl_loss


def mix_grpo_loss(transformer, sample, train_timesteps, sigma_schedule, args):
    """MixGRPO's inner loop over the window's steps, summed (the trainer backpropagates each)."""
    total = 0.0
    for step in train_timesteps:
        total = total + mix_step_loss(transformer, sample, step, train_timesteps, sigma_schedule, args)
    return total


def mix_grpo_per_step(transformer, sample, train_timesteps, sigma_schedule, args) -> float:
    """MixGRPO's own training loop for one sample: ``loss.backward()`` after every step."""
    value = 0.0
    for step in train_timesteps:
        loss = mix_step_loss(transformer, sample, step, train_timesteps, sigma_schedule, args)
        loss.backward()
        value += float(loss.detach())
    return value


def mix_grpo_flux(*, num_steps: int | None = None, seed: int = 0, size: str = "tiny", cur: int = 0) -> TrainerShape:
    """A Flux with guidance embeddings (FLUX.1-dev's), one sample (MixGRPO trains sample by sample),
    a 25-step linspace + shift-3 schedule, a rollout that is SDE (eta 0.7) on the window at ``cur``
    and ODE elsewhere, 24 stored steps; the loss trains ``mix_train_timesteps(cur)``. ``num_steps``
    (the other shapes' trajectory length) is accepted and ignored: MixGRPO's trajectory is fixed."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**{**models.FLUX_CONFIGS[size], "guidance_embeds": True})
    cond = models.flux_conditioning(transformer, 1, seed=seed).kwargs
    # kl_coeff: the trainer's argparse default (its Flash script passes 0.0: the KL term unexercised)
    args = replace(GRPOConfig(), clip_range=1e-4, eta=0.7, noise_level=0.7, kl_coeff=0.01)
    sigma_schedule = sd3_time_shift(3.0, torch.linspace(1, 0, MIX_SAMPLING_STEPS + 1))
    window = mix_train_timesteps(cur)
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed + 1)            # the SDE steps draw their noise with randn_like
    z = torch.randn(models.flux_latent_shape(transformer, 1), generator=g)
    lat, lps = [z], []
    transformer.eval()
    with torch.no_grad():
        for i in range(MIX_SAMPLING_STEPS):
            t = torch.full([1], int(sigma_schedule[i] * 1000), dtype=torch.long)
            pred = transformer(hidden_states=z, encoder_hidden_states=cond["encoder_hidden_states"], timestep=t / 1000,
                               guidance=torch.tensor([3.5]), txt_ids=cond["txt_ids"],
                               pooled_projections=cond["pooled_projections"], img_ids=cond["img_ids"],
                               return_dict=False)[0]
            z, _, log_prob, _, _ = flow_grpo_step(pred, z, args.eta, sigma_schedule, i, None,
                                                  determistic=i not in window, noise_level=args.noise_level)
            lat.append(z)
            lps.append(log_prob)
    stored = MIX_SAMPLING_STEPS - 1          # the trainer drops the last step twice over: 24 stored
    all_latents = torch.stack(lat, 1)
    timesteps = torch.tensor([[int(s * 1000) for s in sigma_schedule[:MIX_SAMPLING_STEPS]]])
    sample = dict(latents=all_latents[:, :stored].contiguous(), next_latents=all_latents[:, 1:stored + 1].contiguous(),
                  log_probs=torch.stack(lps, 1)[:, :stored].contiguous(), timesteps=timesteps[:, :stored],
                  advantages=torch.tensor([0.8]), encoder_hidden_states=cond["encoder_hidden_states"],
                  pooled_prompt_embeds=cond["pooled_projections"], text_ids=cond["txt_ids"], image_ids=cond["img_ids"])
    off_policy_step(transformer, seed, lambda name: True)
    return TrainerShape("mix_grpo_flux", mix_grpo_loss, transformer, (transformer, sample, window, sigma_schedule, args),
                        f"MixGRPO train_grpo_flux on a Flux ({size}): grpo_one_step with transformer.train() and a CUDA "
                        f"bf16 autocast block, Flow-GRPO's SDE step on a 25-step schedule tensor, a {len(window)}-step "
                        f"window at step {cur}, clip 1e-4, KL on log-prob differences",
                        extra=dict(cur=cur, per_step=mix_grpo_per_step))
