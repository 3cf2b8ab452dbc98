"""A loss built from ``jaggc.grpo``'s own helpers (``flow_grpo_sde_step``, ``ppo_clip_loss``), whose
input checks read tensor values."""

from __future__ import annotations

from jaggc import grpo

from .common import T_DEFAULT, GRPOConfig, TrainerShape


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
