"""Flow-GRPO's training loop (``scripts/train_sd3.py``) as the trainer writes it, and with jaggc.

Read from yifan123/flow_grpo, not copied: per sample batch, ``for j in train_timesteps`` inside
``accelerator.accumulate(transformer)``: ``compute_log_prob`` (CFG on ``[neg; pos]``, the uncond half
detached), the KL reference under ``torch.no_grad()`` and peft's ``disable_adapter()``, the PPO
lines, the logged ``info`` tensors, ``accelerator.backward(loss)``, ``clip_grad_norm_`` at
``sync_gradients``, ``optimizer.step()`` and ``optimizer.zero_grad()`` on every step (accelerate's
optimizer wrapper skips both off-sync). The Accelerator accumulates over
``gradient_accumulation_steps * num_train_timesteps`` steps.

``train_unchanged`` is that loop; ``train_jaggc`` is the same loop with the change a user makes
(its ``for`` line; ``setup(..., stepwise=...)`` is the other line: ``jaggc.stepwise(transformer,
window=4)`` after ``accelerator.prepare``). The step function (``compute_log_prob``) and the
rollout are ``jaggc_studies.trainer_shapes``'s.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

import jaggc
from jaggc_studies import trainer_shapes as shapes
from jaggc_studies.trainers import sizes


@dataclass(frozen=True)
class TrainConfig:
    """``config.train`` / ``config.sample`` fields the loop reads."""

    beta: float = 0.04
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    cfg: bool = True
    guidance_scale: float = 4.5
    noise_level: float = 0.7


@dataclass
class FlowGrpoRun:
    """What ``setup`` builds: the prepared model and optimizer, the pipeline (its scheduler and, for
    sampling, its transformer: the peft model inside the prepared one), the
    sample batches (one trajectory each) and the negative-prompt embeddings."""

    accelerator: Any
    transformer: Any
    optimizer: Any
    pipeline: Any
    samples_batched: list
    train_neg_prompt_embeds: torch.Tensor
    train_neg_pooled_prompt_embeds: torch.Tensor
    config: TrainConfig
    num_train_timesteps: int
    autocast: Any
    prompt_embeds: torch.Tensor = None            # this process's prompts, in sampling order (rollouts.py)
    pooled_prompt_embeds: torch.Tensor = None
    batch: int = 0                                # samples per sample batch and per training batch
    latent_shape: tuple = ()                      # one sample batch's latents
    seen: list = field(default_factory=list)      # per step: the values the loop computed (for checks)

    @property
    def num_batches(self) -> int:
        return len(self.samples_batched)


def setup(*, size: str = "tiny", num_steps: int = 8, batch: int = 4, trajectories: int = 2, seed: int = 0,
          config: TrainConfig = TrainConfig(), mixed_precision: str = "no", stepwise: dict | None = None,
          accelerator_kwargs: dict | None = None, dtype=torch.float32, shard: tuple[int, int] = (0, 1),
          where: sizes.Where | None = None) -> FlowGrpoRun:
    """A Flow-GRPO run: a tiny (or 10m) SD3 with a LoRA (peft), a rollout of ``trajectories`` sample
    batches of ``batch`` samples, an Accelerator on the CPU. ``mixed_precision``: "no", "bf16"
    (accelerate's own CPU autocast forward) or "fp16" (Flow-GRPO's default on a GPU: GradScaler in
    ``accelerator.backward``, an fp16 autocast forward; here on the CPU, ``fp16_on_cpu``).
    ``stepwise``: the keywords of the user's one added line, ``jaggc.stepwise(transformer, **stepwise)``.
    ``shard=(rank, world)``: this process's trajectories of a rollout of ``trajectories * world``
    (each process of a multi-GPU run samples its own). ``where`` (trainers/sizes.py): the size (the
    published one: SD3.5-Medium with Flow-GRPO's LoRA), the device and the base weights' dtype (bf16
    or fp16: accelerate's mixed precision of that name, as Flow-GRPO configures it)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # accelerate keeps one process-wide state; a study that builds several runs starts each anew
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    rank, world = shard
    if where is not None and where.dtype in (torch.bfloat16, torch.float16):
        mixed_precision = "bf16" if where.dtype == torch.bfloat16 else "fp16"
    on_cpu = where is None or torch.device(where.device).type == "cpu"
    shape = shapes.flow_grpo_sd3(num_steps=num_steps, batch=batch * trajectories * world, seed=seed, beta=config.beta,
                                 cfg=config.cfg, size=size, where=where)
    transformer, pipeline, sample, _ = shape.args
    if dtype != torch.float32:
        transformer.to(dtype)
        sample = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sample.items()}
    native_fp16 = mixed_precision == "bf16" or (mixed_precision == "fp16" and not on_cpu)
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=mixed_precision if native_fp16 else "no",
                              gradient_accumulation_steps=config.gradient_accumulation_steps * num_steps,
                              **(accelerator_kwargs or {}))
    if mixed_precision == "fp16" and on_cpu:
        fp16_on_cpu(accelerator, transformer)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    if stepwise is not None:
        jaggc.stepwise(transformer, **stepwise)
    neg = sample.pop("negative_prompt_embeds")[:1]
    neg_pooled = sample.pop("negative_pooled_prompt_embeds")[:1]
    samples_batched = [{k: v[i * batch:(i + 1) * batch] for k, v in sample.items()}
                       for i in range(rank, trajectories * world, world)]
    autocast = contextlib.nullcontext       # Flow-GRPO: nullcontext with LoRA, accelerator.autocast otherwise
    # the sampler's pipeline: its transformer is the peft model, inside what the loop trains
    sampler = shapes.Pipeline(pipeline.scheduler, accelerator.unwrap_model(transformer))
    mine = torch.cat([torch.arange(i * batch, (i + 1) * batch) for i in range(rank, trajectories * world, world)])
    return FlowGrpoRun(accelerator, transformer, optimizer, sampler, samples_batched,
                       neg.expand(batch, -1, -1).contiguous(), neg_pooled.expand(batch, -1).contiguous(), config,
                       num_steps, autocast, prompt_embeds=sample["prompt_embeds"][mine],
                       pooled_prompt_embeds=sample["pooled_prompt_embeds"][mine], batch=batch,
                       latent_shape=(batch, *sample["latents"].shape[2:]))


def fp16_on_cpu(accelerator, model) -> None:
    """What ``Accelerator(mixed_precision="fp16")`` does on a GPU, on the CPU (where accelerate has no
    fp16 autocast or GradScaler): a ``GradScaler`` for ``accelerator.backward``, the clip's unscale
    and the optimizer wrapper's ``scaler.step``, and the model's forward under an fp16 autocast with
    its outputs cast to fp32 (accelerate's ``convert_outputs_to_fp32``). Before ``prepare``."""
    import types

    from accelerate.utils import convert_outputs_to_fp32

    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    accelerator.native_amp = True
    forward = model.forward.__func__

    def autocast_forward(self, *args, **kwargs):
        with torch.autocast("cpu", torch.float16):
            return forward(self, *args, **kwargs)

    model.forward = types.MethodType(convert_outputs_to_fp32(autocast_forward), model)


def _disable_adapter(accelerator, transformer):
    # Flow-GRPO writes transformer.module.disable_adapter(): its transformer is always DDP-wrapped
    return accelerator.unwrap_model(transformer).disable_adapter()


def train_unchanged(run: FlowGrpoRun) -> list[dict]:
    """One epoch of Flow-GRPO's training loop over ``run.samples_batched``; the logged means per
    optimizer step."""
    accelerator, transformer, optimizer, pipeline, config = (run.accelerator, run.transformer, run.optimizer,
                                                             run.pipeline, run.config)
    autocast, logged = run.autocast, []
    info = defaultdict(list)
    for i, sample in enumerate(run.samples_batched):
        if config.cfg:
            embeds = torch.cat([run.train_neg_prompt_embeds[:len(sample["prompt_embeds"])], sample["prompt_embeds"]])
            pooled_embeds = torch.cat([run.train_neg_pooled_prompt_embeds[:len(sample["pooled_prompt_embeds"])],
                                       sample["pooled_prompt_embeds"]])
        else:
            embeds = sample["prompt_embeds"]
            pooled_embeds = sample["pooled_prompt_embeds"]
        train_timesteps = [step_index for step_index in range(run.num_train_timesteps)]
        for j in train_timesteps:
            with accelerator.accumulate(transformer):
                with autocast():
                    prev_sample, log_prob, prev_sample_mean, std_dev_t = shapes.compute_log_prob(
                        transformer, pipeline, sample, j, embeds, pooled_embeds, config)
                    if config.beta > 0:
                        with torch.no_grad():
                            with _disable_adapter(accelerator, transformer):
                                _, _, prev_sample_mean_ref, _ = shapes.compute_log_prob(
                                    transformer, pipeline, sample, j, embeds, pooled_embeds, config)
                advantages = torch.clamp(sample["advantages"][:, j], -config.adv_clip_max, config.adv_clip_max)
                ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                unclipped_loss = -advantages * ratio
                clipped_loss = -advantages * torch.clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range)
                policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                if config.beta > 0:
                    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (
                        2 * std_dev_t ** 2)
                    kl_loss = torch.mean(kl_loss)
                    loss = policy_loss + config.beta * kl_loss
                else:
                    loss = policy_loss
                info["approx_kl"].append(0.5 * torch.mean((log_prob - sample["log_probs"][:, j]) ** 2))
                info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > config.clip_range).float()))
                info["policy_loss"].append(policy_loss)
                if config.beta > 0:
                    info["kl_loss"].append(kl_loss)
                info["loss"].append(loss)
                run.seen.append((log_prob.detach(), ratio.detach(), loss.detach()))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(transformer.parameters(), config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                logged.append({k: torch.mean(torch.stack(v)).detach() for k, v in info.items()})
                info = defaultdict(list)
    return logged


def train_jaggc(run: FlowGrpoRun) -> list[dict]:
    """``train_unchanged`` with jaggc: the ``for j`` line declares the trajectory's steps."""
    accelerator, transformer, optimizer, pipeline, config = (run.accelerator, run.transformer, run.optimizer,
                                                             run.pipeline, run.config)
    autocast, logged = run.autocast, []
    info = defaultdict(list)
    for i, sample in enumerate(run.samples_batched):
        if config.cfg:
            embeds = torch.cat([run.train_neg_prompt_embeds[:len(sample["prompt_embeds"])], sample["prompt_embeds"]])
            pooled_embeds = torch.cat([run.train_neg_pooled_prompt_embeds[:len(sample["pooled_prompt_embeds"])],
                                       sample["pooled_prompt_embeds"]])
        else:
            embeds = sample["prompt_embeds"]
            pooled_embeds = sample["pooled_prompt_embeds"]
        train_timesteps = [step_index for step_index in range(run.num_train_timesteps)]
        for j in jaggc.stepwise(transformer).steps(train_timesteps, sample["timesteps"][:, train_timesteps]):
            with accelerator.accumulate(transformer):
                with autocast():
                    prev_sample, log_prob, prev_sample_mean, std_dev_t = shapes.compute_log_prob(
                        transformer, pipeline, sample, j, embeds, pooled_embeds, config)
                    if config.beta > 0:
                        with torch.no_grad():
                            with _disable_adapter(accelerator, transformer):
                                _, _, prev_sample_mean_ref, _ = shapes.compute_log_prob(
                                    transformer, pipeline, sample, j, embeds, pooled_embeds, config)
                advantages = torch.clamp(sample["advantages"][:, j], -config.adv_clip_max, config.adv_clip_max)
                ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                unclipped_loss = -advantages * ratio
                clipped_loss = -advantages * torch.clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range)
                policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                if config.beta > 0:
                    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (
                        2 * std_dev_t ** 2)
                    kl_loss = torch.mean(kl_loss)
                    loss = policy_loss + config.beta * kl_loss
                else:
                    loss = policy_loss
                info["approx_kl"].append(0.5 * torch.mean((log_prob - sample["log_probs"][:, j]) ** 2))
                info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > config.clip_range).float()))
                info["policy_loss"].append(policy_loss)
                if config.beta > 0:
                    info["kl_loss"].append(kl_loss)
                info["loss"].append(loss)
                run.seen.append((log_prob.detach(), ratio.detach(), loss.detach()))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(transformer.parameters(), config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                logged.append({k: torch.mean(torch.stack(v)).detach() for k, v in info.items()})
                info = defaultdict(list)
    return logged


def reference_loss(run: FlowGrpoRun, sample: dict, transformer=None) -> torch.Tensor:
    """One trajectory's loss as a whole (``trainer_shapes.flow_grpo_loss``: the same steps summed,
    divided as ``accelerator.backward`` divides each step's): what ``@jagg_compile`` takes; the
    reference the loop's gradient is checked against."""
    config = run.config
    batch = len(sample["prompt_embeds"])
    full = dict(sample, negative_prompt_embeds=run.train_neg_prompt_embeds[:batch],
                negative_pooled_prompt_embeds=run.train_neg_pooled_prompt_embeds[:batch])
    as_shape = shapes.GRPOConfig(clip_range=config.clip_range, adv_clip_max=config.adv_clip_max, beta=config.beta,
                                 noise_level=config.noise_level, guidance_scale=config.guidance_scale, cfg=config.cfg,
                                 mixed_precision=False)
    model = transformer if transformer is not None else run.accelerator.unwrap_model(run.transformer)
    # the loss reads the pipeline's scheduler only (a pipeline holding the model is not the loss's input)
    return shapes.flow_grpo_loss(model, shapes.Pipeline(run.pipeline.scheduler), full, as_shape) / \
        config.gradient_accumulation_steps


__all__ = ["FlowGrpoRun", "TrainConfig", "fp16_on_cpu", "reference_loss", "setup", "train_jaggc", "train_unchanged"]
