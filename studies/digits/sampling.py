"""Deterministic Euler ODE sampling of the digits DiT over diffusers' shifted flow-matching grid.

Flow matching convention (diffusers FlowMatchEulerDiscreteScheduler): z_sigma = (1-sigma) x0 +
sigma noise, and the DiT predicts the velocity noise - x0, so dz/dsigma = v and an Euler step
from sigma_k to sigma_{k+1} (< sigma_k) is z += (sigma_{k+1} - sigma_k) v. This is the sampler
for judging the base model; GRPO's stochastic (SDE) rollout lives with the trainer.
"""

from __future__ import annotations

import torch

from jaggc.grpo import flow_match_sigmas
from jaggc_studies.digits.data import IMAGE_SHAPE
from jaggc_studies.digits.model import class_conditioning

DEFAULT_NUM_STEPS = 16
DEFAULT_SHIFT = 3.0  # SD3's shift, as in the Flow-GRPO setting the example imitates


@torch.no_grad()
def sample_ode(dit, labels, *, num_steps: int = DEFAULT_NUM_STEPS, shift: float = DEFAULT_SHIFT,
               generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
               image_shape: tuple = IMAGE_SHAPE, conditioning=class_conditioning) -> torch.Tensor:
    """Images (B, *image_shape) for class ``labels`` (B,), integrated from noise with Euler steps
    (``image_shape`` and ``conditioning``: the digits' by default; another base passes its own).

    The starting noise is ``noise`` if given, else drawn from ``generator`` (deterministic when
    seeded). Outputs are not clamped: they live roughly in [-1, 1] like the training data.
    """
    labels = torch.as_tensor(labels, dtype=torch.int64)
    param = next(dit.parameters())
    if noise is None:
        noise = torch.randn((len(labels), *image_shape), generator=generator)
    z = noise.to(device=param.device, dtype=param.dtype)
    cond = {k: v.to(param.device) for k, v in conditioning(labels, dtype=param.dtype).items()}
    sigmas = flow_match_sigmas(num_steps, shift).tolist()
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        timestep = torch.full((len(labels),), 1000.0 * sigma, device=param.device, dtype=param.dtype)
        v = dit(hidden_states=z, timestep=timestep, **cond, return_dict=False)[0]
        z = z + (sigma_next - sigma) * v
    return z


__all__ = ["DEFAULT_NUM_STEPS", "DEFAULT_SHIFT", "sample_ode"]
