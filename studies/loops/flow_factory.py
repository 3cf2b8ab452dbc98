"""Flow-Factory's GRPO loop (``src/flow_factory/trainers/grpo.py``, ``GRPOTrainer.optimize``), unchanged and with jaggc.

Read from X-GenGroup/Flow-Factory, not copied. Per inner epoch the samples are shuffled with a seeded
``randperm`` and re-batched (``per_device_batch_size``); under ``self.autocast()`` (accelerate's bf16
autocast), for each batch ``for idx, timestep_index in enumerate(scheduler.train_timesteps)``, inside
``accelerator.accumulate``: the model adapter's ``forward`` (the SD3.5 adapter: CFG on
``[latents] * 2`` with grad on both halves, the timestep cast with ``t.expand(B).to(latents.dtype)``
to the latents' storage dtype, the Flow-SDE log-prob), the PPO clip on ``exp(log_prob - old)``, the KL
term on the velocity ('v-based') whose reference runs under ``torch.no_grad()`` and
``adapter.use_ref_parameters()`` (LoRA: peft's ``disable_adapter()``; full fine-tune: the reference's
``.data`` swapped into every trainable parameter and back, between the step's forward and its
backward), ``accelerator.backward(loss)``, and at ``sync_gradients`` ``clip_grad_norm_``,
``optimizer.step()``, ``zero_grad()`` and the logging of the losses: inside the last step's body.
As Flow-Factory writes it (read at X-GenGroup/Flow-Factory 0574042), the KL divergence is computed
inside the reference's ``torch.no_grad()`` block, so the KL term is logged and added to the loss but
adds no gradient; the loop here keeps that.
``train_timesteps`` is ``num_sde_steps`` indices drawn by a seeded ``randperm`` from ``sde_steps``,
in that random order, the same on every rank. The accelerator accumulates over
``gradient_accumulation_steps * num_train_timesteps`` steps (several trajectories per sync).

``train_unchanged`` is that loop; ``train_jaggc`` the same with the user's change (its ``for`` line;
``jaggc.stepwise(transformer, window=4)`` after ``accelerator.prepare`` or the FSDP2 wrap is the other).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

import jaggc
from jaggc import models
from jaggc_studies.trainers import sizes
from jaggc_studies.trainers.common import off_policy_step


@dataclass(frozen=True)
class TrainingArguments:
    """``GRPOTrainingArguments`` fields the loop reads (Flow-Factory's ``sd3_5`` example's values
    where it has them; ``clip_range`` and ``adv_clip_range`` are (low, high) offsets as there)."""

    kl_beta: float = 0.04
    kl_type: str = "v-based"
    clip_range: tuple = (-1e-4, 1e-4)
    adv_clip_range: tuple = (-5.0, 5.0)
    max_grad_norm: float = 1.0
    per_device_batch_size: int = 2
    gradient_accumulation_steps: int = 2        # batches (trajectories) per optimizer step
    num_inner_epochs: int = 1
    guidance_scale: float = 4.5
    learning_rate: float = 1e-3
    seed: int = 0


class FlowSDEScheduler:
    """The Flow-SDE scheduler's parts the loop reads: the shift-3 schedule (timesteps = 1000 σ in
    float32), ``train_timesteps`` (``num_sde_steps`` of ``sde_steps`` in a seeded ``randperm`` order)
    and the SDE step's log-prob (Flow-GRPO's, σ from the timesteps)."""

    def __init__(self, num_inference_steps: int, sde_steps: list[int], num_sde_steps: int, noise_level: float = 0.7):
        sigmas = torch.linspace(1, 0, num_inference_steps + 1)
        self.sigmas = 3.0 * sigmas / (1 + 2.0 * sigmas)
        self.timesteps = (self.sigmas[:-1] * 1000).float()
        self.sde_steps, self.num_sde_steps, self.noise_level = list(sde_steps), num_sde_steps, noise_level
        self.set_seed(0)

    def set_seed(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(self.sde_steps), generator=g)[:self.num_sde_steps]
        self.current_sde_steps = [self.sde_steps[int(i)] for i in order]

    @property
    def train_timesteps(self) -> list[int]:
        return self.current_sde_steps

    def step(self, noise_pred, t, t_next, latents, next_latents=None, generator=None):
        """(next latents, log-prob, next-latents mean) of the SDE step from ``t`` to ``t_next``."""
        shape = (-1,) + (1,) * (latents.ndim - 1)
        sigma, sigma_next = (t.float() / 1000).view(shape), (t_next.float() / 1000).view(shape)
        noise_pred, latents = noise_pred.float(), latents.float()
        dt = sigma_next - sigma
        sigma_max = float(self.sigmas[1])
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * self.noise_level
        mean = latents * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + noise_pred * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
        if next_latents is None:
            noise = torch.randn(latents.shape, generator=generator).to(latents.device)
            next_latents = mean + std_dev_t * torch.sqrt(-dt) * noise
        next_latents = next_latents.float()
        log_prob = (-((next_latents.detach() - mean) ** 2) / (2 * (std_dev_t * torch.sqrt(-dt)) ** 2)
                    - torch.log(std_dev_t * torch.sqrt(-dt)) - math.log(math.sqrt(2 * math.pi)))
        return next_latents, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean


@dataclass
class Output:
    log_prob: torch.Tensor | None = None
    noise_pred: torch.Tensor | None = None
    next_latents_mean: torch.Tensor | None = None


class SD3Adapter:
    """The model adapter: the DiT the loop trains (as prepared or wrapped), its scheduler, and the
    reference parameters of the KL term (LoRA: the adapter off; full fine-tune: a frozen copy)."""

    def __init__(self, transformer, scheduler: FlowSDEScheduler, *, lora: bool, unwrap):
        self.transformer, self.scheduler, self.lora, self.unwrap = transformer, scheduler, lora, unwrap
        self.ref_parameters = None if lora else [p.detach().clone() for p in self.get_trainable_parameters()]

    @property
    def trainable_components(self) -> list:
        return [self.transformer]

    def get_trainable_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def train(self) -> None:
        self.transformer.train()

    @contextlib.contextmanager
    def use_ref_parameters(self):
        if self.lora:
            with self.unwrap(self.transformer).disable_adapter():
                yield
            return
        params = self.get_trainable_parameters()
        own = [p.data for p in params]
        for p, ref in zip(params, self.ref_parameters):
            p.data = ref
        try:
            yield
        finally:
            for p, data in zip(params, own):
                p.data = data

    def forward(self, t, t_next, latents, next_latents, prompt_embeds, pooled_prompt_embeds, negative_prompt_embeds,
                negative_pooled_prompt_embeds, guidance_scale, compute_log_prob=True, return_kwargs=("log_prob",)):
        """The DiT on ``[uncond; cond]`` (both halves with grad), the guided velocity, the SDE log-prob."""
        B = latents.shape[0]
        timestep = t.expand(B).to(latents.dtype)          # the latents' storage dtype: bf16 or fp16
        noise_pred = self.transformer(
            hidden_states=torch.cat([latents] * 2), timestep=torch.cat([timestep] * 2),
            encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]),
            pooled_projections=torch.cat([negative_pooled_prompt_embeds, pooled_prompt_embeds]), return_dict=False)[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        out = Output(noise_pred=noise_pred)
        if compute_log_prob or "next_latents_mean" in return_kwargs:
            _, out.log_prob, out.next_latents_mean = self.scheduler.step(noise_pred, t, t_next, latents, next_latents)
        return out


@dataclass
class FlowFactoryRun:
    accelerator: Any
    adapter: SD3Adapter
    optimizer: Any
    samples: list
    training_args: TrainingArguments
    epoch: int = 0
    seen: list = field(default_factory=list)        # per step: the values the loop computed

    @property
    def transformer(self):
        return self.adapter.transformer

    def autocast(self):
        """``BaseTrainer.autocast``: accelerate's autocast (bf16 on the CPU); under fp16 mixed precision,
        which accelerate has not on a CPU, the fp16 autocast a GPU's would be."""
        if self.accelerator.scaler is not None:
            return torch.autocast("cpu", torch.float16)
        return self.accelerator.autocast()


def fsdp1_wrap(model):
    """FSDP1 (``use_orig_params``: a LoRA's trained and frozen parameters share flat parameters),
    each transformer block a unit, as accelerate's FSDP plugin wraps a DiT by its block class."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(base.transformer_blocks[0])}),
                                    sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
                                    device_id=torch.device("cpu"))


def fsdp2_wrap(model):
    """FSDP2 as Flow-Factory's ``fsdp2.yaml`` shards a DiT: each transformer block, then the root."""
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for block in base.transformer_blocks:
        fully_shard(block)
    return fully_shard(model)


def setup(*, num_inference_steps: int = 10, sde_steps=(1, 2, 3, 4, 5, 6, 7, 8), num_sde_steps: int = 4,
          samples_per_rank: int = 4, lora: bool = True, latent_dtype=torch.bfloat16, mixed_precision: str = "bf16",
          engine: str = "accelerate", shard: tuple[int, int] = (0, 1), seed: int = 0,
          training_args: TrainingArguments = TrainingArguments(), stepwise: dict | None = None,
          size: str = "tiny") -> FlowFactoryRun:
    """A Flow-Factory run on a tiny SD3: a LoRA (peft) or every parameter trained, a rollout of
    ``samples_per_rank`` samples per rank stored in ``latent_dtype``, an Accelerator on the CPU with
    ``mixed_precision`` (its live CPU bf16 autocast; "fp16": an fp16 autocast forward and a
    GradScaler, ``flow_grpo.fp16_on_cpu``). ``engine``: "accelerate" (one process, or DDP
    when torch.distributed is initialized), "fsdp1" or "fsdp2" (the model wrapped before ``prepare``,
    which then prepares the optimizer only: accelerate's FSDP plugin does not start on a CPU group;
    its ``accumulate`` then syncs FSDP2 every step and runs FSDP1's ``no_sync`` off-sync), or "deepspeed"
    (accelerate's DeepSpeed plugin, ZeRO-2: ``deepspeed_zero2_accelerator``). ``stepwise``: the keywords of the user's added line."""
    import peft
    from accelerate import Accelerator

    if engine in ("fsdp1", "fsdp2") and not lora:
        raise ValueError("the full fine-tune's .data swap of sharded parameters is not modelled here; use lora=True")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    rank, world = shard
    args = training_args
    base = models.sd3(size, seed=seed)
    if lora:
        torch.manual_seed(seed + 7)
        transformer = peft.get_peft_model(base, peft.LoraConfig(**sizes.SMALL_LORA))   # random A and B: the
        # adapter-off reference differs from the policy
    else:
        transformer = base
    scheduler = FlowSDEScheduler(num_inference_steps, list(sde_steps), num_sde_steps)
    scheduler.set_seed(args.seed)
    samples = _rollout(transformer, scheduler, samples_per_rank * world, latent_dtype, seed, args)[rank::world]
    ref = None if lora else [p.detach().clone() for p in transformer.parameters() if p.requires_grad]
    off_policy_step(transformer, seed, (lambda name: "lora_" in name) if lora else (lambda name: True))
    steps_per_sync = args.gradient_accumulation_steps * num_sde_steps
    if engine == "deepspeed":
        accelerator = deepspeed_zero2_accelerator(args, steps_per_sync, mixed_precision)
        if mixed_precision == "bf16":
            samples = [_conditioning_in(s, torch.bfloat16) for s in samples]
    else:
        accelerator = Accelerator(cpu=True, mixed_precision="no" if mixed_precision == "fp16" else mixed_precision,
                                  gradient_accumulation_steps=steps_per_sync)
    if mixed_precision == "fp16":
        # a GPU's fp16 mixed precision on the CPU: fp16 autocast forward, GradScaler (flow_grpo.py)
        from jaggc_studies.loops.flow_grpo import fp16_on_cpu

        fp16_on_cpu(accelerator, transformer)
    if engine in ("fsdp1", "fsdp2"):
        transformer = (fsdp1_wrap if engine == "fsdp1" else fsdp2_wrap)(transformer)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    if engine in ("fsdp1", "fsdp2"):
        optimizer = accelerator.prepare(optimizer)
    else:
        transformer, optimizer = accelerator.prepare(transformer, optimizer)
    if stepwise is not None:
        jaggc.stepwise(transformer, **stepwise)
    adapter = SD3Adapter(transformer, scheduler, lora=lora, unwrap=accelerator.unwrap_model)
    if ref is not None:
        # the reference: the parameters the rollout sampled with, in the trained parameters' dtype
        # (DeepSpeed's bf16 mode casts the module at prepare)
        adapter.ref_parameters = [r.to(p.dtype) for r, p in zip(ref, adapter.get_trainable_parameters())]
    return FlowFactoryRun(accelerator, adapter, optimizer, samples, args)


def deepspeed_zero2_accelerator(args: TrainingArguments, steps_per_sync: int, mixed_precision: str):
    """accelerate with its DeepSpeed plugin as Flow-Factory's ``config/deepspeed/deepspeed_zero2.yaml``
    sets it up: ``distributed_type: DEEPSPEED``, ZeRO stage 2, neither optimizer nor parameters
    offloaded, no ZeRO-3 init; the training config's mixed precision and accumulation. Under it
    ``accelerator.backward`` is the engine's backward and, at the sync, its step (clip at
    ``gradient_clipping``, here the trainer's ``max_grad_norm``; the optimizer step; the zeroing),
    ``clip_grad_norm_`` only reads the engine's norm and the optimizer wrapper's ``step``/``zero_grad``
    are no-ops. "bf16" is DeepSpeed's bf16 mode (the module cast to bf16, fp32 master partitions, no
    autocast). On a CPU accelerate takes the plugin only off ``cpu=True``, with ``LOCAL_RANK`` set and
    torch.distributed initialized (the ranks' gloo group)."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if mixed_precision == "fp16":
        raise ValueError("DeepSpeed's fp16 mode is not modelled here; use mixed_precision='bf16' or 'no'")
    world = dist.get_world_size() if dist.is_initialized() else 1
    plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="none", offload_param_device="none",
                             zero3_init_flag=False, gradient_accumulation_steps=steps_per_sync,
                             gradient_clipping=args.max_grad_norm)
    plugin.deepspeed_config.update({"zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
                                    "train_micro_batch_size_per_gpu": args.per_device_batch_size,
                                    "train_batch_size": args.per_device_batch_size * steps_per_sync * world})
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=mixed_precision,
                              gradient_accumulation_steps=steps_per_sync)
    if accelerator.distributed_type.name != "DEEPSPEED":
        raise RuntimeError(f"accelerate did not take its DeepSpeed plugin ({accelerator.distributed_type}): "
                           f"set LOCAL_RANK and initialize torch.distributed first")
    return accelerator


def _conditioning_in(sample: dict, dtype) -> dict:
    """ZeRO's bf16 mode casts the module, not its inputs: the prompt embeddings stored in the
    module's dtype, as a bf16 pipeline's text encoders give them (the latents already are)."""
    keys = ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds")
    return {k: (v.to(dtype) if k in keys else v) for k, v in sample.items()}


def _rollout(transformer, scheduler: FlowSDEScheduler, n: int, latent_dtype, seed: int, args) -> list[dict]:
    """``n`` samples of one prompt group each (no grad): the stored trajectory in ``latent_dtype``, the
    old log-probs at the SDE steps (ODE elsewhere), float32 timesteps, advantages."""
    g = torch.Generator().manual_seed(seed + 3)
    cfg = transformer.config
    cond = dict(prompt_embeds=torch.randn(n, 5, cfg.joint_attention_dim, generator=g),
                pooled_prompt_embeds=torch.randn(n, cfg.pooled_projection_dim, generator=g),
                negative_prompt_embeds=torch.randn(1, 5, cfg.joint_attention_dim, generator=g).expand(n, -1, -1),
                negative_pooled_prompt_embeds=torch.randn(1, cfg.pooled_projection_dim, generator=g).expand(n, -1))
    z = torch.randn(models.sd3_latent_shape(transformer, n), generator=g).to(latent_dtype)
    adapter = SD3Adapter(transformer, scheduler, lora=True, unwrap=lambda m: m)
    T = len(scheduler.timesteps)
    timesteps = scheduler.timesteps.expand(n, T)
    lat, lps = [z], []
    half = torch.float16 if latent_dtype == torch.float16 else torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", half):
        for i in range(T):
            t = timesteps[:, i]
            t_next = timesteps[:, i + 1] if i + 1 < T else torch.zeros(n)
            v = adapter.forward(t, t_next, z, None, guidance_scale=args.guidance_scale, compute_log_prob=False,
                                **cond).noise_pred
            if i in scheduler.sde_steps:
                nxt, lp, _ = scheduler.step(v, t, t_next, z, generator=g)
            else:
                nxt, lp = z.float() + v.float() * (t_next - t).view(-1, 1, 1, 1) / 1000, torch.zeros(n)
            z = nxt.to(latent_dtype)
            lat.append(z)
            lps.append(lp)
    rewards = -(z.float() ** 2).mean(dim=(1, 2, 3))
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    all_latents, log_probs = torch.stack(lat, 1), torch.stack(lps, 1)
    return [dict(all_latents=all_latents[i], log_probs=log_probs[i], timesteps=timesteps[i].clone(), advantage=adv[i],
                 latent_index_map=torch.arange(T + 1), log_prob_index_map=torch.arange(T),
                 **{k: v[i] for k, v in cond.items()}) for i in range(n)]


def stack(samples: list[dict]) -> dict:
    """``BaseSample.stack``: every tensor field stacked; the index maps are shared."""
    out = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    out["latent_index_map"], out["log_prob_index_map"] = samples[0]["latent_index_map"], samples[0]["log_prob_index_map"]
    return out


def _forward_inputs(batch: dict, t, t_next, latents, next_latents, args: TrainingArguments) -> dict:
    keys = ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds")
    return dict(t=t, t_next=t_next, latents=latents, next_latents=next_latents, guidance_scale=args.guidance_scale,
                compute_log_prob=True, **{k: batch[k] for k in keys})


def train_unchanged(run: FlowFactoryRun) -> list[dict]:
    """``GRPOTrainer.optimize`` over ``run.samples``; the logged means per optimizer step."""
    accelerator, adapter, optimizer, args = run.accelerator, run.adapter, run.optimizer, run.training_args
    logged = []
    for inner_epoch in range(args.num_inner_epochs):
        perm_gen = torch.Generator().manual_seed(args.seed + 1000 * run.epoch + inner_epoch)
        perm = torch.randperm(len(run.samples), generator=perm_gen)
        shuffled_samples = [run.samples[i] for i in perm]
        sample_batches = [stack(shuffled_samples[i:i + args.per_device_batch_size])
                          for i in range(0, len(shuffled_samples), args.per_device_batch_size)]
        adapter.train()
        loss_info = defaultdict(list)
        with run.autocast():
            for batch_idx, batch in enumerate(sample_batches):
                latents_index_map = batch["latent_index_map"]
                log_probs_index_map = batch["log_prob_index_map"]
                for idx, timestep_index in enumerate(adapter.scheduler.train_timesteps):
                    with accelerator.accumulate(*adapter.trainable_components):
                        old_log_prob = batch["log_probs"][:, log_probs_index_map[timestep_index]]
                        num_timesteps = batch["timesteps"].shape[1]
                        t = batch["timesteps"][:, timestep_index]
                        t_next = (batch["timesteps"][:, timestep_index + 1] if timestep_index + 1 < num_timesteps
                                  else torch.tensor(0.0))
                        latents = batch["all_latents"][:, latents_index_map[timestep_index]]
                        next_latents = batch["all_latents"][:, latents_index_map[timestep_index + 1]]
                        forward_inputs = _forward_inputs(batch, t, t_next, latents, next_latents, args)
                        output = adapter.forward(**forward_inputs, return_kwargs=["log_prob", "noise_pred"])
                        adv = torch.clamp(batch["advantage"], args.adv_clip_range[0], args.adv_clip_range[1])
                        ratio = torch.exp(output.log_prob - old_log_prob)
                        unclipped_loss = -adv * ratio
                        clipped_loss = -adv * torch.clamp(ratio, 1.0 + args.clip_range[0], 1.0 + args.clip_range[1])
                        policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                        loss = policy_loss
                        if args.kl_beta > 0:
                            with torch.no_grad(), adapter.use_ref_parameters():
                                ref_forward_inputs = dict(forward_inputs, compute_log_prob=False)
                                ref_output = adapter.forward(**ref_forward_inputs, return_kwargs=["noise_pred"])
                                kl_div = torch.mean((output.noise_pred - ref_output.noise_pred) ** 2,
                                                    dim=tuple(range(1, output.noise_pred.ndim)), keepdim=True)
                            kl_div = torch.mean(kl_div)
                            kl_loss = args.kl_beta * kl_div
                            loss = loss + kl_loss
                            loss_info["kl_div"].append(kl_div.detach())
                            loss_info["kl_loss"].append(kl_loss.detach())
                        loss_info["ratio"].append(ratio.detach())
                        loss_info["policy_loss"].append(policy_loss.detach())
                        loss_info["loss"].append(loss.detach())
                        loss_info["clip_frac_high"].append(torch.mean((ratio > 1.0 + args.clip_range[1]).float()))
                        run.seen.append((output.log_prob.detach(), ratio.detach(), loss.detach()))
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(adapter.get_trainable_parameters(),
                                                                    args.max_grad_norm)
                            optimizer.step()
                            optimizer.zero_grad()
                            loss_info = {k: torch.stack(v).mean() for k, v in loss_info.items()}
                            loss_info = accelerator.reduce(loss_info, reduction="mean")
                            logged.append(dict(loss_info, grad_norm=_local(grad_norm)))
                            loss_info = defaultdict(list)
    run.epoch += 1
    return logged


def train_jaggc(run: FlowFactoryRun) -> list[dict]:
    """``train_unchanged`` with jaggc: the ``for idx`` line declares the batch's trained steps."""
    accelerator, adapter, optimizer, args = run.accelerator, run.adapter, run.optimizer, run.training_args
    logged = []
    for inner_epoch in range(args.num_inner_epochs):
        perm_gen = torch.Generator().manual_seed(args.seed + 1000 * run.epoch + inner_epoch)
        perm = torch.randperm(len(run.samples), generator=perm_gen)
        shuffled_samples = [run.samples[i] for i in perm]
        sample_batches = [stack(shuffled_samples[i:i + args.per_device_batch_size])
                          for i in range(0, len(shuffled_samples), args.per_device_batch_size)]
        adapter.train()
        loss_info = defaultdict(list)
        with run.autocast():
            for batch_idx, batch in enumerate(sample_batches):
                latents_index_map = batch["latent_index_map"]
                log_probs_index_map = batch["log_prob_index_map"]
                for idx, timestep_index in jaggc.stepwise(adapter.transformer).steps(enumerate(adapter.scheduler.train_timesteps), batch["timesteps"][:, adapter.scheduler.train_timesteps]):
                    with accelerator.accumulate(*adapter.trainable_components):
                        old_log_prob = batch["log_probs"][:, log_probs_index_map[timestep_index]]
                        num_timesteps = batch["timesteps"].shape[1]
                        t = batch["timesteps"][:, timestep_index]
                        t_next = (batch["timesteps"][:, timestep_index + 1] if timestep_index + 1 < num_timesteps
                                  else torch.tensor(0.0))
                        latents = batch["all_latents"][:, latents_index_map[timestep_index]]
                        next_latents = batch["all_latents"][:, latents_index_map[timestep_index + 1]]
                        forward_inputs = _forward_inputs(batch, t, t_next, latents, next_latents, args)
                        output = adapter.forward(**forward_inputs, return_kwargs=["log_prob", "noise_pred"])
                        adv = torch.clamp(batch["advantage"], args.adv_clip_range[0], args.adv_clip_range[1])
                        ratio = torch.exp(output.log_prob - old_log_prob)
                        unclipped_loss = -adv * ratio
                        clipped_loss = -adv * torch.clamp(ratio, 1.0 + args.clip_range[0], 1.0 + args.clip_range[1])
                        policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                        loss = policy_loss
                        if args.kl_beta > 0:
                            with torch.no_grad(), adapter.use_ref_parameters():
                                ref_forward_inputs = dict(forward_inputs, compute_log_prob=False)
                                ref_output = adapter.forward(**ref_forward_inputs, return_kwargs=["noise_pred"])
                                kl_div = torch.mean((output.noise_pred - ref_output.noise_pred) ** 2,
                                                    dim=tuple(range(1, output.noise_pred.ndim)), keepdim=True)
                            kl_div = torch.mean(kl_div)
                            kl_loss = args.kl_beta * kl_div
                            loss = loss + kl_loss
                            loss_info["kl_div"].append(kl_div.detach())
                            loss_info["kl_loss"].append(kl_loss.detach())
                        loss_info["ratio"].append(ratio.detach())
                        loss_info["policy_loss"].append(policy_loss.detach())
                        loss_info["loss"].append(loss.detach())
                        loss_info["clip_frac_high"].append(torch.mean((ratio > 1.0 + args.clip_range[1]).float()))
                        run.seen.append((output.log_prob.detach(), ratio.detach(), loss.detach()))
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(adapter.get_trainable_parameters(),
                                                                    args.max_grad_norm)
                            optimizer.step()
                            optimizer.zero_grad()
                            loss_info = {k: torch.stack(v).mean() for k, v in loss_info.items()}
                            loss_info = accelerator.reduce(loss_info, reduction="mean")
                            logged.append(dict(loss_info, grad_norm=_local(grad_norm)))
                            loss_info = defaultdict(list)
    run.epoch += 1
    return logged


def _local(x):
    """A logged value as a plain tensor (FSDP2's clip returns the norm as a replicated DTensor)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else torch.as_tensor(x)


def reference_loss(run: FlowFactoryRun, batch: dict, transformer) -> torch.Tensor:
    """One batch's loss over its trained steps as a whole, in σ order (the sampler's, so that a
    reference JAGG cuts the windows jaggc cuts), each step's loss divided as ``accelerator.backward``
    divides it, under the loop's autocast, on ``transformer`` (an unwrapped copy: its output cast to
    float32 as accelerate's prepared forward casts it). The KL term is computed under the loop's
    ``torch.no_grad()`` block, as Flow-Factory computes it, so it adds no gradient (module docstring)."""
    args = run.training_args

    def fp32_outputs(**kwargs):
        return (transformer(**kwargs)[0].float(),)

    adapter = SD3Adapter(fp32_outputs, run.adapter.scheduler, lora=True, unwrap=lambda m: m)
    total = 0.0
    T = batch["timesteps"].shape[1]
    with run.autocast():
        for timestep_index in sorted(run.adapter.scheduler.train_timesteps):
            t = batch["timesteps"][:, timestep_index]
            t_next = batch["timesteps"][:, timestep_index + 1] if timestep_index + 1 < T else torch.tensor(0.0)
            inputs = _forward_inputs(batch, t, t_next, batch["all_latents"][:, timestep_index],
                                     batch["all_latents"][:, timestep_index + 1], args)
            output = adapter.forward(**inputs)
            ratio = torch.exp(output.log_prob - batch["log_probs"][:, timestep_index])
            adv = torch.clamp(batch["advantage"], args.adv_clip_range[0], args.adv_clip_range[1])
            total = total + torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(
                ratio, 1.0 + args.clip_range[0], 1.0 + args.clip_range[1])))
    return total / run.accelerator.gradient_accumulation_steps


__all__ = ["FlowFactoryRun", "FlowSDEScheduler", "SD3Adapter", "TrainingArguments", "deepspeed_zero2_accelerator", "fsdp1_wrap",
           "fsdp2_wrap", "reference_loss", "setup", "stack", "train_jaggc", "train_unchanged"]
