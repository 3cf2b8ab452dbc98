"""The trainers' sampling phase of an epoch, as they write it: what an on-policy epoch trains on.

Each ``*_epoch(run, seed=...)`` samples new trajectories with the run's CURRENT parameters and
replaces the run's samples, so the training loop that follows trains on-policy until its first
optimizer step (Flow-GRPO: the first of its two accumulation groups; DanceGRPO and MixGRPO: the
samples before the first step). Read from the repositories, not copied; what differs between their
rollout and training calls is what a rollout cache must meet (background/trainer-shapes.md):

* Flow-GRPO (``train_sd3.py`` + ``pipeline_with_logprob``): sampling calls ``pipeline.transformer``,
  the peft model *inside* the module the loop trains (the ``accelerator.prepare``d one; on several
  GPUs its DDP wrapper), in ``eval()``, under ``torch.no_grad()``, on ``[neg; pos]`` batches with
  ``joint_attention_kwargs=None`` (the training call omits it), the SDE step's noise drawn per step;
  then the rewards, the advantages, the samples shuffled along the batch and re-batched;
* DanceGRPO (``sample_reference_model`` + ``run_sample_step``): one sample at a time through the
  (FSDP-wrapped) module the loop trains, in ``eval()``, the call inside a CUDA bf16 autocast block
  as in training, ``timestep = int(σ * 1000) / 1000``; then each sample's random permutation;
* MixGRPO: DanceGRPO's sampler with Flow-GRPO's SDE step on its window and ODE steps elsewhere.
"""

from __future__ import annotations

import torch

from jaggc import grpo
from jaggc_studies import trainer_shapes as shapes


def flow_grpo_epoch(run, *, seed: int) -> None:
    """Flow-GRPO's sampling epoch on ``run`` (loops.flow_grpo): ``run.num_batches`` sample batches."""
    pipeline, config = run.pipeline, run.config
    transformer = pipeline.transformer
    scheduler = pipeline.scheduler
    g = torch.Generator().manual_seed(seed)
    device = next(transformer.parameters()).device
    batch, timesteps = run.batch, scheduler.timesteps
    transformer.eval()
    samples = []
    for i in range(run.num_batches):
        prompts = run.prompt_embeds[i * batch:(i + 1) * batch]
        pooled = run.pooled_prompt_embeds[i * batch:(i + 1) * batch]
        embeds = torch.cat([run.train_neg_prompt_embeds[:batch], prompts]) if config.cfg else prompts
        pooled_embeds = torch.cat([run.train_neg_pooled_prompt_embeds[:batch], pooled]) if config.cfg else pooled
        z = torch.randn(run.latent_shape, generator=g).to(device=device, dtype=prompts.dtype)
        latents, log_probs = [z], []
        with torch.no_grad(), run.autocast():
            for t in timesteps:
                model_input = torch.cat([z] * 2) if config.cfg else z
                noise_pred = transformer(hidden_states=model_input, timestep=t.expand(model_input.shape[0]),
                                         encoder_hidden_states=embeds, pooled_projections=pooled_embeds,
                                         joint_attention_kwargs=None, return_dict=False)[0]
                if config.cfg:
                    uncond, text = noise_pred.chunk(2)
                    noise_pred = uncond + config.guidance_scale * (text - uncond)
                z, log_prob, _, _ = shapes.sde_step_with_logprob(
                    scheduler, noise_pred.float(), t.unsqueeze(0), z.float(), noise_level=config.noise_level,
                    generator=g)
                z = z.to(prompts.dtype)          # the step computes in fp32; the states are stored in the model's
                latents.append(z)
                log_probs.append(log_prob)
        stored = torch.stack(latents, 1)
        keep = run.num_train_timesteps
        samples.append(dict(prompt_embeds=prompts, pooled_prompt_embeds=pooled,
                            timesteps=timesteps[:keep].to(device).expand(batch, -1),
                            latents=stored[:, :keep], next_latents=stored[:, 1:keep + 1],
                            log_probs=torch.stack(log_probs, 1)[:, :keep], rewards=-(z ** 2).mean(dim=(1, 2, 3))))
    collated = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    rewards = collated.pop("rewards")
    advantages = grpo.flow_grpo_advantages(rewards.cpu(), [k // 2 for k in range(len(rewards))]).to(rewards)
    collated["advantages"] = advantages[:, None].expand(-1, run.num_train_timesteps).contiguous()
    total = len(rewards)
    perm = torch.randperm(total, generator=g)           # shuffle along the batch, then re-batch
    collated = {k: v[perm.to(v.device)] for k, v in collated.items()}
    run.samples_batched = [{k: v[i * batch:(i + 1) * batch] for k, v in collated.items()}
                           for i in range(total // batch)]
    transformer.train()


def dance_grpo_epoch(run, *, seed: int) -> None:
    """DanceGRPO's sampling epoch on ``run`` (loops.dance_grpo): one sample at a time, then each
    sample's new random permutation of its steps."""
    g = torch.Generator().manual_seed(seed + 5)
    run.perms = torch.stack([torch.randperm(run.stored_steps, generator=g) for _ in run.samples_batched_list])
    _flux_epoch(run, seed=seed, guidance=torch.float32,
                step=lambda pred, z, i: shapes.flux_step(pred, z, run.args.eta, run.sigma_schedule, i, None, True, True)[::2])


def mix_grpo_epoch(run, *, seed: int) -> None:
    """MixGRPO's sampling epoch on ``run`` (loops.mix_grpo): SDE on its window, ODE elsewhere."""
    window = set(run.train_timesteps)

    def step(pred, z, i):
        z, _, log_prob, _, _ = shapes.flow_grpo_step(pred, z, run.args.eta, run.sigma_schedule, i, None,
                                                     determistic=i not in window, noise_level=run.args.noise_level)
        return z, log_prob

    # MixGRPO's sampler passes its guidance as a bf16 tensor, as its training step does
    _flux_epoch(run, seed=seed, step=step, guidance=torch.bfloat16)


def _flux_epoch(run, *, seed: int, step, guidance: torch.dtype) -> None:
    transformer, cond = run.transformer, run.cond
    device = cond["encoder_hidden_states"].device
    torch.manual_seed(seed)                  # the steps draw their noise with randn_like
    num_steps = run.stored_steps
    samples = []
    transformer.eval()
    for i, stored_sample in enumerate(run.samples_batched_list):
        # the prompt's embeddings as the samples store them (the training calls read those)
        embeds, pooled = stored_sample["encoder_hidden_states"], stored_sample["pooled_prompt_embeds"]
        dtype = stored_sample["latents"].dtype
        z = torch.randn(run.latent_shape).to(device, dtype)
        latents, log_probs = [z], []
        with torch.no_grad():
            for k in range(run.sigma_schedule.shape[0] - 1):
                timesteps = torch.full([1], int(run.sigma_schedule[k] * 1000), device=device, dtype=torch.long)
                with torch.autocast("cuda", torch.bfloat16):
                    pred = transformer(hidden_states=z, encoder_hidden_states=embeds,
                                       timestep=timesteps / 1000,
                                       guidance=torch.tensor([3.5], device=device, dtype=guidance),
                                       txt_ids=cond["txt_ids"], pooled_projections=pooled,
                                       img_ids=cond["img_ids"], joint_attention_kwargs=None, return_dict=False)[0]
                z, log_prob = step(pred, z, k)
                z = z.to(dtype)
                latents.append(z)
                log_probs.append(log_prob)
        stored = torch.stack(latents, 1)
        samples.append(dict(latents=stored[:, :num_steps], next_latents=stored[:, 1:num_steps + 1],
                            log_probs=torch.stack(log_probs, 1)[:, :num_steps], reward=-(z ** 2).mean()))
    rewards = torch.stack([s.pop("reward") for s in samples])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8) if len(rewards) > 1 else rewards * 0
    timesteps = torch.tensor([[int(s * 1000) for s in run.sigma_schedule[:num_steps]]], device=device)
    for i, (s, old) in enumerate(zip(samples, run.samples_batched_list)):
        perm = run.perms[i] if getattr(run, "perms", None) is not None else torch.arange(num_steps)
        fresh = dict(s, timesteps=timesteps)
        for key in ("timesteps", "latents", "next_latents", "log_probs"):
            fresh[key] = fresh[key][:, perm]
        old.update(fresh, advantages=advantages[i:i + 1])
    transformer.train()


__all__ = ["dance_grpo_epoch", "flow_grpo_epoch", "mix_grpo_epoch"]
