"""verl-omni's FSDP diffusion engine loop (``DiffusersFSDPEngine._run_forward_backward_batch``), unchanged and with jaggc.

Read from verl-project/verl-omni (``verl_omni/workers/engine/fsdp/diffusers_impl.py``), not copied.
The batch is cut into micro-batches; ``gradient_accumulation_steps = len(micro_batches) *
num_timesteps``; for each micro-batch, under ``torch.no_grad()`` when ``forward_only`` (the old-log-prob
pass) and as is otherwise, ``for step in range(num_timesteps)``: ``forward_step`` (the DiT on the
step's latents at each row's own timestep ``all_timesteps[:, step]``, the SDE step's log-prob and
mean, the loss function: FlowGRPO's PPO clip divided by the accumulation steps), ``loss.backward()``
unless ``forward_only``, and the step's ``meta_info`` (its ``model_output``: the log-prob and the
sample mean, still attached to the graph) appended to a list kept until the batch ends. The optimizer
step is the caller's, after the batch (``train_batch`` here: zero_grad, the loop, clip, step).

Each row trains its own window of SDE steps (``all_timesteps`` per row: MixGRPO's per-sample SDE
window), so a micro-batch's rows call the DiT at different timesteps in one call. The rollout runs
in a separate engine in verl-omni (vLLM-Omni): nothing of it passes through the trained module; the
stored trajectories here are sampled by the same DiT without grad beforehand.

``train_unchanged`` is that loop; ``train_jaggc`` the same with the user's change (the ``for step``
line; ``jaggc.stepwise(transformer, window=4)`` after the FSDP2 wrap is the other).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import jaggc
from jaggc import models
from jaggc_studies.loops.flow_factory import FlowSDEScheduler, fsdp2_wrap
from jaggc_studies.trainers.common import off_policy_step


@dataclass
class Engine:
    """What ``_run_forward_backward_batch`` reads from the engine: the module (FSDP2-wrapped on
    ranks), the scheduler, the micro-batch size, the optimizer and the clip."""

    module: Any
    scheduler: FlowSDEScheduler
    optimizer: Any
    micro_batch_size: int = 2
    clip_ratio: float = 1e-4
    max_grad_norm: float = 1.0
    outputs: list = field(default_factory=list)       # each batch's output_lst, kept for checks

    def forward_step(self, micro_batch: dict, loss_function: Callable | None, forward_only: bool, step: int):
        t = micro_batch["all_timesteps"][:, step]
        t_next = micro_batch["all_next_timesteps"][:, step]
        latents, next_latents = micro_batch["all_latents"][:, step], micro_batch["all_latents"][:, step + 1]
        noise_pred = self.module(hidden_states=latents, timestep=t, encoder_hidden_states=micro_batch["prompt_embeds"],
                                 pooled_projections=micro_batch["pooled_prompt_embeds"], return_dict=False)[0]
        _, log_prob, prev_sample_mean = self.scheduler.step(noise_pred, t, t_next, latents, next_latents)
        model_output = {"log_probs": log_prob, "prev_sample_mean": prev_sample_mean}
        if loss_function is not None:
            data = {"old_log_probs": micro_batch["old_log_probs"][:, step],
                    "advantages": micro_batch["advantages"][:, step],
                    "gradient_accumulation_steps": micro_batch["gradient_accumulation_steps"]}
            loss, metrics = loss_function(model_output=model_output, data=data, clip_ratio=self.clip_ratio)
        else:
            loss, metrics = torch.tensor(1.0), {}
        return loss, {"model_output": model_output, "loss": loss.detach().item(), "metrics": metrics}


def flow_grpo_loss(model_output: dict, data: dict, clip_ratio: float):
    """FlowGRPO's ``diffusion_loss``: the PPO clip on exp(log_prob - old), its mean divided by the
    accumulation steps; the clip fraction as a metric."""
    ratio = torch.exp(model_output["log_probs"] - data["old_log_probs"])
    adv = data["advantages"]
    loss = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)))
    clipfrac = torch.mean((torch.abs(ratio - 1.0) > clip_ratio).float()).item()
    return loss / data["gradient_accumulation_steps"], {"pg_clipfrac": clipfrac}


def micro_batches(data: dict, size: int) -> list[dict]:
    n = data["all_latents"].shape[0]
    return [{k: v[i:i + size] for k, v in data.items()} for i in range(0, n, size)]


def train_unchanged(self: Engine, data: dict, loss_function: Callable | None, forward_only: bool) -> list:
    """``_run_forward_backward_batch``: every micro-batch's steps, ``backward()`` after each."""
    num_timesteps = int(data["all_timesteps"].shape[1])
    mbs = micro_batches(data, self.micro_batch_size)
    gradient_accumulation_steps = len(mbs) * num_timesteps
    output_lst = []
    ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    for micro_batch in mbs:
        micro_batch = dict(micro_batch, gradient_accumulation_steps=gradient_accumulation_steps)
        meta_info_lst = {"model_output": [], "loss": [], "metrics": []}
        with ctx:
            for step in range(num_timesteps):
                loss, meta_info = self.forward_step(micro_batch, loss_function=loss_function,
                                                    forward_only=forward_only, step=step)
                if not forward_only:
                    loss.backward()
                for key, val in meta_info.items():
                    meta_info_lst[key].append(val)
        output_lst.append(meta_info_lst)
    return output_lst


def train_jaggc(self: Engine, data: dict, loss_function: Callable | None, forward_only: bool) -> list:
    """``train_unchanged`` with jaggc: the ``for step`` line declares the micro-batch's steps."""
    num_timesteps = int(data["all_timesteps"].shape[1])
    mbs = micro_batches(data, self.micro_batch_size)
    gradient_accumulation_steps = len(mbs) * num_timesteps
    output_lst = []
    ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    for micro_batch in mbs:
        micro_batch = dict(micro_batch, gradient_accumulation_steps=gradient_accumulation_steps)
        meta_info_lst = {"model_output": [], "loss": [], "metrics": []}
        with ctx:
            for step in jaggc.stepwise(self.module).steps(range(num_timesteps), micro_batch["all_timesteps"]):
                loss, meta_info = self.forward_step(micro_batch, loss_function=loss_function,
                                                    forward_only=forward_only, step=step)
                if not forward_only:
                    loss.backward()
                for key, val in meta_info.items():
                    meta_info_lst[key].append(val)
        output_lst.append(meta_info_lst)
    return output_lst


def train_batch(engine: Engine, data: dict, loop: Callable) -> dict:
    """The actor's update on one batch: the old-log-prob pass through the same loop (``forward_only``,
    no grad), then zero_grad, the training pass, the clip and the optimizer step. The outputs stay
    in ``engine.outputs`` (attached, as the engine's ``meta_info`` keeps them until the batch ends)."""
    old = loop(engine, data, None, True)
    old_log_probs = torch.cat([torch.stack([o["log_probs"] for o in m["model_output"]], 1) for m in old])
    data = dict(data, old_log_probs=old_log_probs)
    engine.optimizer.zero_grad()
    outputs = loop(engine, data, flow_grpo_loss, False)
    engine.outputs.append(outputs)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in engine.module.parameters() if p.requires_grad],
                                               engine.max_grad_norm)
    engine.optimizer.step()
    return {"loss": [x for m in outputs for x in m["loss"]], "grad_norm": grad_norm, "old_log_probs": data["old_log_probs"]}


def setup(*, num_inference_steps: int = 10, num_timesteps: int = 4, batch: int = 4, micro_batch_size: int = 2,
          shard: tuple[int, int] = (0, 1), seed: int = 0, fsdp2: bool = False, lr: float = 1e-3,
          max_grad_norm: float = 1.0, stepwise: dict | None = None, size: str = "tiny") -> tuple[Engine, dict]:
    """(the engine, this rank's batch): a tiny SD3 trained in full (verl-omni trains in float32), a
    rollout of ``batch * world`` samples with each row's window of ``num_timesteps`` SDE steps at its
    own offset; ``fsdp2``: ``fully_shard`` per block and the root, as verl's ``apply_fsdp2``."""
    rank, world = shard
    transformer = models.sd3(size, seed=seed)
    scheduler = FlowSDEScheduler(num_inference_steps, list(range(num_inference_steps)), num_inference_steps)
    data = _rollout(transformer, scheduler, batch * world, num_timesteps, seed)
    data = {k: v[rank::world] for k, v in data.items()}
    off_policy_step(transformer, seed, lambda name: True)
    if fsdp2:
        transformer = fsdp2_wrap(transformer)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr)
    if stepwise is not None:
        jaggc.stepwise(transformer, **stepwise)
    return Engine(transformer, scheduler, optimizer, micro_batch_size, max_grad_norm=max_grad_norm), data


def _rollout(transformer, scheduler: FlowSDEScheduler, n: int, num_timesteps: int, seed: int) -> dict:
    """``n`` stored trajectories (no grad); row i's SDE window starts at step i % (T - num_timesteps)."""
    g = torch.Generator().manual_seed(seed + 3)
    cfg = transformer.config
    prompts = torch.randn(n, 5, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(n, cfg.pooled_projection_dim, generator=g)
    z = torch.randn(models.sd3_latent_shape(transformer, n), generator=g)
    T = len(scheduler.timesteps)
    times = torch.cat([scheduler.timesteps, torch.zeros(1)])
    lat = [z]
    with torch.no_grad():
        for i in range(T):
            t, t_next = times[i].expand(n), times[i + 1].expand(n)
            v = transformer(hidden_states=z, timestep=t, encoder_hidden_states=prompts, pooled_projections=pooled,
                            return_dict=False)[0]
            z, _, _ = scheduler.step(v, t, t_next, z, generator=g)
            lat.append(z)
    all_latents = torch.stack(lat, 1)
    starts = torch.arange(n) % (T - num_timesteps)
    window = starts[:, None] + torch.arange(num_timesteps)
    rows = torch.arange(n)[:, None]
    rewards = -(z ** 2).mean(dim=(1, 2, 3))
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-4))[:, None].expand(n, num_timesteps).contiguous()
    return dict(all_latents=all_latents[rows, torch.cat([window, window[:, -1:] + 1], 1)],
                all_timesteps=times[window], all_next_timesteps=times[window + 1], advantages=adv,
                prompt_embeds=prompts, pooled_prompt_embeds=pooled)


def reference_loss(engine: Engine, data: dict, transformer) -> torch.Tensor:
    """The training pass's loss as a whole (every micro-batch's steps, in σ order per row: each row's
    window is visited high noise first), on an unwrapped ``transformer``: what a reference JAGG of
    the batch takes."""
    plain = Engine(transformer, engine.scheduler, None, engine.micro_batch_size)
    num_timesteps = int(data["all_timesteps"].shape[1])
    mbs = micro_batches(data, engine.micro_batch_size)
    total = 0.0
    for micro_batch in mbs:
        micro_batch = dict(micro_batch, gradient_accumulation_steps=len(mbs) * num_timesteps)
        for step in range(num_timesteps):
            total = total + plain.forward_step(micro_batch, flow_grpo_loss, False, step)[0]
    return total


__all__ = ["Engine", "flow_grpo_loss", "micro_batches", "reference_loss", "setup", "train_batch", "train_jaggc",
           "train_unchanged"]


def saved_activations(stepwise: dict | None, **kwargs) -> dict:
    """Saved activations (bytes, ``track_saved_tensors``) of one training pass: the peak, and what is
    still alive when the pass returns while its ``meta_info`` outputs are kept (attached), and after
    they are dropped. ``stepwise`` None: the unchanged loop."""
    import gc

    from jaggc.runtime.memory import track_saved_tensors

    engine, data = setup(stepwise=stepwise, **kwargs)
    loop = train_unchanged if stepwise is None else train_jaggc
    old = loop(engine, data, None, True)
    data = dict(data, old_log_probs=torch.cat([torch.stack([o["log_probs"] for o in m["model_output"]], 1)
                                               for m in old]))
    with track_saved_tensors() as stats:
        outputs = loop(engine, data, flow_grpo_loss, False)
        gc.collect()
        kept = stats.live_bytes
        del outputs
        gc.collect()
        dropped = stats.live_bytes
    if stepwise is not None:
        jaggc.stepwise(engine.module).close()
    return dict(peak=stats.peak_bytes, kept=kept, dropped=dropped)
