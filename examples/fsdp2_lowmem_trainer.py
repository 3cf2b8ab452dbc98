"""DanceGRPO-style training of a Flux transformer, sharded with FSDP2, with JAGG's low-memory mode.

    torchrun --nproc-per-node 2 examples/fsdp2_lowmem_trainer.py            # 2 CPU processes (gloo)
    torchrun --nproc-per-node 8 examples/fsdp2_lowmem_trainer.py --size 10m  # 8 GPUs: NCCL, unchanged

The multi-GPU recipe for a DiT that only fits sharded (docs/distributed.md): each transformer block
checkpointed (non-reentrant) and ``fully_shard``-ed, then the root; the GRPO loss, written as the
trainers write it (one DiT call per trained step, flux_step log-prob, PPO clip), compiled with
``jagg_compile(window=W, backward="lowmem")``. Each window's joint backward then runs inside the
loss's forward, through FSDP2's hooks (parameters gathered, blocks recomputed, gradient
reduce-scattered into a buffer of the rank's shard), so a rank holds one window's activations, as
the per-step loop does, at the joint mode's (W+4) forwards per W steps; ``loss.backward()`` adds
the buffer to the sharded ``.grad``. Gradient accumulation over micro-batches uses FSDP2's
``set_requires_gradient_sync(False)`` on all but the last micro-batch, as FSDP2 recommends; the
low-memory mode keeps it (no reduce-scatter in those micro-steps).

Per iteration (DanceGRPO's fastvideo/train_grpo_flux.py at toy size):
  1. rollout, no grad: every rank samples ``--prompts`` prompts x ``--group`` latents with
     DanceGRPO's SDE step (``jaggc.grpo.dance_flux_step``, eta 0.3, shift-3 schedule);
  2. reward: a latent statistic (no VAE or reward model offline); advantages per group of
     ``--group`` (DanceGRPO's normalisation), rewards gathered over ranks for the log;
  3. training: one pass over the rollout in micro-batches, every trained step, accumulated into
     one optimizer step (grad-norm clipping, AdamW);
  4. logs: reward, clip fraction, DiT backwards (JAGG vs the per-step loop), this rank's lowmem
     buffer. ``--check-gradient`` compares, on the first micro-batch, the sharded lowmem gradient
     with the joint mode's (same windows, all activations kept) and prints their relative error.

On CUDA each rank uses ``cuda:LOCAL_RANK`` and NCCL; nothing else changes. A real run would add
mixed precision (FSDP2's ``MixedPrecisionPolicy``) and the trainer's own model, text encoders,
VAE and reward; every number here is from a random-init toy DiT (it shows the machinery runs).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
import warnings

import torch
import torch.distributed as dist

import jaggc
from jaggc import grpo, models
from jaggc.runtime import count_dit_passes

ETA = 0.3                 # DanceGRPO's eta
CLIP_RANGE = 1e-4         # DanceGRPO's clip_range
ADV_CLIP_MAX = 5.0
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))
GRID = {"tiny": 4, "10m": 16}       # latent tokens per side


# --------------------------------------------------------------------------------- the loss


def flux_log_prob(model_output, latents, sigma, sigma_next, prev_sample):
    """DanceGRPO's flux_step(grpo=True, sde_solver=True) log-probability of a stored transition."""
    shape = (-1,) + (1,) * (latents.ndim - 1)
    sigma, sigma_next = sigma.view(shape), sigma_next.view(shape)
    dsigma = sigma_next - sigma
    pred_original_sample = latents - sigma * model_output
    std_dev_t = ETA * torch.sqrt(sigma - sigma_next)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
    prev_sample_mean = latents + dsigma * model_output - 0.5 * ETA**2 * score_estimate * dsigma
    log_prob = (-((prev_sample.float() - prev_sample_mean.float()) ** 2) / (2 * std_dev_t**2)
                - torch.log(std_dev_t) - LOG_SQRT_2PI)
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def grpo_loss(transformer, batch):
    """Sum over the trained steps of DanceGRPO's per-step loss (PPO clip / number of steps)."""
    num_steps = batch["timesteps"].shape[1]
    total = 0.0
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        pred = transformer(hidden_states=latents, encoder_hidden_states=batch["encoder_hidden_states"],
                           timestep=batch["timesteps"][:, j] / 1000, pooled_projections=batch["pooled_prompt_embeds"],
                           txt_ids=batch["text_ids"], img_ids=batch["image_ids"], joint_attention_kwargs=None,
                           return_dict=False)[0]
        log_prob = flux_log_prob(pred, latents.float(), batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                 batch["next_latents"][:, j])
        advantages = torch.clamp(batch["advantages"][:, j], -ADV_CLIP_MAX, ADV_CLIP_MAX)
        ratio = torch.exp(log_prob - batch["log_probs"][:, j])
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1.0 - CLIP_RANGE, 1.0 + CLIP_RANGE)
        total = total + torch.mean(torch.maximum(unclipped, clipped)) / num_steps
    return total


# --------------------------------------------------------------------------------- set-up


def build_sharded_dit(size: str, seed: int, device: torch.device, checkpointing: bool):
    """A Flux transformer: blocks checkpointed, then fully_shard per block, then the root."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
    from torch.distributed.fsdp import fully_shard

    dit = models.flux(size, seed=seed).to(device)
    if checkpointing:
        # what DanceGRPO's apply_fsdp_checkpointing uses (torch has no public name for it)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

        apply_activation_checkpointing(
            dit, check_fn=lambda m: isinstance(m, (FluxTransformerBlock, FluxSingleTransformerBlock)),
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    for block in [*dit.transformer_blocks, *dit.single_transformer_blocks]:
        fully_shard(block)
    fully_shard(dit)
    dit.train()
    return dit


def prompt_bank(size: str, num: int, seed: int, device) -> dict:
    cfg = models.FLUX_CONFIGS[size]
    g = torch.Generator().manual_seed(seed)
    grid = GRID[size]
    image_ids = torch.zeros(grid, grid, 3)
    image_ids[..., 1] = torch.arange(grid)[:, None]
    image_ids[..., 2] = torch.arange(grid)[None, :]
    return dict(embeds=torch.randn(num, 7, cfg["joint_attention_dim"], generator=g).to(device),
                pooled=torch.randn(num, cfg["pooled_projection_dim"], generator=g).to(device),
                text_ids=torch.zeros(7, 3, device=device), image_ids=image_ids.reshape(grid * grid, 3).to(device))


@torch.no_grad()
def rollout(dit, bank: dict, prompt_ids: torch.Tensor, num_steps: int, size: str, seed: int) -> dict:
    """DanceGRPO's SDE rollout of num_steps + 1 steps; the last (tiny-sigma) step is not trained."""
    device = bank["embeds"].device
    sigmas = grpo.flow_match_sigmas(num_steps + 1).float().to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    b = len(prompt_ids)
    cond = dict(encoder_hidden_states=bank["embeds"][prompt_ids], pooled_projections=bank["pooled"][prompt_ids],
                txt_ids=bank["text_ids"], img_ids=bank["image_ids"])
    z = torch.randn(b, GRID[size] ** 2, models.FLUX_CONFIGS[size]["in_channels"], generator=g, device=device)
    lat, nxt, lps, sig, sig_next = [], [], [], [], []
    for k in range(num_steps + 1):
        s, sn = sigmas[k].expand(b).contiguous(), sigmas[k + 1].expand(b).contiguous()
        v = dit(hidden_states=z, timestep=s, return_dict=False, **cond)[0]
        step = grpo.dance_flux_step(v, z, s, sn, eta=ETA, generator=g)
        lat.append(z), nxt.append(step.prev_sample), lps.append(step.log_prob), sig.append(s), sig_next.append(sn)
        z = step.prev_sample
    keep = slice(0, num_steps)
    sigma = torch.stack(sig, 1)[:, keep].contiguous()
    return dict(latents=torch.stack(lat, 1)[:, keep].contiguous(), next_latents=torch.stack(nxt, 1)[:, keep].contiguous(),
                timesteps=(sigma * 1000).contiguous(), sigmas=sigma,
                sigmas_next=torch.stack(sig_next, 1)[:, keep].contiguous(),
                log_probs=torch.stack(lps, 1)[:, keep].contiguous(),
                encoder_hidden_states=cond["encoder_hidden_states"], pooled_prompt_embeds=cond["pooled_projections"],
                text_ids=bank["text_ids"], image_ids=bank["image_ids"], final=z)


def reward_fn(final_latents: torch.Tensor) -> torch.Tensor:
    """Negative mean square of the final latent (a black-box score: no gradient needed)."""
    return -(final_latents.float() ** 2).mean(dim=tuple(range(1, final_latents.ndim)))


PER_SAMPLE = ("latents", "next_latents", "timesteps", "sigmas", "sigmas_next", "log_probs", "advantages",
              "encoder_hidden_states", "pooled_prompt_embeds")


def micro_batches(data: dict, size: int) -> list[dict]:
    n = data["latents"].shape[0]
    return [{k: v[lo:lo + size] if k in PER_SAMPLE else v for k, v in data.items() if k != "final"}
            for lo in range(0, n, size)]


def gathered_gradient(dit) -> torch.Tensor:
    return torch.cat([p.grad.full_tensor().reshape(-1) for p in dit.parameters() if p.grad is not None])


def check_gradient(dit, lowmem, mb) -> float:
    """Relative error of the sharded lowmem gradient against the joint mode's on one micro-batch
    (both through FSDP2; .grad is left cleared)."""
    joint = jaggc.jagg_compile(grpo_loss, dit=dit, window=lowmem.config.window, weights=lowmem.config.options.weights)
    grads = []
    for fn in (lowmem, joint):
        for p in dit.parameters():
            p.grad = None
        fn(dit, mb).backward()
        grads.append(gathered_gradient(dit).double())
    for p in dit.parameters():
        p.grad = None
    return float((grads[0] - grads[1]).norm() / grads[1].norm())


# --------------------------------------------------------------------------------- main


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=tuple(GRID), default="tiny")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8, help="trained SDE steps per trajectory")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per rank and iteration")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--check-gradient", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # FSDP2 warns about view outputs of diffusers' blocks; nothing here writes to them in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    log = print if rank == 0 else (lambda *a, **k: None)

    dit = build_sharded_dit(args.size, args.seed, device, checkpointing=not args.no_checkpointing)
    optimizer = torch.optim.AdamW(dit.parameters(), lr=args.lr, weight_decay=0.0)
    bank = prompt_bank(args.size, 64, args.seed, device)
    # plain JAGG (t-weights) in every window; the README explains the σ-aware default
    loss_fn = jaggc.jagg_compile(grpo_loss, dit=dit, window=args.window, weights="t", backward="lowmem")
    log(f"ranks={world} ({'nccl' if cuda else 'gloo'}) size={args.size} "
        f"params={sum(p.numel() for p in dit.parameters())} samples/rank={args.prompts * args.group} "
        f"micro-batch={args.micro_batch} steps={args.steps} window={args.window} backward=lowmem "
        f"checkpointing={not args.no_checkpointing}")
    history = []
    for it in range(args.iterations):
        t0 = time.perf_counter()
        prompt_ids = torch.tensor([(it * world + rank) * args.prompts + i for i in range(args.prompts)
                                   for _ in range(args.group)], device=device) % len(bank["embeds"])
        data = rollout(dit, bank, prompt_ids, args.steps, args.size, seed=args.seed * 1000 + it * world + rank)
        rewards = reward_fn(data["final"])
        data["advantages"] = grpo.dance_grpo_advantages(rewards, args.group).float()[:, None].expand(
            -1, args.steps).contiguous()
        all_rewards = [torch.empty_like(rewards) for _ in range(world)]
        dist.all_gather(all_rewards, rewards)
        all_rewards = torch.cat(all_rewards)
        mbs = micro_batches(data, args.micro_batch)
        if args.check_gradient and it == 0:
            log(f"check: lowmem vs joint gradient rel. err {check_gradient(dit, loss_fn, mbs[0]):.2e}")
        backwards, clipped = 0, []
        optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(mbs):
            dit.set_requires_gradient_sync(i == len(mbs) - 1)    # reduce-scatter on the last micro-batch only
            with count_dit_passes(dit) as passes:
                (loss_fn(dit, mb) / len(mbs)).backward()
            backwards += passes.backwards
        grad_norm = float(torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0))
        optimizer.step()
        row = dict(iteration=it, reward_mean=float(all_rewards.mean()), reward_std=float(all_rewards.std()),
                   dit_backwards=backwards, exact_backwards=args.steps * len(mbs), grad_norm=grad_norm,
                   buffer_bytes=loss_fn.report.lowmem_buffer_bytes, seconds=time.perf_counter() - t0)
        history.append(row)
        log(f"it {it:3d} reward {row['reward_mean']:+.4f}±{row['reward_std']:.4f} grad_norm {grad_norm:.3g} "
            f"DiT backwards {backwards} (per-step loop: {row['exact_backwards']}) "
            f"lowmem buffer {row['buffer_bytes']} B/rank {row['seconds']:.1f}s")
    log(f"capture path: {loss_fn.report.path}; windows per loss: {len(loss_fn.report.windows)}")
    dist.destroy_process_group()
    return history


if __name__ == "__main__":
    main()
