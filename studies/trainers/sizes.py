"""The DiTs the trainers' shapes and loops run on, by size: the project's small configs or the
published architectures the trainers fine-tune (random init, nothing downloaded).

* ``"tiny"``, ``"10m"``: ``jaggc.models``' small SD3 / Flux configs; Flow-GRPO's LoRA there is a random
  rank-4 adapter on the attention (so the adapter-off KL reference differs from the policy);
* ``"published"``: SD3.5-Medium for Flow-GRPO, with its LoRA (rank 32, alpha 64, Gaussian init, the 8
  attention projections of both streams, as ``train_sd3.py`` configures it) and 333 text tokens;
  FLUX.1-dev for DanceGRPO and MixGRPO (512 text tokens); ``layers`` cuts the depth to fit a device's
  memory (``bench/model_configs.py``: every width and head the published one). Latents at
  ``resolution`` px (SD3: 16 x res/8 x res/8; Flux: (res/16)^2 packed tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jaggc import models

SIZES = ("tiny", "10m", "published")
FLOW_GRPO_LORA = dict(r=32, lora_alpha=64, init_lora_weights="gaussian",
                      target_modules=["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                                      "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"])
SMALL_LORA = dict(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)


@dataclass(frozen=True)
class Where:
    """Where a loop runs: the model size, the device, the weights' dtype, a depth cut and the image
    resolution of the published sizes."""

    size: str = "tiny"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    layers: int | None = None
    resolution: int = 512

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"size {self.size!r}: use one of {SIZES}")

    @property
    def published(self) -> bool:
        return self.size == "published"


def sd3(where: Where, *, seed: int = 0):
    """An SD3 transformer (float32, on the device: the caller casts after adding the LoRA)."""
    if where.published:
        from jaggc_studies.bench.model_configs import build_published

        return build_published("sd35-medium", layers=where.layers, seed=seed, device=where.device)
    return models.sd3(where.size, seed=seed).to(where.device)


def sd3_lora(where: Where) -> dict:
    return FLOW_GRPO_LORA if where.published else SMALL_LORA


def sd3_text_len(where: Where) -> int:
    return 333 if where.published else 5


def sd3_latent_shape(model, batch: int, where: Where) -> tuple[int, ...]:
    if where.published:
        side = where.resolution // 8
        return (batch, model.config.in_channels, side, side)
    return models.sd3_latent_shape(model, batch)


def flux(where: Where, *, seed: int = 0):
    """A Flux transformer with guidance embeddings (FLUX.1-dev's), float32, on the device."""
    if where.published:
        from jaggc_studies.bench.model_configs import build_published

        return build_published("flux-dev", layers=where.layers, seed=seed, device=where.device)
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**{**models.FLUX_CONFIGS[where.size], "guidance_embeds": True}).to(where.device)


def flux_side(where: Where, small_side: int) -> int:
    """Packed latent tokens per side: the published model's at its resolution, else ``small_side``."""
    return where.resolution // 16 if where.published else small_side


def flux_text_len(where: Where) -> int:
    return 512 if where.published else 4


__all__ = ["FLOW_GRPO_LORA", "SIZES", "Where", "flux", "flux_side", "flux_text_len", "sd3", "sd3_latent_shape",
           "sd3_lora", "sd3_text_len"]
