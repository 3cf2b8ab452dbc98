"""What every trainer shape shares: ``TrainerShape`` (a loss, its model and its arguments), the
trainers' hyper-parameters as one object (``GRPOConfig``) and the one optimizer step that takes the
parameters off-policy after the rollout (``off_policy_step``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

T_DEFAULT = 8
OFF_POLICY_STEP = 2e-2


@dataclass
class TrainerShape:
    """``loss_fn(*args)`` is the loss as the trainer shapes it; ``model`` the DiT it trains."""

    name: str
    loss_fn: Callable
    model: nn.Module
    args: tuple
    description: str
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GRPOConfig:
    """The trainer's hyper-parameters, passed as one object (``config.train`` in Flow-GRPO, ``args``
    in DanceGRPO): the FX capture keys its graph on what it holds."""

    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    beta: float = 0.0
    noise_level: float = 0.7
    guidance_scale: float = 4.5
    cfg: bool = True
    eta: float = 0.3
    gradient_accumulation_steps: int = 1
    kl_coeff: float = 0.0
    mixed_precision: bool = True    # Flow-GRPO: accelerator.autocast() around compute_log_prob (bf16)

    def autocast(self):
        """Flow-GRPO's ``autocast``: ``accelerator.autocast()`` with bf16 mixed precision, which on a
        GPU is this CUDA autocast block; a null context without mixed precision."""
        return torch.autocast("cuda", torch.bfloat16) if self.mixed_precision else contextlib.nullcontext()


@torch.no_grad()
def off_policy_step(model: nn.Module, seed: int, trained: Callable[[str], bool]) -> None:
    """Move the trained parameters by OFF_POLICY_STEP times their RMS (one optimizer step)."""
    g = torch.Generator().manual_seed(seed + 2)
    for name, p in model.named_parameters():
        if trained(name):
            scale = p.float().pow(2).mean().sqrt().item()
            p.add_((torch.randn(p.shape, generator=g) * OFF_POLICY_STEP * scale).to(p.device, p.dtype))
