"""Built-in example GRPO losses, written the way trainers write them, each with a tiny model and a
stored trajectory to run it on.

The losses follow Flow-GRPO's training loop (yifan123/flow_grpo, scripts/train_sd3.py): a dict
batch of stored rollouts indexed ``batch["latents"][:, j]`` for ``j in range(num_steps)``, the
DiT passed as an argument and called as a module with ``return_dict=False`` (or ``.sample``), the
step's Gaussian log-probability written out inline (Flow-GRPO's ``sde_step_with_logprob``,
DanceGRPO's ``flux_step``) with reductions over ``tuple(range(1, x.ndim))``, and the PPO clipped
ratio loss. They return the summed loss instead of calling ``backward`` per step, which is what
``jaggc.jagg_compile`` needs.

Each factory samples its trajectory with no grad, with the example's own model and the step
functions of :mod:`jaggc.grpo` on a shift-3 flow-matching schedule (``flow_match_sigmas``), all in
fp32 from a fixed seed. Like Flow-GRPO it samples ``num_steps + 1`` steps and trains the first
``num_steps`` (the last step's tiny sigma is dropped). Advantages are Flow-GRPO's per-prompt
normalised rewards over groups of two samples per prompt (reward: a simple latent statistic).
After the rollout the model's parameters are moved by a small deterministic step, as after one
optimizer step of the PPO inner loop, so the ratios are not exactly 1 (but stay far inside the
clip range, so no sample sits on a clipping boundary).

Usage::

    ex = build_example("flow_grpo_sd3", num_steps=8, batch=2, seed=0)
    loss = jaggc.jagg_compile(ex.loss_fn, window=4)(ex.model, ex.batch)
    loss.backward()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from jaggc import grpo, models
from jaggc.verify.grpo_losses import flux_step   # DanceGRPO's step, the verifier's oracle

NOISE_LEVEL = 0.7        # Flow-GRPO's SDE noise level a
ETA = 0.3                # DanceGRPO's eta
CLIP_RANGE = 0.1         # PPO epsilon (the JAGG author's runs; Flow-GRPO SD3 uses 1e-4)
ADV_CLIP_MAX = 5.0
GUIDANCE_SCALE = 4.5     # Flow-GRPO SD3 CFG scale
KL_BETA = 0.04           # Flow-GRPO's beta
OFF_POLICY_STEP = 5e-2   # relative size of the parameter step taken after the rollout
SHIFT = 3.0
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class Example:
    """A loss ``loss_fn(dit, batch) -> scalar``, the model to call it with and a stored batch."""

    name: str
    loss_fn: Callable
    model: nn.Module
    batch: dict
    description: str


# ---------------------------------------------------------------------------------------------
# the losses (user code: everything below up to the factories is what a trainer would write)


def sde_step_with_logprob(model_output, sample, sigma, sigma_next, prev_sample, sigma_max,
                          noise_level=NOISE_LEVEL):
    """Flow-GRPO's ``sde_step_with_logprob`` (sde_type='sde') on a stored transition; sigma,
    sigma_next are per-sample (B,) tensors, sigma_max = sigmas[1] of the schedule (0-d tensor)."""
    model_output = model_output.float()
    sample = sample.float()
    prev_sample = prev_sample.float()
    sigma = sigma.view(-1, *([1] * (sample.ndim - 1)))
    sigma_prev = sigma_next.view(-1, *([1] * (sample.ndim - 1)))
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    std = std_dev_t * torch.sqrt(-1 * dt)
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std**2)
                - torch.log(std) - _LOG_SQRT_2PI)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def ppo_clip(log_prob, old_log_prob, advantages, clip_range=None):
    """Flow-GRPO's clipped-ratio loss; ``clip_range`` defaults to ``CLIP_RANGE`` (read per call)."""
    clip_range = CLIP_RANGE if clip_range is None else clip_range
    advantages = torch.clamp(advantages, -ADV_CLIP_MAX, ADV_CLIP_MAX)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


def flow_grpo_sd3_loss(transformer, batch):
    """Flow-GRPO on SD3: SDE step log-prob + PPO clip, averaged over the trained steps."""
    num_train_timesteps = batch["timesteps"].shape[1]
    total = 0.0
    for j in range(num_train_timesteps):
        latents = batch["latents"][:, j]
        noise_pred = transformer(
            hidden_states=latents,
            timestep=batch["timesteps"][:, j],
            encoder_hidden_states=batch["prompt_embeds"],
            pooled_projections=batch["pooled_prompt_embeds"],
            return_dict=False,
        )[0]
        _, log_prob, _, _ = sde_step_with_logprob(
            noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
            batch["next_latents"][:, j], batch["sigma_max"])
        policy_loss = ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
        total = total + policy_loss
    return total / num_train_timesteps


def dance_flux_loss(transformer, batch):
    """DanceGRPO on Flux: flux_step log-prob + PPO clip, each step's loss divided by the step
    count as DanceGRPO does; the DiT output is read as ``.sample`` (return_dict=True)."""
    num_steps = batch["timesteps"].shape[1]
    total = 0.0
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        pred = transformer(
            hidden_states=latents,
            encoder_hidden_states=batch["encoder_hidden_states"],
            timestep=batch["timesteps"][:, j] / 1000,
            pooled_projections=batch["pooled_prompt_embeds"],
            txt_ids=batch["text_ids"],
            img_ids=batch["image_ids"],
            joint_attention_kwargs=None,
            return_dict=True,
        ).sample
        log_prob = flux_step(pred, latents.to(torch.float32), ETA, batch["sigmas"][:, j],
                             batch["sigmas_next"][:, j], batch["next_latents"][:, j].to(torch.float32))
        loss = ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
        total = total + loss / num_steps
    return total


def dance_flux_dev_loss(transformer, batch):
    """``dance_flux_loss`` on a guidance-distilled Flux (FLUX.1-dev): DanceGRPO passes the
    distilled guidance scale to every DiT call."""
    num_steps = batch["timesteps"].shape[1]
    total = 0.0
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        pred = transformer(
            hidden_states=latents,
            encoder_hidden_states=batch["encoder_hidden_states"],
            timestep=batch["timesteps"][:, j] / 1000,
            guidance=batch["guidance"],
            pooled_projections=batch["pooled_prompt_embeds"],
            txt_ids=batch["text_ids"],
            img_ids=batch["image_ids"],
            joint_attention_kwargs=None,
            return_dict=True,
        ).sample
        log_prob = flux_step(pred, latents.to(torch.float32), ETA, batch["sigmas"][:, j],
                             batch["sigmas_next"][:, j], batch["next_latents"][:, j].to(torch.float32))
        loss = ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
        total = total + loss / num_steps
    return total


def cfg_sd3_loss(transformer, batch):
    """Flow-GRPO on SD3 with classifier-free guidance in training: one DiT call on the
    [uncond, cond] batch of 2B, ``chunk(2)``, the unconditional half detached, guidance 4.5."""
    num_train_timesteps = batch["timesteps"].shape[1]
    embeds = torch.cat([batch["negative_prompt_embeds"], batch["prompt_embeds"]])
    pooled_embeds = torch.cat([batch["negative_pooled_prompt_embeds"], batch["pooled_prompt_embeds"]])
    total = 0.0
    for j in range(num_train_timesteps):
        latents = batch["latents"][:, j]
        noise_pred = transformer(
            hidden_states=torch.cat([latents] * 2),
            timestep=torch.cat([batch["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred_uncond = noise_pred_uncond.detach()
        noise_pred = noise_pred_uncond + GUIDANCE_SCALE * (noise_pred_text - noise_pred_uncond)
        _, log_prob, _, _ = sde_step_with_logprob(
            noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
            batch["next_latents"][:, j], batch["sigma_max"])
        total = total + ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
    return total / num_train_timesteps


def kl_reference_sd3_loss(transformer, batch):
    """Flow-GRPO on SD3 with the KL penalty: a no-grad reference forward per step and
    beta * mean((mu - mu_ref)^2) / (2 std_dev_t^2). Flow-GRPO disables its LoRA adapter for the
    reference; this example has no adapter, so the reference is the policy itself (the KL is ~0):
    it checks that no-grad reference calls are left as they are."""
    num_train_timesteps = batch["timesteps"].shape[1]
    total = 0.0
    for j in range(num_train_timesteps):
        latents = batch["latents"][:, j]
        kwargs = dict(hidden_states=latents, timestep=batch["timesteps"][:, j],
                      encoder_hidden_states=batch["prompt_embeds"],
                      pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)
        noise_pred = transformer(**kwargs)[0]
        _, log_prob, prev_sample_mean, std_dev_t = sde_step_with_logprob(
            noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
            batch["next_latents"][:, j], batch["sigma_max"])
        with torch.no_grad():
            noise_pred_ref = transformer(**kwargs)[0]
            _, _, prev_sample_mean_ref, _ = sde_step_with_logprob(
                noise_pred_ref, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                batch["next_latents"][:, j], batch["sigma_max"])
        policy_loss = ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
        kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(
            dim=tuple(range(1, latents.ndim)), keepdim=True) / (2 * std_dev_t**2)
        kl_loss = torch.mean(kl_loss)
        total = total + policy_loss + KL_BETA * kl_loss
    return total / num_train_timesteps


# ---------------------------------------------------------------------------------------------
# rollouts (no grad, the model itself, jaggc.grpo step functions)


def _prompt_ids(batch: int) -> list[int]:
    return [b // 2 for b in range(batch)]   # groups of two samples per prompt


def _per_prompt(t: torch.Tensor, batch: int) -> torch.Tensor:
    return t[torch.tensor(_prompt_ids(batch))].contiguous()


@torch.no_grad()
def _rollout(velocity: Callable, z0: torch.Tensor, num_steps: int, step_kind: str, *, seed: int,
             timestep_scale: float = 1000.0) -> dict:
    """Sample ``num_steps + 1`` SDE steps from z0 and store the first ``num_steps``."""
    sigmas = grpo.flow_match_sigmas(num_steps + 1, shift=SHIFT).to(torch.float32).to(z0.device)
    g = torch.Generator().manual_seed(seed + 1)
    bsz = z0.shape[0]
    z = z0
    lat, nxt, lps, sig, sig_next = [], [], [], [], []
    for k in range(num_steps + 1):
        s = sigmas[k].expand(bsz).contiguous()
        sn = sigmas[k + 1].expand(bsz).contiguous()
        v = velocity(z, s)
        if step_kind == "flow_grpo_sde":
            step = grpo.flow_grpo_sde_step(v, z, s, sn, noise_level=NOISE_LEVEL, sigma_max=float(sigmas[1]),
                                           generator=g)
        else:
            step = grpo.dance_flux_step(v, z, s, sn, eta=ETA, generator=g)
        lat.append(z)
        nxt.append(step.prev_sample)
        lps.append(step.log_prob)
        sig.append(s)
        sig_next.append(sn)
        z = step.prev_sample
    keep = slice(0, num_steps)   # Flow-GRPO drops the last step
    rewards = -(z.float() ** 2).mean(dim=tuple(range(1, z.ndim))).cpu()   # a simple image statistic
    adv = grpo.flow_grpo_advantages(rewards, _prompt_ids(bsz)).to(torch.float32).to(z0.device)
    sigma = torch.stack(sig, 1)[:, keep].contiguous()
    return dict(
        latents=torch.stack(lat, 1)[:, keep].contiguous(),
        next_latents=torch.stack(nxt, 1)[:, keep].contiguous(),
        timesteps=(sigma * timestep_scale).contiguous(),
        sigmas=sigma,
        sigmas_next=torch.stack(sig_next, 1)[:, keep].contiguous(),
        sigma_max=sigmas[1].clone(),
        log_probs=torch.stack(lps, 1)[:, keep].contiguous(),
        advantages=adv[:, None].expand(bsz, num_steps).contiguous(),
    )


@torch.no_grad()
def _off_policy_step(model: nn.Module, seed: int) -> None:
    """Move every parameter by OFF_POLICY_STEP times its RMS in a random direction."""
    g = torch.Generator().manual_seed(seed + 2)
    for p in model.parameters():
        scale = p.detach().float().pow(2).mean().sqrt().item()
        p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * OFF_POLICY_STEP * scale)


def _sd3_setup(batch: int, seed: int):
    model = models.sd3("tiny", seed=seed)
    cfg = model.config
    num_prompts = (batch + 1) // 2
    g = torch.Generator().manual_seed(seed + 3)
    embeds = torch.randn(num_prompts, 5, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(num_prompts, cfg.pooled_projection_dim, generator=g)
    neg_embeds = torch.randn(1, 5, cfg.joint_attention_dim, generator=g)
    neg_pooled = torch.randn(1, cfg.pooled_projection_dim, generator=g)
    cond = dict(prompt_embeds=_per_prompt(embeds, batch), pooled_prompt_embeds=_per_prompt(pooled, batch),
                negative_prompt_embeds=neg_embeds.expand(batch, -1, -1).contiguous(),
                negative_pooled_prompt_embeds=neg_pooled.expand(batch, -1).contiguous())
    z0 = torch.randn(models.sd3_latent_shape(model, batch), generator=g)
    return model, cond, z0


def _sd3_example(name: str, loss_fn: Callable, description: str, *, num_steps: int, batch: int, seed: int,
                 cfg: bool = False) -> Example:
    model, cond, z0 = _sd3_setup(batch, seed)

    def velocity(z, sigma):
        t = sigma * 1000
        if not cfg:
            return model(hidden_states=z, timestep=t, encoder_hidden_states=cond["prompt_embeds"],
                         pooled_projections=cond["pooled_prompt_embeds"], return_dict=False)[0]
        out = model(hidden_states=torch.cat([z] * 2), timestep=torch.cat([t] * 2),
                    encoder_hidden_states=torch.cat([cond["negative_prompt_embeds"], cond["prompt_embeds"]]),
                    pooled_projections=torch.cat([cond["negative_pooled_prompt_embeds"],
                                                  cond["pooled_prompt_embeds"]]),
                    return_dict=False)[0]
        uncond, text = out.chunk(2)
        return uncond + GUIDANCE_SCALE * (text - uncond)

    data = _rollout(velocity, z0, num_steps, "flow_grpo_sde", seed=seed)
    keys = ("prompt_embeds", "pooled_prompt_embeds") + (
        ("negative_prompt_embeds", "negative_pooled_prompt_embeds") if cfg else ())
    data.update({k: cond[k] for k in keys})
    _off_policy_step(model, seed)
    return Example(name, loss_fn, model, data, description)


# ---------------------------------------------------------------------------------------------
# factories


def flow_grpo_sd3(*, num_steps: int = 8, batch: int = 2, seed: int = 0) -> Example:
    return _sd3_example(
        "flow_grpo_sd3", flow_grpo_sd3_loss,
        "Flow-GRPO SDE step + PPO clip loss on a tiny SD3 transformer (return_dict=False)",
        num_steps=num_steps, batch=batch, seed=seed)


def cfg_sd3(*, num_steps: int = 8, batch: int = 2, seed: int = 0) -> Example:
    return _sd3_example(
        "cfg_sd3", cfg_sd3_loss,
        "Flow-GRPO with CFG in training: one DiT call of batch 2B ([uncond, cond]), chunk(2), "
        f"unconditional half detached, guidance {GUIDANCE_SCALE}",
        num_steps=num_steps, batch=batch, seed=seed, cfg=True)


def kl_reference_sd3(*, num_steps: int = 8, batch: int = 2, seed: int = 0) -> Example:
    return _sd3_example(
        "kl_reference_sd3", kl_reference_sd3_loss,
        f"Flow-GRPO with a KL penalty (beta={KL_BETA}): one no-grad reference DiT call per step, "
        "left out of the JAGG windows (no adapter here, so the reference equals the policy)",
        num_steps=num_steps, batch=batch, seed=seed)


def dance_flux(*, num_steps: int = 8, batch: int = 2, seed: int = 0) -> Example:
    model = models.flux("tiny", seed=seed)
    cfg = model.config
    height = width = 4
    text_len = 7   # txt_ids/img_ids are shared across steps (WindowOptions.unbatched), never batched
    num_prompts = (batch + 1) // 2
    g = torch.Generator().manual_seed(seed + 3)
    embeds = torch.randn(num_prompts, text_len, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(num_prompts, cfg.pooled_projection_dim, generator=g)
    image_ids = torch.zeros(height, width, 3)
    image_ids[..., 1] = torch.arange(height)[:, None]
    image_ids[..., 2] = torch.arange(width)[None, :]
    cond = dict(encoder_hidden_states=_per_prompt(embeds, batch),
                pooled_prompt_embeds=_per_prompt(pooled, batch),
                text_ids=torch.zeros(text_len, 3), image_ids=image_ids.reshape(height * width, 3))
    z0 = torch.randn(models.flux_latent_shape(model, batch, height=height, width=width), generator=g)

    def velocity(z, sigma):
        timesteps = sigma * 1000   # stored like this; the trainer passes timesteps / 1000
        return model(hidden_states=z, encoder_hidden_states=cond["encoder_hidden_states"], timestep=timesteps / 1000,
                     pooled_projections=cond["pooled_prompt_embeds"], txt_ids=cond["text_ids"],
                     img_ids=cond["image_ids"], return_dict=True).sample

    data = _rollout(velocity, z0, num_steps, "dance_flux", seed=seed)
    data.update(cond)
    _off_policy_step(model, seed)
    return Example("dance_flux", dance_flux_loss, model, data,
                   "DanceGRPO flux_step (eta 0.3) + PPO clip loss on a tiny Flux transformer, "
                   "output read as .sample (return_dict=True)")


EXAMPLES: dict[str, Callable[..., Example]] = {
    "flow_grpo_sd3": flow_grpo_sd3,
    "dance_flux": dance_flux,
    "cfg_sd3": cfg_sd3,
    "kl_reference_sd3": kl_reference_sd3,
}


def build_example(name: str, *, num_steps: int = 8, batch: int = 2, seed: int = 0) -> Example:
    """Build one of ``EXAMPLES`` by name (tiny model, stored trajectory, loss)."""
    if name not in EXAMPLES:
        from jaggc.errors import JaggInputError

        raise JaggInputError(f"unknown example {name!r}; choose one of {sorted(EXAMPLES)}")
    return EXAMPLES[name](num_steps=num_steps, batch=batch, seed=seed)
