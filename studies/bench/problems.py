"""The training steps ``jaggc bench`` times: a GRPO loss on a stored trajectory of a real DiT.

A ``Problem`` is one diffusers transformer (SD3 or Flux, "tiny" or "10m" from ``jaggc.models``),
a stored SDE rollout of ``num_steps`` trained steps at batch ``batch`` sampled by that same model,
and the trainer's loss written three ways that compute the same value:

  * ``loss_fn``: the user's loss as Flow-GRPO / DanceGRPO write it (``jaggc_studies.example_losses``),
    the function ``@jagg_compile`` decorates and the exact baseline calls undecorated;
  * ``dit_calls`` + ``step_loss``: the same loss split into its DiT calls and its per-step head,
    so a strategy can produce the velocities another way (``jagg_calls`` directly, no graph) or
    call backward inside the step loop (Flow-GRPO's own memory pattern).

The rollout and loss heads are the built-in examples' (``example_losses``), so the bench times
exactly the loss the rest of jaggc is tested on, at the model size asked for.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from jaggc_studies import example_losses as el
from jaggc import models
from jaggc.runtime import DitCall

FAMILIES = ("sd3", "flux")
SIZES = ("tiny", "10m")
# Flux latent grid per size: 4x4 = 16 tokens for the unit-test model, 16x16 = 256 tokens for the
# 10M model, the token count of the 10M SD3 config (32x32 latent, patch 2)
_FLUX_GRID = {"tiny": 4, "10m": 16}


@dataclass
class Problem:
    """One benchmarked GRPO training step (module docstring)."""

    name: str                                   # "sd3-10m"
    family: str
    size: str
    model: nn.Module
    batch: dict
    loss_fn: Callable[[nn.Module, dict], torch.Tensor]
    dit_calls: Callable[[dict], list[DitCall]]
    step_loss: Callable[[Any, dict, int], torch.Tensor]   # (DiT output, batch, step) -> step's share
    num_steps: int
    batch_size: int
    cfg: bool = False       # Flow-GRPO's CFG in training: every DiT call on [uncond; cond] (2B)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def build_problem(family: str, size: str, *, num_steps: int = 16, batch: int = 4, seed: int = 0,
                  cfg: bool = False) -> Problem:
    """The model, its own SDE rollout and the loss for ``family`` ("sd3"/"flux") at ``size``;
    ``cfg``: Flow-GRPO's train_sd3 CFG loss (SD3 only)."""
    if family not in FAMILIES or size not in SIZES:
        raise ValueError(f"unknown problem {family}-{size}; families {FAMILIES}, sizes {SIZES}")
    if cfg and family != "sd3":
        raise ValueError("--cfg benchmarks Flow-GRPO's train_sd3 CFG loss: use --family sd3")
    build = _sd3_cfg_problem if cfg else _sd3_problem if family == "sd3" else _flux_problem
    problem = build(size, num_steps=num_steps, batch=batch, seed=seed)
    # as after one optimizer step of the PPO inner loop: ratios != 1 but far inside the clip range
    el._off_policy_step(problem.model, seed)
    return problem


def own_code(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object.

    Dynamo caches compiled graphs (and counts its recompile limit) per code object, so every
    compiled strategy of one bench run would otherwise share one cache: W=2..8, split knots and
    the compile-overhead probes are a dozen graphs of the same function. A user compiles their
    loss once; a private code object per compiled strategy measures exactly that.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


# ---------------------------------------------------------------------------------------------
# SD3: Flow-GRPO's SDE step + PPO clip (example_losses.flow_grpo_sd3_loss)


def _sd3_problem(size: str, *, num_steps: int, batch: int, seed: int) -> Problem:
    model = models.sd3(size, seed=seed)
    cond = models.sd3_conditioning(model, batch, seed=seed + 3).kwargs
    z0 = torch.randn(models.sd3_latent_shape(model, batch), generator=torch.Generator().manual_seed(seed + 4))

    def velocity(z, sigma):
        return model(hidden_states=z, timestep=sigma * 1000, return_dict=False, **cond)[0]

    data = el._rollout(velocity, z0, num_steps, "flow_grpo_sde", seed=seed)
    data.update(prompt_embeds=cond["encoder_hidden_states"], pooled_prompt_embeds=cond["pooled_projections"])
    return Problem(f"sd3-{size}", "sd3", size, model, data, el.flow_grpo_sd3_loss, _sd3_calls, _sd3_step_loss,
                   num_steps, batch)


def _sd3_calls(batch: dict) -> list[DitCall]:
    return [DitCall(kwargs=dict(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                                encoder_hidden_states=batch["prompt_embeds"],
                                pooled_projections=batch["pooled_prompt_embeds"], return_dict=False))
            for j in range(batch["timesteps"].shape[1])]


def _sd3_step_loss(output, batch: dict, j: int) -> torch.Tensor:
    # the body of example_losses.flow_grpo_sd3_loss for step j, divided as it divides the total
    _, log_prob, _, _ = el.sde_step_with_logprob(
        output[0], batch["latents"][:, j], batch["sigmas"][:, j], batch["sigmas_next"][:, j],
        batch["next_latents"][:, j], batch["sigma_max"])
    step = el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
    return step / batch["timesteps"].shape[1]


# ---------------------------------------------------------------------------------------------
# SD3 with CFG in training: one call on [uncond; cond], uncond detached (example_losses.cfg_sd3_loss)


def _sd3_cfg_problem(size: str, *, num_steps: int, batch: int, seed: int) -> Problem:
    model = models.sd3(size, seed=seed)
    cond = models.sd3_conditioning(model, batch, seed=seed + 3).kwargs
    null = models.sd3_conditioning(model, 1, seed=seed + 5).kwargs
    negative = {k: v.expand(batch, *v.shape[1:]).contiguous() for k, v in null.items()}
    z0 = torch.randn(models.sd3_latent_shape(model, batch), generator=torch.Generator().manual_seed(seed + 4))

    def velocity(z, sigma):
        out = model(hidden_states=torch.cat([z] * 2), timestep=torch.cat([sigma * 1000] * 2), return_dict=False,
                    **{k: torch.cat([negative[k], cond[k]]) for k in cond})[0]
        uncond, text = out.chunk(2)
        return uncond + el.GUIDANCE_SCALE * (text - uncond)

    data = el._rollout(velocity, z0, num_steps, "flow_grpo_sde", seed=seed)
    data.update(prompt_embeds=cond["encoder_hidden_states"], pooled_prompt_embeds=cond["pooled_projections"],
                negative_prompt_embeds=negative["encoder_hidden_states"],
                negative_pooled_prompt_embeds=negative["pooled_projections"])
    return Problem(f"sd3-{size}-cfg", "sd3", size, model, data, el.cfg_sd3_loss, _sd3_cfg_calls, _sd3_cfg_step_loss,
                   num_steps, batch, cfg=True)


def _sd3_cfg_calls(batch: dict) -> list[DitCall]:
    embeds = torch.cat([batch["negative_prompt_embeds"], batch["prompt_embeds"]])
    pooled = torch.cat([batch["negative_pooled_prompt_embeds"], batch["pooled_prompt_embeds"]])
    return [DitCall(kwargs=dict(hidden_states=torch.cat([batch["latents"][:, j]] * 2),
                                timestep=torch.cat([batch["timesteps"][:, j]] * 2), encoder_hidden_states=embeds,
                                pooled_projections=pooled, return_dict=False))
            for j in range(batch["timesteps"].shape[1])]


def _sd3_cfg_step_loss(output, batch: dict, j: int) -> torch.Tensor:
    # the body of example_losses.cfg_sd3_loss for step j, divided as it divides the total
    uncond, text = output[0].chunk(2)
    uncond = uncond.detach()
    return _sd3_step_loss((uncond + el.GUIDANCE_SCALE * (text - uncond),), batch, j)


# ---------------------------------------------------------------------------------------------
# Flux: DanceGRPO's flux_step + PPO clip (example_losses.dance_flux_loss)


def _flux_problem(size: str, *, num_steps: int, batch: int, seed: int) -> Problem:
    model = models.flux(size, seed=seed)
    grid = _FLUX_GRID[size]
    cond = models.flux_conditioning(model, batch, height=grid, width=grid, seed=seed + 3).kwargs
    z0 = torch.randn(models.flux_latent_shape(model, batch, height=grid, width=grid),
                     generator=torch.Generator().manual_seed(seed + 4))

    def velocity(z, sigma):
        return model(hidden_states=z, timestep=sigma, return_dict=True, **cond).sample

    data = el._rollout(velocity, z0, num_steps, "dance_flux", seed=seed)
    data.update(encoder_hidden_states=cond["encoder_hidden_states"], pooled_prompt_embeds=cond["pooled_projections"],
                text_ids=cond["txt_ids"], image_ids=cond["img_ids"])
    return Problem(f"flux-{size}", "flux", size, model, data, el.dance_flux_loss, _flux_calls, _flux_step_loss,
                   num_steps, batch)


def _flux_calls(batch: dict) -> list[DitCall]:
    return [DitCall(kwargs=dict(hidden_states=batch["latents"][:, j], encoder_hidden_states=batch["encoder_hidden_states"],
                                timestep=batch["timesteps"][:, j] / 1000,
                                pooled_projections=batch["pooled_prompt_embeds"], txt_ids=batch["text_ids"],
                                img_ids=batch["image_ids"], joint_attention_kwargs=None, return_dict=True))
            for j in range(batch["timesteps"].shape[1])]


def _flux_step_loss(output, batch: dict, j: int) -> torch.Tensor:
    latents = batch["latents"][:, j]
    log_prob = el.flux_step(output.sample, latents.to(torch.float32), el.ETA, batch["sigmas"][:, j],
                            batch["sigmas_next"][:, j], batch["next_latents"][:, j].to(torch.float32))
    loss = el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
    return loss / batch["timesteps"].shape[1]
