"""MixGRPO's training loop (``fastvideo/train_grpo_flux.py``, ``training_strategy="part"``), unchanged and with jaggc.

Read from Tencent-Hunyuan/MixGRPO, not copied: each sample trains the steps of the current window
``train_timesteps`` (``GRPOTrainingStates``: ``range(cur, min(cur + 4, 23))``, moving along the
trajectory over iterations and shrinking to 3, 2, 1 steps at its end), in order, with
``loss.backward()`` after each step (policy loss plus the KL on log-prob differences, both divided
by ``gradient_accumulation_steps * len(train_timesteps)``), the losses ``all_reduce``d for
logging, then ``clip_grad_norm_`` and ``optimizer.step()`` every ``gradient_accumulation_steps``
samples. The rollout is SDE only on the window. The step (``grpo_one_step`` with
``transformer.train()`` and a CUDA bf16 autocast block, Flow-GRPO's SDE log-prob) is
``jaggc_studies.trainer_shapes``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

import jaggc
from jaggc_studies import trainer_shapes as shapes
from jaggc_studies.loops.dance_grpo import flux_model, flux_rollout
from jaggc_studies.trainers import sizes


@dataclass
class MixGrpoRun:
    transformer: Any
    optimizer: Any
    samples_batched_list: list
    train_timesteps: range
    sigma_schedule: torch.Tensor
    args: Any
    max_grad_norm: float = 1e9
    cond: dict = None              # the prompt's conditioning (one sample's), for sampling (rollouts.py)
    latent_shape: tuple = ()       # one sample's latents
    stored_steps: int = 0          # steps stored per trajectory (the last sampling step is not)
    seen: list = field(default_factory=list)


def setup(*, size: str = "tiny", samples: int = 2, cur: int = 0, seed: int = 0, gradient_accumulation_steps: int = 1,
          lr: float = 1e-3, wrap=None, stepwise: dict | None = None,
          shard: tuple[int, int] = (0, 1), checkpointing: bool = False, side: int = 4,
          where: sizes.Where | None = None) -> MixGrpoRun:
    """A MixGRPO run on a Flux DiT with guidance embeddings: ``samples`` one-sample trajectories of a
    25-step shift-3 schedule, SDE on the window at ``cur`` and ODE elsewhere, 24 stored steps, latents
    of ``side`` x ``side`` packed tokens. ``where`` (trainers/sizes.py): the size, device and weights'
    dtype in one (instead of ``size``)."""
    where = where if where is not None else sizes.Where(size)
    transformer, cond, side = flux_model(where, seed=seed, side=side)
    args = replace(shapes.GRPOConfig(), clip_range=1e-4, eta=0.7, noise_level=0.7, kl_coeff=0.01,
                   gradient_accumulation_steps=gradient_accumulation_steps)
    sigma_schedule = shapes.sd3_time_shift(3.0, torch.linspace(1, 0, shapes.MIX_SAMPLING_STEPS + 1))
    window = shapes.mix_train_timesteps(cur)

    def step(pred, z, i, sde):
        z, _, log_prob, _, _ = shapes.flow_grpo_step(pred, z, args.eta, sigma_schedule, i, None, determistic=not sde,
                                                     noise_level=args.noise_level)
        return z, log_prob

    all_latents, all_log_probs, timesteps = flux_rollout(transformer, cond, sigma_schedule, batch=samples * shard[1], seed=seed,
                                                         eta=args.eta, sde_steps=set(window), step=step, side=side)
    stored = shapes.MIX_SAMPLING_STEPS - 1
    rewards = torch.linspace(-1.0, 1.0, samples * shard[1], device=where.device)
    samples_dict = {
        "timesteps": timesteps[:, :stored], "latents": all_latents[:, :stored], "next_latents": all_latents[:, 1:stored + 1],
        "log_probs": all_log_probs[:, :stored], "advantages": (rewards - rewards.mean()) / (rewards.std() + 1e-8),
        "encoder_hidden_states": cond["encoder_hidden_states"].expand(samples * shard[1], -1, -1),
        "pooled_prompt_embeds": cond["pooled_projections"].expand(samples * shard[1], -1),
    }
    # shard=(rank, world): this process's samples of a rollout of samples * world
    samples_dict = {k: v[shard[0]::shard[1]] for k, v in samples_dict.items()}
    shapes._off_policy_step(transformer, seed, lambda name: True)
    if where.dtype != torch.float32:
        transformer.to(where.dtype)
    samples_batched = {k: v.unsqueeze(1) for k, v in samples_dict.items()}
    samples_batched_list = [dict(zip(samples_batched, x)) for x in zip(*samples_batched.values())]
    for s in samples_batched_list:
        s["text_ids"], s["image_ids"] = cond["txt_ids"], cond["img_ids"]
    if checkpointing:
        transformer.enable_gradient_checkpointing()      # the trainer's --gradient_checkpointing
    if wrap is not None:
        transformer = wrap(transformer)
    transformer.train()
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=lr)
    if stepwise is not None:
        jaggc.stepwise(transformer, **stepwise)
    return MixGrpoRun(transformer, optimizer, samples_batched_list, window, sigma_schedule, args, cond=cond,
                      latent_shape=(1, *all_latents.shape[2:]), stored_steps=stored)


def _all_reduce_avg(t: torch.Tensor) -> None:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.AVG)


def train_unchanged(run: MixGrpoRun) -> float:
    """``train_one_step``'s training part over ``run.samples_batched_list``; the summed logged loss."""
    transformer, optimizer, args, sigma_schedule = run.transformer, run.optimizer, run.args, run.sigma_schedule
    train_timesteps = run.train_timesteps
    total_loss = 0.0
    for i, sample in list(enumerate(run.samples_batched_list)):
        for _ in train_timesteps:
            new_log_probs = shapes.mix_one_step(
                args, sample["latents"][:, _], sample["next_latents"][:, _], sample["encoder_hidden_states"],
                sample["pooled_prompt_embeds"], sample["text_ids"], sample["image_ids"], transformer,
                sample["timesteps"][:, _], _, sigma_schedule)
            advantages = torch.clamp(sample["advantages"], -args.adv_clip_max, args.adv_clip_max)
            ratio = torch.exp(new_log_probs - sample["log_probs"][:, _])
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - args.clip_range, 1.0 + args.clip_range)
            policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss)) / (
                args.gradient_accumulation_steps * len(train_timesteps))
            kl_loss = 0.5 * torch.mean((new_log_probs - sample["log_probs"][:, _]) ** 2) / (
                args.gradient_accumulation_steps * len(train_timesteps))
            loss = policy_loss + args.kl_coeff * kl_loss
            run.seen.append((new_log_probs.detach(), ratio.detach(), loss.detach()))
            loss.backward()
            avg_loss = loss.detach().clone()
            _all_reduce_avg(avg_loss)
            total_loss += avg_loss.item()
        if (i + 1) % args.gradient_accumulation_steps == 0:
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), run.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    return total_loss


def train_jaggc(run: MixGrpoRun) -> float:
    """``train_unchanged`` with jaggc: the ``for _`` line declares the window's steps."""
    transformer, optimizer, args, sigma_schedule = run.transformer, run.optimizer, run.args, run.sigma_schedule
    train_timesteps = run.train_timesteps
    total_loss = 0.0
    for i, sample in list(enumerate(run.samples_batched_list)):
        for _ in jaggc.stepwise(transformer).steps(train_timesteps, sample["timesteps"][:, train_timesteps]):
            new_log_probs = shapes.mix_one_step(
                args, sample["latents"][:, _], sample["next_latents"][:, _], sample["encoder_hidden_states"],
                sample["pooled_prompt_embeds"], sample["text_ids"], sample["image_ids"], transformer,
                sample["timesteps"][:, _], _, sigma_schedule)
            advantages = torch.clamp(sample["advantages"], -args.adv_clip_max, args.adv_clip_max)
            ratio = torch.exp(new_log_probs - sample["log_probs"][:, _])
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - args.clip_range, 1.0 + args.clip_range)
            policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss)) / (
                args.gradient_accumulation_steps * len(train_timesteps))
            kl_loss = 0.5 * torch.mean((new_log_probs - sample["log_probs"][:, _]) ** 2) / (
                args.gradient_accumulation_steps * len(train_timesteps))
            loss = policy_loss + args.kl_coeff * kl_loss
            run.seen.append((new_log_probs.detach(), ratio.detach(), loss.detach()))
            loss.backward()
            avg_loss = loss.detach().clone()
            _all_reduce_avg(avg_loss)
            total_loss += avg_loss.item()
        if (i + 1) % args.gradient_accumulation_steps == 0:
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), run.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    return total_loss


def reference_loss(run: MixGrpoRun, i: int, transformer=None) -> torch.Tensor:
    """Sample ``i``'s window as one loss (``trainer_shapes.mix_grpo_loss``): the gradient's reference."""
    return shapes.mix_grpo_loss(transformer if transformer is not None else run.transformer, run.samples_batched_list[i],
                                run.train_timesteps, run.sigma_schedule, run.args)


__all__ = ["MixGrpoRun", "reference_loss", "setup", "train_jaggc", "train_unchanged"]
