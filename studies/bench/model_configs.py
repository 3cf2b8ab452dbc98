"""The published DiT architectures at their real sizes, random init, nothing downloaded.

Each entry is the ``transformer/config.json`` of the published diffusers checkpoint (the fields
that shape the network; the values are those of the public configs, cross-checked against several
public copies of them):

  * ``sd35-medium``: stabilityai/stable-diffusion-3.5-medium, ``SD3Transformer2DModel``: 24 joint
    layers, 24 heads x 64 (width 1536), caption projection 1536, joint attention dim 4096 (T5-XXL),
    pooled 2048 (CLIP-L + CLIP-G), 16 latent channels, patch 2, dual attention in layers 0-12,
    RMS qk-norm, pos-embed max size 384. 2.24B parameters as built here.
  * ``flux-dev``: black-forest-labs/FLUX.1-dev, ``FluxTransformer2DModel``: 19 double + 38 single
    blocks, 24 heads x 128 (width 3072), joint attention dim 4096, pooled 768, 64 input channels
    (16 latent channels packed 2x2), patch 1, guidance embedding, RoPE axes (16, 56, 56). 11.9B.
  * ``qwen-image``: Qwen/Qwen-Image, ``QwenImageTransformer2DModel``: 60 layers, 24 heads x 128
    (width 3072), joint attention dim 3584 (Qwen2.5-VL), 64 input channels (packed 2x2), 16 output
    channels, patch 2, no guidance embedding, RoPE axes (16, 56, 56). 20.4B.

``--layers N`` cuts the depth so that a size fits a given memory: SD3.5 keeps the first N joint
layers (dual attention where the published model has it, i.e. layers < 13); Flux keeps N double and
2N single blocks (the published 19:38 ratio); Qwen-Image keeps N layers. Widths, heads and the
conditioning dims stay the published ones, so every GEMM has its real shape.

Latents: the VAEs downsample by 8, so a ``resolution`` of 512 px is a 64x64 latent and 1024 px a
128x128 one (SD3: 16x64x64 patchified by 2 into 1024 tokens; Flux/Qwen-Image: 16 channels packed 2x2
into 32x32 = 1024 tokens of 64 channels). Text lengths are the trainers': 333 tokens for SD3 (77
CLIP + 256 T5, Flow-GRPO), 512 for Flux (DanceGRPO's T5 length), 256 for Qwen-Image.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PublishedModel:
    name: str
    family: str            # the bench's problem family: "sd3", "flux", "qwen"
    source: str            # where the config comes from
    config: dict
    text_len: int
    params_b: float        # parameters at full depth, as built here (billions)


PUBLISHED: dict[str, PublishedModel] = {m.name: m for m in (
    PublishedModel(
        "sd35-medium", "sd3", "stabilityai/stable-diffusion-3.5-medium transformer/config.json",
        dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
             num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
             pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
             dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        text_len=333, params_b=2.24),
    PublishedModel(
        "flux-dev", "flux", "black-forest-labs/FLUX.1-dev transformer/config.json",
        dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56)),
        text_len=512, params_b=11.90),
    PublishedModel(
        "qwen-image", "qwen", "Qwen/Qwen-Image transformer/config.json",
        dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
        text_len=256, params_b=20.43),
)}

VAE_DOWNSAMPLE = 8


def depth_cut(name: str, layers: int | None) -> dict:
    """The published config of ``name`` with its depth cut to ``layers`` (module docstring)."""
    model = PUBLISHED[name]
    config = dict(model.config)
    if layers is None:
        return config
    if layers < 1 or layers > config["num_layers"]:
        raise ValueError(f"--layers {layers}: {name} has {config['num_layers']} layers; choose 1..{config['num_layers']}")
    config["num_layers"] = layers
    if model.family == "sd3":
        config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < layers)
    if model.family == "flux":
        config["num_single_layers"] = 2 * layers
    return config


def model_class(family: str):
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel

    return {"sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel, "qwen": QwenImageTransformer2DModel}[family]


def build_published(name: str, *, layers: int | None = None, seed: int = 0, device="cpu",
                    dtype: torch.dtype = torch.float32):
    """The diffusers transformer of ``name`` (random init, seeded), built directly on ``device``
    (a 2-12B model initialised on the host first would take minutes) and cast to ``dtype``."""
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        model = model_class(PUBLISHED[name].family)(**depth_cut(name, layers))
    return cast(model, dtype=dtype)


def cast(model, **to):
    """``model.to(**to)`` without diffusers' warning about modules to keep in float32 (it lists none
    for these transformers; it is meant for checkpoints loaded without ``torch_dtype``)."""
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return model.to(**to)
    finally:
        logging.set_verbosity(level)


def latent_side(resolution: int) -> int:
    """Latent height/width of an image of ``resolution`` px (512 -> 64, 1024 -> 128)."""
    if resolution % (2 * VAE_DOWNSAMPLE):
        raise ValueError(f"--resolution {resolution}: use a multiple of {2 * VAE_DOWNSAMPLE} px (512, 1024, ...)")
    return resolution // VAE_DOWNSAMPLE
