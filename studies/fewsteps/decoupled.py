"""The two decoupled trainers users pick instead of per-step GRPO: DiffusionNFT and Advantage Weighted
Matching, in the shape of their papers and of Flow-Factory's ``nft`` / ``awm`` trainers (read, not copied):

- the rollout samples by the ODE and keeps only the final images x0 (no SDE, no log-probabilities,
  no CFG); rewards and group advantages as GRPO's;
- per minibatch, each sample draws ``k`` training timesteps from the sampler's grid (the trained
  steps 0..T-2, Flow-Factory's ``discrete`` time sampling within ``timestep_range``), is noised by the
  forward process ``x_t = (1 - s) x0 + s eps`` (target velocity ``eps - x0``), and the sampling
  policy's velocity there is computed without grad (the "old" pass: on-policy, the current
  parameters, as Flow-Factory with ``off_policy: false``); then per timestep a forward with grad,
  the loss, ``(loss / k).backward()``; clip and AdamW step after the ``k`` timesteps.

DiffusionNFT (arXiv 2509.16117): ``r = clamp(A / A_max / 2 + 1/2, 0, 1)`` with the advantage clipped to
``[-A_max, A_max]``; the implicit positive velocity ``beta v + (1 - beta) v_old`` and negative
``(1 + beta) v_old - beta v``; each projected to x0 (``x_t - s v``) and scored by its squared error to
x0 divided by its own detached mean absolute error; loss ``A_max (r pos + (1 - r) neg) / beta``, mean.

AWM (arXiv 2509.25050): the matching "log-prob" ``-mean((v - (eps - x0))^2)`` (uniform weighting), the
PPO ratio ``exp(logp - logp_old)`` clipped to ``1 +- clip`` (1e-4), loss ``mean(max(-A ratio, -A clip))``.
"""

from __future__ import annotations

import torch

NFT_BETA = 1.0          # Flow-Factory's nft_beta default
ADV_CLIP = 5.0          # adv_clip_range (-5, 5)
AWM_CLIP = 1e-4         # AWM's ratio clip_range (-1e-4, 1e-4)


def forward_noise(x0: torch.Tensor, sigma: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward process at per-sample ``sigma`` (B,): (x_t, the target velocity eps - x0)."""
    eps = torch.randn(x0.shape, generator=generator)
    s = sigma.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * eps, eps - x0


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor,
             advantages: torch.Tensor, beta: float = NFT_BETA, adv_clip: float = ADV_CLIP) -> torch.Tensor:
    """DiffusionNFT's loss (module docstring) of one timestep, mean over the batch."""
    s = sigma.view(-1, *([1] * (x0.ndim - 1)))
    r = torch.clamp(torch.clamp(advantages, -adv_clip, adv_clip) / adv_clip / 2 + 0.5, 0, 1)
    v_old = v_old.detach()

    def matched(velocity):
        x0_pred = x_t - s * velocity
        with torch.no_grad():
            scale = _per_sample_mean((x0_pred.double() - x0.double()).abs()).clamp(min=1e-5)
        return _per_sample_mean((x0_pred - x0) ** 2) / scale.to(x0.dtype)

    positive = matched(beta * v + (1 - beta) * v_old)
    negative = matched((1 + beta) * v_old - beta * v)
    return (adv_clip * (r * positive + (1 - r) * negative) / beta).mean()


def matching_log_prob(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """AWM's per-sample matching log-prob: -mean((v - target)^2) (uniform weighting), in double."""
    return -_per_sample_mean((v.double() - target.double()) ** 2)


def awm_loss(v: torch.Tensor, old_log_prob: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
             clip: float = AWM_CLIP, adv_clip: float = ADV_CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """AWM's PPO-clipped loss of one timestep (mean over the batch) and the new log-prob (detached)."""
    log_prob = matching_log_prob(v, target).float()
    adv = torch.clamp(advantages, -adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob)
    loss = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)))
    return loss, log_prob.detach()


def draw_timesteps(batch_size: int, k: int, trained: int, generator: torch.Generator) -> torch.Tensor:
    """(k, B) grid-step indices: each sample's ``k`` distinct steps of 0..trained-1."""
    return torch.stack([torch.randperm(trained, generator=generator)[:k] for _ in range(batch_size)], 1)


def decoupled_backward(dit, batch: dict, kind: str, k: int, generator: torch.Generator,
                       backward=None) -> dict:
    """One minibatch of ``kind`` ("nft" / "awm"): ``k`` timesteps per sample, one old (no-grad) and
    one new forward and one ``backward()`` per timestep. ``backward(loss)``: how to run it (a
    timer's; default ``loss.backward()``). Returns the loss and the AWM ratio's clip fraction."""
    x0 = batch["images"]
    bsz = x0.shape[0]
    trained = batch["sigmas"].shape[1] - 1          # the grid's steps but the sigma -> 0 one
    steps = draw_timesteps(bsz, k, trained, generator)
    cond = dict(encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"])
    rows = torch.arange(bsz)
    total, clipped = 0.0, []
    for slot in range(k):
        sigma = batch["sigmas"][rows, steps[slot]]
        x_t, target = forward_noise(x0, sigma, generator)
        timestep = 1000 * sigma
        with torch.no_grad():
            v_old = dit(hidden_states=x_t, timestep=timestep, **cond, return_dict=False)[0]
        v = dit(hidden_states=x_t, timestep=timestep, **cond, return_dict=False)[0]
        if kind == "nft":
            loss = nft_loss(v, v_old, x_t, x0, sigma, batch["advantages"])
        else:
            loss, log_prob = awm_loss(v, matching_log_prob(v_old, target).float(), target, batch["advantages"])
            old = matching_log_prob(v_old, target).float()
            clipped.append(((torch.exp(log_prob - old) - 1).abs() > AWM_CLIP).float().mean())
        (backward or torch.Tensor.backward)(loss / k)
        total += float(loss.detach()) / k
    return dict(loss=total, clipfrac=float(torch.stack(clipped).mean()) if clipped else 0.0, approx_kl=0.0)


__all__ = ["ADV_CLIP", "AWM_CLIP", "NFT_BETA", "awm_loss", "decoupled_backward", "draw_timesteps", "forward_noise",
           "matching_log_prob", "nft_loss"]
