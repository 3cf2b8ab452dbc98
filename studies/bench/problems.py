"""The training steps ``jaggc bench`` times: a GRPO loss on a stored trajectory of a real DiT.

A ``Problem`` is one diffusers transformer (SD3 or Flux: "tiny" or "10m" from ``jaggc.models``, or a
published architecture from ``model_configs``, depth-cut, at a real latent size), on a device and in
a dtype (the DiT and its stored states in that dtype, the log-densities in float32, as the trainers
compute them), a stored SDE rollout of ``num_steps`` trained steps at batch ``batch`` sampled by that same model,
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

from jaggc import models
from jaggc.runtime import DitCall
from jaggc_studies import example_losses as el
from jaggc_studies.bench.model_configs import PUBLISHED, VAE_DOWNSAMPLE, build_published, cast, latent_side

FAMILIES = ("sd3", "flux")
SIZES = ("tiny", "10m")               # jaggc.models' small configs
PUBLISHED_SIZES = tuple(name for name, m in PUBLISHED.items() if m.family in FAMILIES)
ALL_SIZES = SIZES + PUBLISHED_SIZES
# Flux latent grid per size: 4x4 = 16 tokens for the unit-test model, 16x16 = 256 tokens for the
# 10M model, the token count of the 10M SD3 config (32x32 latent, patch 2)
_FLUX_GRID = {"tiny": 4, "10m": 16}
_SMALL_TEXT_LEN = {"sd3": 5, "flux": 4}   # jaggc.models' conditioning defaults
DEFAULT_RESOLUTION = 512             # published sizes: 64x64 latents
FLUX_GUIDANCE = 3.5                  # DanceGRPO's distilled guidance for FLUX.1-dev


@dataclass
class Problem:
    """One benchmarked GRPO training step (module docstring)."""

    name: str                                   # "sd3-10m", "sd35-medium-L4-512px"
    family: str
    size: str
    model: nn.Module
    batch: dict
    loss_fn: Callable[[nn.Module, dict], torch.Tensor]
    dit_calls: Callable[[dict], list[DitCall]]
    step_loss: Callable[[Any, dict, int], torch.Tensor]   # (DiT output, batch, step) -> step's share
    num_steps: int
    batch_size: int
    log_prob: Callable[[Any, dict, int], torch.Tensor] | None = None   # (DiT output, batch, step) -> (B,)
    cfg: bool = False       # Flow-GRPO's CFG in training: every DiT call on [uncond; cond] (2B)
    on_policy: bool = False  # parameters as at the rollout (no off-policy step after it)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


@dataclass(frozen=True)
class _Net:
    """Where a problem's DiT comes from and the shapes of its inputs."""

    family: str
    size: str
    layers: int | None
    side: int              # SD3: latent height/width; Flux: token grid side (packed 2x2 at real sizes)
    text_len: int
    device: torch.device
    dtype: torch.dtype
    seed: int

    @property
    def label(self) -> str:
        if self.size in SIZES:
            return f"{self.family}-{self.size}"
        px = (self.side if self.family == "sd3" else 2 * self.side) * VAE_DOWNSAMPLE
        return f"{self.size}{f'-L{self.layers}' if self.layers else ''}-{px}px"

    def build(self) -> nn.Module:
        if self.size in SIZES:
            model = models.sd3(self.size, seed=self.seed) if self.family == "sd3" else models.flux(self.size, seed=self.seed)
            return cast(model, device=self.device, dtype=self.dtype)
        return build_published(self.size, layers=self.layers, seed=self.seed, device=self.device, dtype=self.dtype)

    def on_device(self, tensors: dict) -> dict:
        """Conditioning made on the host (seeded) in the DiT's dtype, moved to its device."""
        return {k: v.to(self.device) for k, v in tensors.items()}


def family_of(family: str | None, size: str) -> str:
    """The problem family a (``--family``, ``--size``) pair means."""
    return family or (PUBLISHED[size].family if size in PUBLISHED else "sd3")


def _net(family: str | None, size: str, *, layers, resolution, seed, device, dtype) -> _Net:
    if size in PUBLISHED_SIZES:
        published = PUBLISHED[size]
        if family not in (None, published.family):
            raise ValueError(f"--size {size} is a {published.family} model, not {family}")
        side = latent_side(resolution or DEFAULT_RESOLUTION)
        return _Net(published.family, size, layers, side if published.family == "sd3" else side // 2,
                    published.text_len, torch.device(device), dtype, seed)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; sizes {ALL_SIZES}")
    if layers is not None or resolution is not None:
        raise ValueError(f"--layers and --resolution apply to the published sizes {PUBLISHED_SIZES}, not {size!r}")
    family = family or "sd3"
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; families {FAMILIES}")
    side = models.SD3_CONFIGS[size]["sample_size"] if family == "sd3" else _FLUX_GRID[size]
    return _Net(family, size, None, side, _SMALL_TEXT_LEN[family], torch.device(device), dtype, seed)


def build_problem(family: str | None, size: str, *, num_steps: int = 16, batch: int = 4, seed: int = 0,
                  cfg: bool = False, device="cpu", dtype: torch.dtype = torch.float32, layers: int | None = None,
                  resolution: int | None = None, on_policy: bool = False) -> Problem:
    """The model, its own SDE rollout and the loss for ``family`` ("sd3"/"flux"; None: the size's)
    at ``size`` (``SIZES``: jaggc.models' small configs; ``PUBLISHED_SIZES``: the published
    architectures, ``model_configs``, depth cut to ``layers``, latents of ``resolution`` px), on
    ``device`` in ``dtype``; ``cfg``: Flow-GRPO's train_sd3 CFG loss (SD3 only); ``on_policy``:
    skip the parameter step after the rollout (the ratios are then 1 up to the numerics)."""
    net = _net(family, size, layers=layers, resolution=resolution, seed=seed, device=device, dtype=dtype)
    if cfg and net.family != "sd3":
        raise ValueError("--cfg benchmarks Flow-GRPO's train_sd3 CFG loss: use an SD3 size")
    build = _sd3_cfg_problem if cfg else _sd3_problem if net.family == "sd3" else _flux_problem
    problem = build(net, num_steps=num_steps, batch=batch, seed=seed)
    problem.on_policy = on_policy
    if not on_policy:
        # as after one optimizer step of the PPO inner loop: ratios != 1 but far inside the clip range
        el._off_policy_step(problem.model, seed)
    return problem


def _rollout(net: _Net, model, velocity, z0: torch.Tensor, num_steps: int, kind: str, seed: int) -> dict:
    """The example losses' SDE rollout on the DiT's device; the stored states in the DiT's dtype
    (the values the rollout fed it), the log-density inputs in float32."""
    data = el._rollout(velocity, z0.to(net.device), num_steps, kind, seed=seed)
    data["latents"] = data["latents"].to(net.dtype)
    return data


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


def _sd3_inputs(net: _Net, model, batch: int, seed: int):
    cond = net.on_device(models.sd3_conditioning(model, batch, text_len=net.text_len, seed=seed + 3).kwargs)
    z0 = torch.randn(batch, model.config.in_channels, net.side, net.side,
                     generator=torch.Generator().manual_seed(seed + 4))
    return cond, z0


def _sd3_problem(net: _Net, *, num_steps: int, batch: int, seed: int) -> Problem:
    model = net.build()
    cond, z0 = _sd3_inputs(net, model, batch, seed)

    def velocity(z, sigma):
        return model(hidden_states=z.to(net.dtype), timestep=sigma * 1000, return_dict=False, **cond)[0]

    data = _rollout(net, model, velocity, z0, num_steps, "flow_grpo_sde", seed)
    data.update(prompt_embeds=cond["encoder_hidden_states"], pooled_prompt_embeds=cond["pooled_projections"])
    return Problem(net.label, "sd3", net.size, model, data, el.flow_grpo_sd3_loss, _sd3_calls, _sd3_step_loss,
                   num_steps, batch, _sd3_log_prob)


def _sd3_calls(batch: dict) -> list[DitCall]:
    return [DitCall(kwargs=dict(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                                encoder_hidden_states=batch["prompt_embeds"],
                                pooled_projections=batch["pooled_prompt_embeds"], return_dict=False))
            for j in range(batch["timesteps"].shape[1])]


def _sd3_log_prob(output, batch: dict, j: int) -> torch.Tensor:
    return el.sde_step_with_logprob(output[0], batch["latents"][:, j], batch["sigmas"][:, j],
                                    batch["sigmas_next"][:, j], batch["next_latents"][:, j], batch["sigma_max"])[1]


def _sd3_step_loss(output, batch: dict, j: int) -> torch.Tensor:
    # the body of example_losses.flow_grpo_sd3_loss for step j, divided as it divides the total
    step = el.ppo_clip(_sd3_log_prob(output, batch, j), batch["log_probs"][:, j], batch["advantages"][:, j])
    return step / batch["timesteps"].shape[1]


# ---------------------------------------------------------------------------------------------
# SD3 with CFG in training: one call on [uncond; cond], uncond detached (example_losses.cfg_sd3_loss)


def _sd3_cfg_problem(net: _Net, *, num_steps: int, batch: int, seed: int) -> Problem:
    model = net.build()
    cond, z0 = _sd3_inputs(net, model, batch, seed)
    null = net.on_device(models.sd3_conditioning(model, 1, text_len=net.text_len, seed=seed + 5).kwargs)
    negative = {k: v.expand(batch, *v.shape[1:]).contiguous() for k, v in null.items()}

    def velocity(z, sigma):
        out = model(hidden_states=torch.cat([z.to(net.dtype)] * 2), timestep=torch.cat([sigma * 1000] * 2), return_dict=False,
                    **{k: torch.cat([negative[k], cond[k]]) for k in cond})[0]
        uncond, text = out.chunk(2)
        return uncond + el.GUIDANCE_SCALE * (text - uncond)

    data = _rollout(net, model, velocity, z0, num_steps, "flow_grpo_sde", seed)
    data.update(prompt_embeds=cond["encoder_hidden_states"], pooled_prompt_embeds=cond["pooled_projections"],
                negative_prompt_embeds=negative["encoder_hidden_states"],
                negative_pooled_prompt_embeds=negative["pooled_projections"])
    return Problem(f"{net.label}-cfg", "sd3", net.size, model, data, el.cfg_sd3_loss, _sd3_cfg_calls, _sd3_cfg_step_loss,
                   num_steps, batch, _sd3_cfg_log_prob, cfg=True)


def _sd3_cfg_calls(batch: dict) -> list[DitCall]:
    embeds = torch.cat([batch["negative_prompt_embeds"], batch["prompt_embeds"]])
    pooled = torch.cat([batch["negative_pooled_prompt_embeds"], batch["pooled_prompt_embeds"]])
    return [DitCall(kwargs=dict(hidden_states=torch.cat([batch["latents"][:, j]] * 2),
                                timestep=torch.cat([batch["timesteps"][:, j]] * 2), encoder_hidden_states=embeds,
                                pooled_projections=pooled, return_dict=False))
            for j in range(batch["timesteps"].shape[1])]


def _guided(output):
    uncond, text = output[0].chunk(2)
    uncond = uncond.detach()
    return (uncond + el.GUIDANCE_SCALE * (text - uncond),)


def _sd3_cfg_step_loss(output, batch: dict, j: int) -> torch.Tensor:
    # the body of example_losses.cfg_sd3_loss for step j, divided as it divides the total
    return _sd3_step_loss(_guided(output), batch, j)


def _sd3_cfg_log_prob(output, batch: dict, j: int) -> torch.Tensor:
    return _sd3_log_prob(_guided(output), batch, j)


# ---------------------------------------------------------------------------------------------
# Flux: DanceGRPO's flux_step + PPO clip (example_losses.dance_flux_loss)


def _flux_problem(net: _Net, *, num_steps: int, batch: int, seed: int) -> Problem:
    model = net.build()
    grid = net.side
    cond = models.flux_conditioning(model, batch, height=grid, width=grid, text_len=net.text_len, seed=seed + 3).kwargs
    cond = net.on_device(cond)
    guided = model.config.guidance_embeds     # FLUX.1-dev: guidance-distilled
    if guided:
        cond["guidance"] = torch.full((batch,), FLUX_GUIDANCE, device=net.device)
    z0 = torch.randn(models.flux_latent_shape(model, batch, height=grid, width=grid),
                     generator=torch.Generator().manual_seed(seed + 4))

    def velocity(z, sigma):
        return model(hidden_states=z.to(net.dtype), timestep=sigma, return_dict=True, **cond).sample

    data = _rollout(net, model, velocity, z0, num_steps, "dance_flux", seed)
    data.update(encoder_hidden_states=cond["encoder_hidden_states"], pooled_prompt_embeds=cond["pooled_projections"],
                text_ids=cond["txt_ids"], image_ids=cond["img_ids"])
    if guided:
        data["guidance"] = cond["guidance"]
    return Problem(net.label, "flux", net.size, model, data, el.dance_flux_dev_loss if guided else el.dance_flux_loss,
                   _flux_calls, _flux_step_loss, num_steps, batch, _flux_log_prob)


def _flux_calls(batch: dict) -> list[DitCall]:
    return [DitCall(kwargs=dict(hidden_states=batch["latents"][:, j], encoder_hidden_states=batch["encoder_hidden_states"],
                                timestep=batch["timesteps"][:, j] / 1000,
                                pooled_projections=batch["pooled_prompt_embeds"], txt_ids=batch["text_ids"],
                                img_ids=batch["image_ids"], joint_attention_kwargs=None, return_dict=True,
                                **({"guidance": batch["guidance"]} if "guidance" in batch else {})))
            for j in range(batch["timesteps"].shape[1])]


def _flux_log_prob(output, batch: dict, j: int) -> torch.Tensor:
    return el.flux_step(output.sample, batch["latents"][:, j].to(torch.float32), el.ETA, batch["sigmas"][:, j],
                        batch["sigmas_next"][:, j], batch["next_latents"][:, j].to(torch.float32))


def _flux_step_loss(output, batch: dict, j: int) -> torch.Tensor:
    loss = el.ppo_clip(_flux_log_prob(output, batch, j), batch["log_probs"][:, j], batch["advantages"][:, j])
    return loss / batch["timesteps"].shape[1]
