"""DanceGRPO's training loop (``fastvideo/train_grpo_flux.py``, ``train_one_step``), unchanged and with jaggc.

Read from XueZeyue/DanceGRPO, not copied: the rollout's per-sample tensors are gathered in a random
permutation of the steps per sample (``perms``); each sample trains the first
``int(T * timestep_fraction)`` steps of its permutation, in that random order, with
``loss.backward()`` after each (no ``no_sync``: under FSDP one reduce-scatter per step), the loss
divided by ``gradient_accumulation_steps * train_timesteps`` and ``all_reduce``d for logging;
``clip_grad_norm_`` and ``optimizer.step()`` every ``gradient_accumulation_steps`` samples. The
step (``grpo_one_step``: ``transformer.train()``, a CUDA bf16 autocast block around the Flux call,
``flux_step``'s log-prob) is ``jaggc_studies.trainer_shapes``'s.

``train_unchanged`` is that loop; ``train_jaggc`` the same with the user's change (the ``for _`` line;
``jaggc.stepwise(transformer, window=4)`` after the FSDP wrap is the other).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

import jaggc
from jaggc import models
from jaggc_studies import trainer_shapes as shapes
from jaggc_studies.trainers import sizes


@dataclass
class DanceGrpoRun:
    transformer: Any
    optimizer: Any
    samples_batched_list: list
    perms: torch.Tensor
    sigma_schedule: torch.Tensor
    args: Any
    fraction: float = 0.6          # args.timestep_fraction
    max_grad_norm: float = 1e9
    cond: dict = None              # the prompt's conditioning (one sample's), for sampling (rollouts.py)
    latent_shape: tuple = ()       # one sample's latents
    seen: list = field(default_factory=list)

    @property
    def stored_steps(self) -> int:
        return self.sigma_schedule.shape[0] - 1


def flux_rollout(transformer, cond: dict, sigma_schedule: torch.Tensor, *, batch: int, seed: int, eta: float,
                 sde_steps=None, step=None, side: int = 4):
    """A stored SDE rollout of ``batch`` samples on a Flux DiT (no grad, eval mode): latents before and
    after each step, log-probs, timesteps ``int(σ * 1000)`` per sample. ``step``: the trainer's
    step function (default ``flux_step``); ``sde_steps``: where it is stochastic (MixGRPO)."""
    num_steps = sigma_schedule.shape[0] - 1
    device = cond["encoder_hidden_states"].device
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed + 1)            # the trainers' steps draw their noise with randn_like
    z = torch.randn(models.flux_latent_shape(transformer, batch, height=side, width=side), generator=g).to(device)
    lat, lps = [z], []
    transformer.eval()
    expand = {k: v.expand(batch, *v.shape[1:]) if k in ("encoder_hidden_states", "pooled_projections") else v
              for k, v in cond.items()}
    with torch.no_grad():
        for i in range(num_steps):
            t = torch.full([batch], int(sigma_schedule[i] * 1000), dtype=torch.long, device=device)
            pred = transformer(hidden_states=z, timestep=t / 1000, guidance=torch.tensor([3.5], device=device),
                               return_dict=False, **expand)[0]
            if step is None:
                z, _, log_prob = shapes.flux_step(pred, z, eta, sigma_schedule, i, None, True, True)
            else:
                z, log_prob = step(pred, z, i, sde_steps is None or i in sde_steps)
            lat.append(z)
            lps.append(log_prob)
    timesteps = torch.tensor([[int(s * 1000) for s in sigma_schedule[:num_steps]]] * batch, device=device)
    return torch.stack(lat, 1), torch.stack(lps, 1), timesteps


def flux_model(where: sizes.Where, *, seed: int, side: int) -> tuple[torch.nn.Module, dict, int]:
    """(a Flux DiT with guidance embeddings on ``where``'s device, one prompt's conditioning there,
    the packed latent side): the trainers' FLUX.1-dev at its resolution for the published size."""
    side = sizes.flux_side(where, side)
    transformer = sizes.flux(where, seed=seed)
    cond = models.flux_conditioning(transformer, 1, seed=seed, height=side, width=side,
                                    text_len=sizes.flux_text_len(where)).kwargs
    return transformer, {k: v.to(where.device) for k, v in cond.items()}, side


def setup(*, size: str = "tiny", num_steps: int = 10, samples: int = 2, seed: int = 0, fraction: float = 0.6,
          gradient_accumulation_steps: int = 1, lr: float = 1e-3, wrap=None, stepwise: dict | None = None,
          shard: tuple[int, int] = (0, 1), checkpointing: bool = False, side: int = 4,
          dtype=torch.float32, where: sizes.Where | None = None) -> DanceGrpoRun:
    """A DanceGRPO run: a Flux DiT with guidance embeddings, ``samples`` one-sample trajectories of
    ``num_steps`` steps with per-sample random permutations (``perms``), latents of ``side`` x
    ``side`` packed tokens. ``wrap(transformer)``: the
    sharding (FSDP1 / FSDP2), applied before the optimizer is built; ``stepwise``: the keywords of the
    user's added line, ``jaggc.stepwise(transformer, **stepwise)``. ``where`` (trainers/sizes.py):
    the size, device and weights' dtype in one (instead of ``size`` and ``dtype``)."""
    where = where if where is not None else sizes.Where(size, dtype=dtype)
    dtype = where.dtype
    transformer, cond, side = flux_model(where, seed=seed, side=side)
    args = replace(shapes.GRPOConfig(), clip_range=1e-4, gradient_accumulation_steps=gradient_accumulation_steps)
    sigma_schedule = shapes.sd3_time_shift(3.0, torch.linspace(1, 0, num_steps + 1))
    all_latents, all_log_probs, timesteps = flux_rollout(transformer, cond, sigma_schedule, batch=samples * shard[1],
                                                         seed=seed, eta=args.eta, side=side)
    rewards = torch.linspace(-1.0, 1.0, samples * shard[1], device=where.device)
    samples_dict = {
        "timesteps": timesteps, "latents": all_latents[:, :-1], "next_latents": all_latents[:, 1:],
        "log_probs": all_log_probs, "advantages": (rewards - rewards.mean()) / (rewards.std() + 1e-8),
        "encoder_hidden_states": cond["encoder_hidden_states"].expand(samples * shard[1], -1, -1),
        "pooled_prompt_embeds": cond["pooled_projections"].expand(samples * shard[1], -1),
    }
    # shard=(rank, world): this process's samples of a rollout of samples * world
    samples_dict = {k: v[shard[0]::shard[1]] for k, v in samples_dict.items()}
    shapes._off_policy_step(transformer, seed, lambda name: True)
    if dtype != torch.float32:
        transformer.to(dtype)
        samples_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in samples_dict.items()}
    g = torch.Generator().manual_seed(seed + 5 + shard[0])     # each rank draws its own (set_seed(seed + rank))
    perms = torch.stack([torch.randperm(num_steps, generator=g) for _ in range(samples)])
    for key in ["timesteps", "latents", "next_latents", "log_probs"]:
        samples_dict[key] = samples_dict[key][torch.arange(samples)[:, None], perms.to(samples_dict[key].device)]
    samples_batched = {k: v.unsqueeze(1) for k, v in samples_dict.items()}
    samples_batched_list = [dict(zip(samples_batched, x)) for x in zip(*samples_batched.values())]
    for s in samples_batched_list:      # shared, unbatched inputs
        s["text_ids"], s["image_ids"] = cond["txt_ids"], cond["img_ids"]
    if checkpointing:
        transformer.enable_gradient_checkpointing()      # the trainer's --gradient_checkpointing
    if wrap is not None:
        transformer = wrap(transformer)
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    if stepwise is not None:
        jaggc.stepwise(transformer, **stepwise)
    return DanceGrpoRun(transformer, optimizer, samples_batched_list, perms, sigma_schedule, args, fraction,
                        cond=cond, latent_shape=(1, *all_latents.shape[2:]))


def _clip(transformer, max_grad_norm):
    # FSDP1's own method where the trainer has it; the torch function otherwise (FSDP2, no sharding)
    if hasattr(transformer, "clip_grad_norm_"):
        return transformer.clip_grad_norm_(max_grad_norm)
    return torch.nn.utils.clip_grad_norm_(transformer.parameters(), max_grad_norm)


def _all_reduce_avg(t: torch.Tensor) -> None:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.AVG)


def train_unchanged(run: DanceGrpoRun) -> float:
    """``train_one_step``'s training part over ``run.samples_batched_list``; the summed logged loss."""
    transformer, optimizer, args, sigma_schedule, perms = (run.transformer, run.optimizer, run.args,
                                                           run.sigma_schedule, run.perms)
    total_loss = 0.0
    train_timesteps = int(len(run.samples_batched_list[0]["timesteps"][0]) * run.fraction)
    for i, sample in list(enumerate(run.samples_batched_list)):
        for _ in range(train_timesteps):
            new_log_probs = shapes.dance_one_step(
                args, sample["latents"][:, _], sample["next_latents"][:, _], sample["encoder_hidden_states"],
                sample["pooled_prompt_embeds"], sample["text_ids"], sample["image_ids"], transformer,
                sample["timesteps"][:, _], perms[i][_], sigma_schedule)
            advantages = torch.clamp(sample["advantages"], -args.adv_clip_max, args.adv_clip_max)
            ratio = torch.exp(new_log_probs - sample["log_probs"][:, _])
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - args.clip_range, 1.0 + args.clip_range)
            loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss)) / (
                args.gradient_accumulation_steps * train_timesteps)
            run.seen.append((new_log_probs.detach(), ratio.detach(), loss.detach()))
            loss.backward()
            avg_loss = loss.detach().clone()
            _all_reduce_avg(avg_loss)
            total_loss += avg_loss.item()
        if (i + 1) % args.gradient_accumulation_steps == 0:
            _clip(transformer, run.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    return total_loss


def train_jaggc(run: DanceGrpoRun) -> float:
    """``train_unchanged`` with jaggc: the ``for _`` line declares each sample's trained steps."""
    transformer, optimizer, args, sigma_schedule, perms = (run.transformer, run.optimizer, run.args,
                                                           run.sigma_schedule, run.perms)
    total_loss = 0.0
    train_timesteps = int(len(run.samples_batched_list[0]["timesteps"][0]) * run.fraction)
    for i, sample in list(enumerate(run.samples_batched_list)):
        for _ in jaggc.stepwise(transformer).steps(range(train_timesteps), sample["timesteps"][:, :train_timesteps]):
            new_log_probs = shapes.dance_one_step(
                args, sample["latents"][:, _], sample["next_latents"][:, _], sample["encoder_hidden_states"],
                sample["pooled_prompt_embeds"], sample["text_ids"], sample["image_ids"], transformer,
                sample["timesteps"][:, _], perms[i][_], sigma_schedule)
            advantages = torch.clamp(sample["advantages"], -args.adv_clip_max, args.adv_clip_max)
            ratio = torch.exp(new_log_probs - sample["log_probs"][:, _])
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - args.clip_range, 1.0 + args.clip_range)
            loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss)) / (
                args.gradient_accumulation_steps * train_timesteps)
            run.seen.append((new_log_probs.detach(), ratio.detach(), loss.detach()))
            loss.backward()
            avg_loss = loss.detach().clone()
            _all_reduce_avg(avg_loss)
            total_loss += avg_loss.item()
        if (i + 1) % args.gradient_accumulation_steps == 0:
            _clip(transformer, run.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    return total_loss


def reference_loss(run: DanceGrpoRun, i: int, transformer=None) -> torch.Tensor:
    """Sample ``i``'s trajectory as one loss (its trained steps sorted into the sampler's order, each
    step's loss divided as the loop divides it, summed): ``trainer_shapes.dance_grpo_loss`` on the
    sample's stored steps, what ``@jagg_compile`` takes and the gradient's reference."""
    sample = run.samples_batched_list[i]
    train_timesteps = int(len(sample["timesteps"][0]) * run.fraction)
    order = run.perms[i][:train_timesteps]
    # undo the gather: index k of the permuted sample is trajectory step perms[i][k]
    stored = {key: torch.empty_like(sample[key]) for key in ("latents", "next_latents", "timesteps", "log_probs")}
    for key in stored:
        stored[key][:, run.perms[i]] = sample[key]
    stored.update({k: sample[k] for k in ("advantages", "encoder_hidden_states", "pooled_prompt_embeds")})
    stored.update(text_ids=sample["text_ids"], image_ids=sample["image_ids"])
    return shapes.dance_grpo_loss(transformer if transformer is not None else run.transformer, stored,
                                  order.sort().values, run.sigma_schedule, run.args)


__all__ = ["DanceGrpoRun", "flux_rollout", "reference_loss", "setup", "train_jaggc", "train_unchanged"]
