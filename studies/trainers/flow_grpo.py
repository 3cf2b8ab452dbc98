"""Flow-GRPO (SD3), ``train_sd3.py``'s shape: the scheduler's step lookup (``index_for_timestep``:
``.nonzero()``, ``len()``, ``.item()``), CFG with the uncond half detached, and the KL reference under
``torch.no_grad()`` and peft's ``disable_adapter()`` (trainer_shapes.py's docstring has the whole list)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from jaggc import grpo

from . import sizes
from .common import T_DEFAULT, GRPOConfig, TrainerShape, off_policy_step


def sde_step_with_logprob(scheduler, model_output, timestep, sample, noise_level=0.7, prev_sample=None,
                          generator=None):
    """The SDE step and log-prob of Flow-GRPO's ``sd3_sde_with_logprob.py``, same lookups."""
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [scheduler.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = scheduler.sigmas[step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_prev = scheduler.sigmas[prev_step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_max = scheduler.sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        # diffusers' randn_tensor, as the trainer draws it: on the generator's device, then moved
        noise = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype,
                            device=generator.device if generator is not None else model_output.device)
        noise = noise.to(model_output.device)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def compute_log_prob(transformer, pipeline, sample, j, embeds, pooled_embeds, config):
    """Flow-GRPO's ``compute_log_prob``: the DiT on ``[latents] * 2`` under CFG, then the SDE step."""
    if config.cfg:
        noise_pred = transformer(
            hidden_states=torch.cat([sample["latents"][:, j]] * 2),
            timestep=torch.cat([sample["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred_uncond = noise_pred_uncond.detach()
        noise_pred = noise_pred_uncond + config.guidance_scale * (noise_pred_text - noise_pred_uncond)
    else:
        noise_pred = transformer(
            hidden_states=sample["latents"][:, j],
            timestep=sample["timesteps"][:, j],
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
    return sde_step_with_logprob(pipeline.scheduler, noise_pred.float(), sample["timesteps"][:, j],
                                 sample["latents"][:, j].float(), prev_sample=sample["next_latents"][:, j].float(),
                                 noise_level=config.noise_level)


def flow_grpo_loss(transformer, pipeline, sample, config):
    """Flow-GRPO's inner loop over the trained timesteps, summed (the trainer backpropagates each
    step's loss; the sum has the same gradient)."""
    if config.cfg:
        embeds = torch.cat([sample["negative_prompt_embeds"], sample["prompt_embeds"]])
        pooled_embeds = torch.cat([sample["negative_pooled_prompt_embeds"], sample["pooled_prompt_embeds"]])
    else:
        embeds, pooled_embeds = sample["prompt_embeds"], sample["pooled_prompt_embeds"]
    num_train_timesteps = sample["timesteps"].shape[1]
    total = 0.0
    for j in range(num_train_timesteps):
        with config.autocast():
            _, log_prob, prev_sample_mean, std_dev_t = compute_log_prob(
                transformer, pipeline, sample, j, embeds, pooled_embeds, config)
            if config.beta > 0:
                with torch.no_grad():
                    with transformer.disable_adapter():
                        _, _, prev_sample_mean_ref, _ = compute_log_prob(
                            transformer, pipeline, sample, j, embeds, pooled_embeds, config)
        advantages = torch.clamp(sample["advantages"][:, j], -config.adv_clip_max, config.adv_clip_max)
        ratio = torch.exp(log_prob - sample["log_probs"][:, j])
        unclipped_loss = -advantages * ratio
        clipped_loss = -advantages * torch.clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range)
        loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
        if config.beta > 0:
            kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
            loss = loss + config.beta * torch.mean(kl_loss)
        total = total + loss
    return total / num_train_timesteps


@dataclass
class Pipeline:
    """What the loss reads from Flow-GRPO's pipeline object: its scheduler; the sampler reads its
    transformer (the peft model, which the training loop uses through ``accelerator.prepare``)."""

    scheduler: Any
    transformer: Any = None


def flow_grpo_sd3(*, num_steps: int = T_DEFAULT, batch: int = 2, seed: int = 0, beta: float = 0.04,
                  cfg: bool = True, size: str = "tiny", where: sizes.Where | None = None) -> TrainerShape:
    """SD3 wrapped by peft's ``get_peft_model`` (small sizes: a random rank-4 LoRA on the attention, so
    the adapter-off reference differs from the policy; ``where=Where("published")``: SD3.5-Medium with
    Flow-GRPO's LoRA, trainers/sizes.py), a shift-3 ``FlowMatchEulerDiscreteScheduler``. ``where``
    also gives the device and the base weights' dtype (the LoRA stays float32, as peft makes it)."""
    import peft
    from diffusers import FlowMatchEulerDiscreteScheduler

    where = where if where is not None else sizes.Where(size)
    device = torch.device(where.device)
    base = sizes.sd3(where, seed=seed)
    if where.dtype != torch.float32:
        from jaggc_studies.bench.model_configs import cast

        base = cast(base, dtype=where.dtype)
    torch.manual_seed(seed + 7)
    transformer = peft.get_peft_model(base, peft.LoraConfig(**sizes.sd3_lora(where)))
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()     # Flow-GRPO trains its LoRA in float32 beside a half-precision base
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps + 1, device=device)
    config = GRPOConfig(beta=beta, cfg=cfg)
    g = torch.Generator().manual_seed(seed + 3)
    cfg_model = base.config
    text_len = sizes.sd3_text_len(where)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    prompts = randn(batch, text_len, cfg_model.joint_attention_dim)
    pooled = randn(batch, cfg_model.pooled_projection_dim)
    sample = dict(prompt_embeds=prompts, pooled_prompt_embeds=pooled,
                  negative_prompt_embeds=randn(1, text_len, cfg_model.joint_attention_dim).expand(batch, -1, -1).contiguous(),
                  negative_pooled_prompt_embeds=randn(1, cfg_model.pooled_projection_dim).expand(batch, -1).contiguous())
    z = randn(*sizes.sd3_latent_shape(base, batch, where))
    latents, next_latents, log_probs = [], [], []
    pipe = Pipeline(scheduler)
    # a half-precision base samples under autocast, as the prepared model's forward runs (accelerate)
    half = where.dtype in (torch.bfloat16, torch.float16)
    autocast = torch.autocast(device.type, where.dtype) if half else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        for k in range(num_steps + 1):
            t = scheduler.timesteps[k].expand(batch)
            step = {"latents": z[:, None], "timesteps": t[:, None]}
            embeds = torch.cat([sample["negative_prompt_embeds"], prompts]) if cfg else prompts
            pooled_embeds = torch.cat([sample["negative_pooled_prompt_embeds"], pooled]) if cfg else pooled
            v = _velocity(transformer, step, embeds, pooled_embeds, config)
            prev, log_prob, _, _ = sde_step_with_logprob(scheduler, v, t, z, noise_level=config.noise_level, generator=g)
            latents.append(z)
            next_latents.append(prev)
            log_probs.append(log_prob)
            z = prev
    keep = slice(0, num_steps)     # Flow-GRPO does not train the last step
    rewards = -(z ** 2).mean(dim=(1, 2, 3))
    adv = grpo.flow_grpo_advantages(rewards.cpu(), [b // 2 for b in range(batch)]).to(device, torch.float32)
    sample.update(latents=torch.stack(latents, 1)[:, keep].contiguous(),
                  next_latents=torch.stack(next_latents, 1)[:, keep].contiguous(),
                  log_probs=torch.stack(log_probs, 1)[:, keep].contiguous(),
                  timesteps=scheduler.timesteps[:num_steps].expand(batch, -1).contiguous(),
                  advantages=adv[:, None].expand(batch, num_steps).contiguous())
    off_policy_step(transformer, seed, lambda name: "lora_" in name)
    return TrainerShape("flow_grpo_sd3", flow_grpo_loss, transformer, (transformer, pipe, sample, config),
                        f"Flow-GRPO train_sd3 on a tiny SD3 + LoRA: scheduler index_for_timestep step lookup, "
                        f"CFG {config.guidance_scale} (uncond detached), KL beta {beta} under disable_adapter()")


def _velocity(transformer, step, embeds, pooled_embeds, config):
    out = transformer(hidden_states=torch.cat([step["latents"][:, 0]] * 2) if config.cfg else step["latents"][:, 0],
                      timestep=torch.cat([step["timesteps"][:, 0]] * 2) if config.cfg else step["timesteps"][:, 0],
                      encoder_hidden_states=embeds, pooled_projections=pooled_embeds, return_dict=False)[0]
    if not config.cfg:
        return out
    uncond, text = out.chunk(2)
    return uncond + config.guidance_scale * (text - uncond)
