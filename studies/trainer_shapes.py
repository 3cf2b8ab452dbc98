"""GRPO losses in the shapes the trainers write them, on tiny real DiTs with stored rollouts.

``example_losses`` holds losses written *for* jaggc. These are written the way the trainers' own
code is (read from the repositories, not copied): the same step functions with the same Python
constructs, so that what the compiler must capture is what users run.

- ``flow_grpo_sd3``: Flow-GRPO's ``train_sd3.py``. The step function looks each sample's step up
  with the scheduler's ``index_for_timestep`` (``.nonzero()``, ``len()``, ``.item()``) and reads
  ``sigmas[1].item()``; training uses CFG (one DiT call on ``[uncond; cond]``, the uncond half
  detached, guidance 4.5); the KL term (beta > 0) runs the reference under ``torch.no_grad()`` and
  peft's ``transformer.disable_adapter()`` on a ``PeftModel`` with a LoRA on the attention.
- ``dance_grpo_flux``: DanceGRPO's ``train_grpo_flux.py``. ``flux_step`` indexes a sigma-schedule
  *tensor* with a tensor step index and computes ``eta * math.sqrt(delta_t)`` and
  ``math.log(std_dev_t)``; ``grpo_one_step`` calls ``transformer.train()`` and opens a
  ``torch.autocast("cuda", torch.bfloat16)`` block around the DiT call; each sample trains its own
  random 60% of the steps (sorted: windows follow the sampler).
- ``mix_grpo_flux``: MixGRPO's ``train_grpo_flux.py`` (Tencent-Hunyuan/MixGRPO): the same
  ``grpo_one_step`` (``train()``, the CUDA bf16 block) with Flow-GRPO's SDE step on a 25-step
  shift-3 schedule tensor (``flow_grpo_step``: ``sigmas[1].item()``), a rollout that is SDE only on
  the trained window of 4 consecutive steps and ODE elsewhere, the PPO clip at 1e-4 with the loss
  divided by ``accumulation * window``, and a KL term on the log-prob differences; the window
  (``range(cur, min(cur + 4, 23))``) moves along the trajectory and shrinks to 3, 2, 1 steps at the
  end of a run.
- ``jagg_author_qwen``: the JAGG author's ``train_grpo_qwenimage_jagg.py`` (SchumiDing/eff_grpo):
  the same ``flux_step``, a Qwen-Image DiT called with ``timestep=timesteps / 1000``, a text mask and
  ``img_shapes``; ``author_two_backward`` is the author's JAGG algorithm as published (W no-grad
  forwards, upstream gradients on a detached copy, index weights j/(W-1), two separate forwards with
  grad and two backward calls: (W+6)F per window), the baseline jaggc is measured against.
- ``jaggc_helpers_sd3``: a loss built from ``jaggc.grpo``'s own helpers (``flow_grpo_sde_step``,
  ``ppo_clip_loss``), whose input checks read tensor values.

The trainers call ``backward`` per step; these return the summed loss, which ``@jagg_compile``
needs. Each factory builds the model, samples the stored trajectory without grad and moves the
parameters by a small step (one optimizer step after the rollout), so ratios are not exactly 1.

**GPU form.** The autocast blocks are written as the trainers write them, for CUDA
(``torch.autocast("cuda", torch.bfloat16)``; Flow-GRPO's ``accelerator.autocast()`` around
``compute_log_prob`` is that block on a GPU). On a CPU they switch themselves off; run a shape
under ``jaggc.testing.cuda_autocast_on_cpu()`` to make them live bf16 blocks, which is what the
trainers' code computes, and what a capture of it sees, on the GPU.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from jaggc import grpo, models

T_DEFAULT = 8
OFF_POLICY_STEP = 2e-2


@dataclass
class TrainerShape:
    """``loss_fn(*args)`` is the loss as the trainer shapes it; ``model`` the DiT it trains."""

    name: str
    loss_fn: Callable
    model: nn.Module
    args: tuple
    description: str
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GRPOConfig:
    """The trainer's hyper-parameters, passed as one object (``config.train`` in Flow-GRPO, ``args``
    in DanceGRPO): the FX capture keys its graph on what it holds."""

    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    beta: float = 0.0
    noise_level: float = 0.7
    guidance_scale: float = 4.5
    cfg: bool = True
    eta: float = 0.3
    gradient_accumulation_steps: int = 1
    kl_coeff: float = 0.0
    mixed_precision: bool = True    # Flow-GRPO: accelerator.autocast() around compute_log_prob (bf16)

    def autocast(self):
        """Flow-GRPO's ``autocast``: ``accelerator.autocast()`` with bf16 mixed precision, which on a
        GPU is this CUDA autocast block; a null context without mixed precision."""
        return torch.autocast("cuda", torch.bfloat16) if self.mixed_precision else contextlib.nullcontext()


# =============================================================================================
# Flow-GRPO (SD3): scheduler step lookup, CFG, KL reference under disable_adapter()


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
        noise = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
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
    """What the loss reads from Flow-GRPO's pipeline object: its scheduler."""

    scheduler: Any


def flow_grpo_sd3(*, num_steps: int = T_DEFAULT, batch: int = 2, seed: int = 0, beta: float = 0.04,
                  cfg: bool = True, size: str = "tiny") -> TrainerShape:
    """SD3 (tiny) wrapped by peft's ``get_peft_model`` (random rank-4 LoRA on the attention, so the
    adapter-off reference differs from the policy), a shift-3 ``FlowMatchEulerDiscreteScheduler``."""
    import peft
    from diffusers import FlowMatchEulerDiscreteScheduler

    base = models.sd3(size, seed=seed)
    lora = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                           init_lora_weights=False)
    torch.manual_seed(seed + 7)
    transformer = peft.get_peft_model(base, lora)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps + 1)
    config = GRPOConfig(beta=beta, cfg=cfg)
    g = torch.Generator().manual_seed(seed + 3)
    cfg_model = base.config
    prompts = torch.randn(batch, 5, cfg_model.joint_attention_dim, generator=g)
    pooled = torch.randn(batch, cfg_model.pooled_projection_dim, generator=g)
    sample = dict(prompt_embeds=prompts, pooled_prompt_embeds=pooled,
                  negative_prompt_embeds=torch.randn(1, 5, cfg_model.joint_attention_dim, generator=g).expand(batch, -1, -1).contiguous(),
                  negative_pooled_prompt_embeds=torch.randn(1, cfg_model.pooled_projection_dim, generator=g).expand(batch, -1).contiguous())
    z = torch.randn(models.sd3_latent_shape(base, batch), generator=g)
    latents, next_latents, log_probs = [], [], []
    pipe = Pipeline(scheduler)
    with torch.no_grad():
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
    adv = grpo.flow_grpo_advantages(rewards, [b // 2 for b in range(batch)]).to(torch.float32)
    sample.update(latents=torch.stack(latents, 1)[:, keep].contiguous(),
                  next_latents=torch.stack(next_latents, 1)[:, keep].contiguous(),
                  log_probs=torch.stack(log_probs, 1)[:, keep].contiguous(),
                  timesteps=scheduler.timesteps[:num_steps].expand(batch, -1).contiguous(),
                  advantages=adv[:, None].expand(batch, num_steps).contiguous())
    _off_policy_step(transformer, seed, lambda name: "lora_" in name)
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


# =============================================================================================
# DanceGRPO (Flux) and the JAGG author (Qwen-Image): flux_step on a schedule tensor


def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    """DanceGRPO's ``flux_step`` (also the JAGG author's): ``sigmas`` a schedule tensor, ``index``
    an int or a 0-d tensor, the std read as a Python float with ``math.sqrt``."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    if sde_solver:
        score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
        log_term = -0.5 * eta**2 * score_estimate
        prev_sample_mean = prev_sample_mean + log_term * dsigma
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
    _off_policy_step(transformer, seed, lambda name: True)
    perm = random_subset(num_steps, fraction, torch.Generator().manual_seed(seed + 2))
    return TrainerShape("dance_grpo_flux", dance_grpo_loss, transformer, (transformer, sample, perm, sigma_schedule, args),
                        f"DanceGRPO train_grpo_flux on a tiny Flux: flux_step on a sigma-schedule tensor "
                        f"(math.sqrt of a tensor step), transformer.train() in the step, a random "
                        f"{fraction:.0%} of steps per sample",
                        extra=dict(fraction=fraction, num_steps=num_steps))


def author_one_step(args, latents, pre_latents, encoder_hidden_states, prompt_attention_masks, img_shapes,
                    transformer, timesteps, i, sigma_schedule):
    """The JAGG author's ``grpo_one_step`` on Qwen-Image (diffusers 0.42 has no ``txt_seq_lens``)."""
    return one_step(args, transformer, latents, pre_latents, i, sigma_schedule, timestep=timesteps / 1000,
                    guidance=None, encoder_hidden_states_mask=prompt_attention_masks,
                    encoder_hidden_states=encoder_hidden_states, img_shapes=img_shapes, attention_kwargs=None)


def author_qwen_loss(transformer, sample, sigma_indices, sigma_schedule, args):
    """The author's per-step loss over the trained steps (``sigma_indices``: Python ints)."""
    total = 0.0
    n = len(sigma_indices)
    for j in range(n):
        log_prob = author_one_step(args, sample["latents"][:, j], sample["next_latents"][:, j],
                                   sample["encoder_hidden_states"], sample["prompt_attention_masks"],
                                   sample["img_shapes"], transformer, sample["timesteps"][:, j], sigma_indices[j],
                                   sigma_schedule)
        total = total + clipped_loss(log_prob, sample["log_probs"][:, j], sample["advantages"], args,
                                     args.gradient_accumulation_steps * n)
    return total


def author_two_backward(transformer, sample, sigma_indices, sigma_schedule, args, *, window: int = 4,
                        weights: str = "index") -> float:
    """The author's JAGG as published, run on every window of ``window`` consecutive trained steps:
    per window W no-grad forwards, each step's upstream gradient through ``flux_step`` + PPO-clip on
    a detached copy of its output, knot weights j/(W-1) (``weights="t"``: by timestep, the
    reference JAGG), then a forward with grad and a ``backward(gradient=...)`` at each end. Returns
    the loss value; the gradient is accumulated into ``.grad``. Cost: (W+6)F per window."""
    n = len(sigma_indices)
    loss_value = 0.0
    norm = args.gradient_accumulation_steps * n

    def call(j, grad):
        with torch.set_grad_enabled(grad):
            transformer.train()
            return transformer(hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j] / 1000,
                               guidance=None, encoder_hidden_states_mask=sample["prompt_attention_masks"],
                               encoder_hidden_states=sample["encoder_hidden_states"], img_shapes=sample["img_shapes"],
                               attention_kwargs=None, return_dict=False)[0]

    for start in range(0, n, window):
        steps = list(range(start, min(start + window, n)))
        upstream = []
        for j in steps:
            pred = call(j, grad=False).detach().to(torch.float32).requires_grad_(True)
            _, _, log_prob = flux_step(pred, sample["latents"][:, j].to(torch.float32), args.eta, sigma_schedule,
                                       sigma_indices[j], prev_sample=sample["next_latents"][:, j].to(torch.float32),
                                       grpo=True, sde_solver=True)
            loss_j = clipped_loss(log_prob, sample["log_probs"][:, j], sample["advantages"], args, norm)
            (g,) = torch.autograd.grad(loss_j, pred)
            upstream.append(g)
            loss_value += float(loss_j)
        if len(steps) == 1:
            call(steps[0], grad=True).backward(gradient=upstream[0])
            continue
        if weights == "index":
            alpha = [k / (len(steps) - 1) for k in range(len(steps))]
        else:
            ts = [float(sample["timesteps"][0, j]) for j in steps]
            alpha = [(t - ts[0]) / (ts[-1] - ts[0]) for t in ts]
        g_first = sum((1 - a) * g for a, g in zip(alpha, upstream))
        g_last = sum(a * g for a, g in zip(alpha, upstream))
        call(steps[0], grad=True).backward(gradient=g_first)
        call(steps[-1], grad=True).backward(gradient=g_last)
    return loss_value


def jagg_author_qwen(*, num_steps: int = 8, batch: int = 1, seed: int = 0, size: str = "tiny") -> TrainerShape:
    """A small Qwen-Image DiT (diffusers ``QwenImageTransformer2DModel``, ``models.QWEN_CONFIGS``),
    packed latents, a linspace + shift-3 schedule, all steps trained (the author's windows tile them)."""
    transformer = models.qwen_image(size, seed=seed)
    config = models.QWEN_CONFIGS[size]
    args = replace(GRPOConfig(), clip_range=0.1)     # the author's runs
    h = w = models.QWEN_LATENT_SIDE[size]
    g = torch.Generator().manual_seed(seed + 1)
    text = torch.randn(batch, 5, config["joint_attention_dim"], generator=g)
    mask = torch.ones(batch, 5, dtype=torch.long)
    img_shapes = [[(1, h, w)]]
    sigma_schedule = sd3_time_shift(3.0, torch.linspace(1, 0, num_steps + 1))
    torch.manual_seed(seed + 1)
    z = torch.randn(batch, h * w, config["in_channels"], generator=g)
    lat, nxt, lps, ts = [], [], [], []
    transformer.eval()
    with torch.no_grad():
        for i in range(num_steps):
            t = torch.full([batch], int(sigma_schedule[i] * 1000), dtype=torch.long)
            pred = transformer(hidden_states=z, timestep=t / 1000, guidance=None, encoder_hidden_states_mask=mask,
                               encoder_hidden_states=text, img_shapes=img_shapes, return_dict=False)[0]
            prev, _, log_prob = flux_step(pred, z, args.eta, sigma_schedule, i, None, True, True)
            lat.append(z)
            nxt.append(prev)
            lps.append(log_prob)
            ts.append(t)
            z = prev
    sample = dict(latents=torch.stack(lat, 1), next_latents=torch.stack(nxt, 1), log_probs=torch.stack(lps, 1),
                  timesteps=torch.stack(ts, 1), advantages=torch.linspace(-0.9, 0.9, batch) if batch > 1 else torch.tensor([0.7]),
                  encoder_hidden_states=text, prompt_attention_masks=mask, img_shapes=img_shapes)
    _off_policy_step(transformer, seed, lambda name: True)
    return TrainerShape("jagg_author_qwen", author_qwen_loss, transformer,
                        (transformer, sample, list(range(num_steps)), sigma_schedule, args),
                        "the JAGG author's Qwen-Image trainer: flux_step on a sigma-schedule tensor with int step "
                        "indices, transformer.train() in the step, timestep / 1000, a text mask and img_shapes")


# =============================================================================================
# MixGRPO (Flux): a 4-step SDE window that moves along the trajectory


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
    _off_policy_step(transformer, seed, lambda name: True)
    return TrainerShape("mix_grpo_flux", mix_grpo_loss, transformer, (transformer, sample, window, sigma_schedule, args),
                        f"MixGRPO train_grpo_flux on a Flux ({size}): grpo_one_step with transformer.train() and a CUDA "
                        f"bf16 autocast block, Flow-GRPO's SDE step on a 25-step schedule tensor, a {len(window)}-step "
                        f"window at step {cur}, clip 1e-4, KL on log-prob differences",
                        extra=dict(cur=cur, per_step=mix_grpo_per_step))


# =============================================================================================
# jaggc's own helpers


def helpers_loss(dit, batch, config):
    """A Flow-GRPO loss built from ``jaggc.grpo``: its step and PPO-clip helpers check their inputs
    (``bool(torch.isfinite(sigma).all())``, ranges) by reading tensor values."""
    num_steps = batch["timesteps"].shape[1]
    total = 0.0
    for j in range(num_steps):
        v = dit(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"],
                return_dict=False)[0]
        step = grpo.flow_grpo_sde_step(v, batch["latents"][:, j], batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                       noise_level=config.noise_level, sigma_max=float(batch["sigma_max"]),
                                       prev_sample=batch["next_latents"][:, j])
        per_sample = grpo.ppo_clip_loss(step.log_prob, batch["log_probs"][:, j], batch["advantages"][:, j],
                                        clip_range=config.clip_range, adv_clip_max=config.adv_clip_max)
        total = total + per_sample.mean()
    return total / num_steps


def jaggc_helpers_sd3(*, num_steps: int = T_DEFAULT, batch: int = 2, seed: int = 0) -> TrainerShape:
    from jaggc_studies import example_losses

    ex = example_losses.flow_grpo_sd3(num_steps=num_steps, batch=batch, seed=seed)
    config = GRPOConfig(clip_range=0.1)
    return TrainerShape("jaggc_helpers_sd3", helpers_loss, ex.model, (ex.model, ex.batch, config),
                        "a Flow-GRPO loss from jaggc.grpo's flow_grpo_sde_step + ppo_clip_loss on a tiny SD3")


# =============================================================================================


@torch.no_grad()
def _off_policy_step(model: nn.Module, seed: int, trained: Callable[[str], bool]) -> None:
    """Move the trained parameters by OFF_POLICY_STEP times their RMS (one optimizer step)."""
    g = torch.Generator().manual_seed(seed + 2)
    for name, p in model.named_parameters():
        if trained(name):
            scale = p.float().pow(2).mean().sqrt().item()
            p.add_(torch.randn(p.shape, generator=g) * OFF_POLICY_STEP * scale)


SHAPES: dict[str, Callable[..., TrainerShape]] = {
    "flow_grpo_sd3": flow_grpo_sd3,
    "dance_grpo_flux": dance_grpo_flux,
    "mix_grpo_flux": mix_grpo_flux,
    "jagg_author_qwen": jagg_author_qwen,
    "jaggc_helpers_sd3": jaggc_helpers_sd3,
}
