"""Small real DiTs (diffusers SD3 and Flux transformers built from configs) and their inputs.

Nothing is downloaded: the architectures are the real diffusers classes at small sizes, used by
the tests, the examples, the benchmark and the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SD3_CONFIGS = {
    # ~22k parameters: unit tests
    "tiny": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                 pooled_projection_dim=8, out_channels=4),
    # ~2.9M parameters (hidden 128, 5 layers), small latents: precision tests at a real model's count
    "3m": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=5, attention_head_dim=32,
               num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=128,
               pooled_projection_dim=32, out_channels=4),
    # ~13.7M parameters (hidden 256, 6 layers): the benchmark's "10M" model
    "10m": dict(sample_size=32, patch_size=2, in_channels=4, num_layers=6, attention_head_dim=64,
                num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=256,
                pooled_projection_dim=64, out_channels=4),
}

FLUX_CONFIGS = {
    "tiny": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                 axes_dims_rope=(2, 2, 4)),
    "10m": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=64,
                num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
                axes_dims_rope=(16, 24, 24)),
}


QWEN_CONFIGS = {
    # ~89k parameters: tests
    "tiny": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6)),
    # ~9.8M parameters (hidden 256, 4 layers): the trainer-shape speed comparison
    "10m": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=64,
                num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(16, 24, 24)),
}
QWEN_LATENT_SIDE = {"tiny": 4, "10m": 8}     # packed latent tokens per side


def sd3(size: str = "tiny", *, seed: int = 0, dtype=torch.float32):
    """A diffusers ``SD3Transformer2DModel`` of a small config (``"tiny"``, ``"10m"``, ...), random init
    from ``seed``; call it with ``hidden_states``, ``timestep`` (0..1000) and ``sd3_conditioning``."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**SD3_CONFIGS[size])
    return model if dtype == torch.float32 else model.to(dtype)


def flux(size: str = "tiny", *, seed: int = 0, dtype=torch.float32):
    """A diffusers ``FluxTransformer2DModel`` of a small config, random init from ``seed``; call it with
    packed ``hidden_states``, ``timestep`` (σ in [0, 1]) and ``flux_conditioning``."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**FLUX_CONFIGS[size])
    return model if dtype == torch.float32 else model.to(dtype)


def qwen_image(size: str = "tiny", *, seed: int = 0, dtype=torch.float32):
    """A diffusers ``QwenImageTransformer2DModel`` of a small config, random init from ``seed``."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**QWEN_CONFIGS[size])
    return model if dtype == torch.float32 else model.to(dtype)


@dataclass
class Conditioning:
    """Per-sample conditioning of a DiT call, as keyword arguments."""

    kwargs: dict


def sd3_conditioning(model, batch: int, *, text_len: int = 5, seed: int = 0) -> Conditioning:
    """Random ``encoder_hidden_states`` and ``pooled_projections`` of an SD3 model's sizes for ``batch``
    samples; pass ``**cond.kwargs`` to every call."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)        # drawn on the CPU: the same values on every device
    p = next(model.parameters())
    return Conditioning(dict(
        encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g).to(p.device, p.dtype),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(p.device, p.dtype),
    ))


def sd3_latent_shape(model, batch: int) -> tuple[int, ...]:
    """The (B, C, H, W) shape of an SD3 model's latents (its ``hidden_states``)."""
    cfg = model.config
    return (batch, cfg.in_channels, cfg.sample_size, cfg.sample_size)


def flux_conditioning(model, batch: int, *, height: int = 4, width: int = 4, text_len: int = 4,
                      seed: int = 0) -> Conditioning:
    """Random text embeddings, pooled projections, guidance and the image/text position ids of a
    Flux model's sizes for ``batch`` samples of ``height`` x ``width`` packed latents."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)        # drawn on the CPU: the same values on every device
    p = next(model.parameters())
    img_ids = torch.zeros(height, width, 3, device=p.device)
    img_ids[..., 1] = torch.arange(height, device=p.device)[:, None]
    img_ids[..., 2] = torch.arange(width, device=p.device)[None, :]
    return Conditioning(dict(
        encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g).to(p.device, p.dtype),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(p.device, p.dtype),
        img_ids=img_ids.reshape(height * width, 3),
        txt_ids=torch.zeros(text_len, 3, device=p.device),
    ))


def flux_latent_shape(model, batch: int, *, height: int = 4, width: int = 4) -> tuple[int, ...]:
    """The (B, height * width, C) shape of a Flux model's packed latents."""
    return (batch, height * width, model.config.in_channels)
