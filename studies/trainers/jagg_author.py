"""The JAGG author's Qwen-Image trainer (SchumiDing/eff_grpo ``train_grpo_qwenimage_jagg.py``):
DanceGRPO's ``flux_step`` on a Qwen-Image DiT, and ``author_two_backward``, the author's JAGG as
published ((W+6)F per window), the baseline jaggc is measured against."""

from __future__ import annotations

from dataclasses import replace

import torch

from jaggc import models

from .common import GRPOConfig, TrainerShape, off_policy_step
from .dance_grpo import clipped_loss, flux_step, one_step, sd3_time_shift


def author_one_step(args, latents, pre_latents, encoder_hidden_states, prompt_attention_masks, img_shapes,
                    transformer, timesteps, i, sigma_schedule):
    """The JAGG author's ``grpo_one_step`` on Qwen-Image (diffusers 0.42 has no ``txt_seq_lens``)."""
    return one_step(args, transformer, latents, pre_latents, i, sigma_schedule, timestep=timesteps / 1000,
                    guidance=None, encoder_hidden_states_mask=prompt_attention_masks,
                    encoder_hidden_states=encoder_hidden_states, img_shapes=img_shapes, attention_kwargs=None)


def author_qwen_loss(transformer, sample, sigma_indices, sigma_schedule, args):
    """The author's per-step loss over the trained steps (``sigma_indices``: Python ints)."""
    total = 0.0
    n = len(sigma_indices)
    for j in range(n):
        log_prob = author_one_step(args, sample["latents"][:, j], sample["next_latents"][:, j],
                                   sample["encoder_hidden_states"], sample["prompt_attention_masks"],
                                   sample["img_shapes"], transformer, sample["timesteps"][:, j], sigma_indices[j],
                                   sigma_schedule)
        total = total + clipped_loss(log_prob, sample["log_probs"][:, j], sample["advantages"], args,
                                     args.gradient_accumulation_steps * n)
    return total


def author_two_backward(transformer, sample, sigma_indices, sigma_schedule, args, *, window: int = 4,
                        weights: str = "index") -> float:
    """The author's JAGG as published, run on every window of ``window`` consecutive trained steps:
    per window W no-grad forwards, each step's upstream gradient through ``flux_step`` + PPO-clip on
    a detached copy of its output, knot weights j/(W-1) (``weights="t"``: by timestep, the
    reference JAGG), then a forward with grad and a ``backward(gradient=...)`` at each end. Returns
    the loss value; the gradient is accumulated into ``.grad``. Cost: (W+6)F per window."""
    n = len(sigma_indices)
    loss_value = 0.0
    norm = args.gradient_accumulation_steps * n

    def call(j, grad):
        with torch.set_grad_enabled(grad):
            transformer.train()
            return transformer(hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j] / 1000,
                               guidance=None, encoder_hidden_states_mask=sample["prompt_attention_masks"],
                               encoder_hidden_states=sample["encoder_hidden_states"], img_shapes=sample["img_shapes"],
                               attention_kwargs=None, return_dict=False)[0]

    for start in range(0, n, window):
        steps = list(range(start, min(start + window, n)))
        upstream = []
        for j in steps:
            pred = call(j, grad=False).detach().to(torch.float32).requires_grad_(True)
            _, _, log_prob = flux_step(pred, sample["latents"][:, j].to(torch.float32), args.eta, sigma_schedule,
                                       sigma_indices[j], prev_sample=sample["next_latents"][:, j].to(torch.float32),
                                       grpo=True, sde_solver=True)
            loss_j = clipped_loss(log_prob, sample["log_probs"][:, j], sample["advantages"], args, norm)
            (g,) = torch.autograd.grad(loss_j, pred)
            upstream.append(g)
            loss_value += float(loss_j)
        if len(steps) == 1:
            call(steps[0], grad=True).backward(gradient=upstream[0])
            continue
        if weights == "index":
            alpha = [k / (len(steps) - 1) for k in range(len(steps))]
        else:
            ts = [float(sample["timesteps"][0, j]) for j in steps]
            alpha = [(t - ts[0]) / (ts[-1] - ts[0]) for t in ts]
        g_first = sum((1 - a) * g for a, g in zip(alpha, upstream))
        g_last = sum(a * g for a, g in zip(alpha, upstream))
        call(steps[0], grad=True).backward(gradient=g_first)
        call(steps[-1], grad=True).backward(gradient=g_last)
    return loss_value


def jagg_author_qwen(*, num_steps: int = 8, batch: int = 1, seed: int = 0, size: str = "tiny") -> TrainerShape:
    """A small Qwen-Image DiT (diffusers ``QwenImageTransformer2DModel``, ``models.QWEN_CONFIGS``),
    packed latents, a linspace + shift-3 schedule, all steps trained (the author's windows tile them)."""
    transformer = models.qwen_image(size, seed=seed)
    config = models.QWEN_CONFIGS[size]
    args = replace(GRPOConfig(), clip_range=0.1)     # the author's runs
    h = w = models.QWEN_LATENT_SIDE[size]
    g = torch.Generator().manual_seed(seed + 1)
    text = torch.randn(batch, 5, config["joint_attention_dim"], generator=g)
    mask = torch.ones(batch, 5, dtype=torch.long)
    img_shapes = [[(1, h, w)]]
    sigma_schedule = sd3_time_shift(3.0, torch.linspace(1, 0, num_steps + 1))
    torch.manual_seed(seed + 1)
    z = torch.randn(batch, h * w, config["in_channels"], generator=g)
    lat, nxt, lps, ts = [], [], [], []
    transformer.eval()
    with torch.no_grad():
        for i in range(num_steps):
            t = torch.full([batch], int(sigma_schedule[i] * 1000), dtype=torch.long)
            pred = transformer(hidden_states=z, timestep=t / 1000, guidance=None, encoder_hidden_states_mask=mask,
                               encoder_hidden_states=text, img_shapes=img_shapes, return_dict=False)[0]
            prev, _, log_prob = flux_step(pred, z, args.eta, sigma_schedule, i, None, True, True)
            lat.append(z)
            nxt.append(prev)
            lps.append(log_prob)
            ts.append(t)
            z = prev
    sample = dict(latents=torch.stack(lat, 1), next_latents=torch.stack(nxt, 1), log_probs=torch.stack(lps, 1),
                  timesteps=torch.stack(ts, 1), advantages=torch.linspace(-0.9, 0.9, batch) if batch > 1 else torch.tensor([0.7]),
                  encoder_hidden_states=text, prompt_attention_masks=mask, img_shapes=img_shapes)
    off_policy_step(transformer, seed, lambda name: True)
    return TrainerShape("jagg_author_qwen", author_qwen_loss, transformer,
                        (transformer, sample, list(range(num_steps)), sigma_schedule, args),
                        "the JAGG author's Qwen-Image trainer: flux_step on a sigma-schedule tensor with int step "
                        "indices, transformer.train() in the step, timestep / 1000, a text mask and img_shapes")
