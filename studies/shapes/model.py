"""The shapes DiT: the real diffusers ``FluxTransformer2DModel`` at a tiny config, class-conditional.

A different architecture from the digits base (SD3: joint blocks only, learned patch embedding and
absolute sin-cos positions): Flux has dual-stream blocks followed by single-stream blocks (parallel
attention + MLP), rotary position embeddings over (text, row, column) ids, and a token-wise
linear input embedding of *packed* latents (2x2 pixel patches -> 4 channels per token).

``FluxImageDiT`` wraps it so that it is called like the digits DiT — on images (B, 1, 8, 8) with the
timestep in [0, 1000]:
``dit(hidden_states=z, timestep=1000 * sigma, **class_conditioning(labels), return_dict=False)[0]``
— so the digits trainer, GRPO loss and fidelity estimators run on it unchanged. The wrapper packs
the image into 16 tokens of 4 channels (as FluxPipeline._pack_latents does), builds the RoPE ids,
passes timestep / 1000 (Flux multiplies by 1000 itself) and unpacks the velocity.

Weights ship in ``weights/base_flux.pt`` (fp16); ``python -m jaggc_studies.shapes.train_base`` regenerates them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from jaggc_studies.digits.model import conditioning_of, load_shipped, prompt_table

from jaggc_studies.shapes.data import IMAGE_SHAPE, NUM_CLASSES

# 2 dual-stream + 2 single-stream blocks, inner width 64 (4 heads x 16); RoPE axes (text, y, x)
# split the 16 head dims as 4 + 6 + 6. patch_size 1 over packed 2x2 patches (Flux's own layout).
SHAPES_CONFIG = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2,
                     attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                     pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
PROMPT_LEN = 4
_PROMPT_SEED = 4321
PACK = 2   # pixels per token side

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BASE_WEIGHTS = WEIGHTS_DIR / "base_flux.pt"
BASE_REGEN_COMMAND = "python -m jaggc_studies.shapes.train_base"


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): FluxPipeline._pack_latents."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // PACK, PACK, w // PACK, PACK).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PACK) * (w // PACK), c * PACK * PACK)


def unpack(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of ``pack`` for images of ``shape`` (C, H, W)."""
    c, h, w = shape
    b = x.shape[0]
    x = x.view(b, h // PACK, w // PACK, c, PACK, PACK).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_ids(h: int, w: int) -> torch.Tensor:
    """Flux's RoPE ids (h*w, 3) of an h x w token grid: (0, row, column)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


class FluxImageDiT(nn.Module):
    """A ``FluxTransformer2DModel`` called on images with an SD3-style signature (see module doc)."""

    def __init__(self, config: dict | None = None, image_shape: tuple[int, int, int] = IMAGE_SHAPE):
        super().__init__()
        from diffusers import FluxTransformer2DModel

        self.config_dict = dict(config or SHAPES_CONFIG)
        self.image_shape = tuple(image_shape)
        self.flux = FluxTransformer2DModel(**self.config_dict)
        _, h, w = self.image_shape
        self.register_buffer("img_ids", image_ids(h // PACK, w // PACK), persistent=False)
        self.register_buffer("txt_ids", torch.zeros(PROMPT_LEN, 3), persistent=False)

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict: bool = False):
        b = hidden_states.shape[0]
        t = torch.as_tensor(timestep, dtype=hidden_states.dtype, device=hidden_states.device)
        t = t.expand(b) if t.ndim == 0 else t
        out = self.flux(hidden_states=pack(hidden_states), encoder_hidden_states=encoder_hidden_states,
                        pooled_projections=pooled_projections, timestep=t / 1000.0,
                        img_ids=self.img_ids, txt_ids=self.txt_ids[:encoder_hidden_states.shape[1]],
                        return_dict=False)[0]
        v = unpack(out, self.image_shape)
        return (v,) if not return_dict else {"sample": v}


def build_dit(*, seed: int = 0, config: dict | None = None) -> FluxImageDiT:
    """A freshly initialised shapes DiT (deterministic in ``seed``)."""
    torch.manual_seed(seed)
    return FluxImageDiT(config)


def class_conditioning(labels: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                       config: dict | None = None) -> dict:
    """The frozen per-class "prompt embeddings" of ``labels`` (B,), as DiT keyword arguments."""
    table = prompt_table(config or SHAPES_CONFIG, num_classes=NUM_CLASSES, prompt_len=PROMPT_LEN, seed=_PROMPT_SEED)
    return conditioning_of(table, labels, dtype)


def load_base(path: str | Path | None = None) -> FluxImageDiT:
    """The pretrained shapes DiT: eval mode, float32; parameters keep requires_grad."""
    return load_shipped(build_dit(seed=0), Path(path) if path is not None else BASE_WEIGHTS, BASE_REGEN_COMMAND,
                        weights_dir=WEIGHTS_DIR, config=SHAPES_CONFIG, config_name="SHAPES_CONFIG")


__all__ = ["BASE_REGEN_COMMAND", "BASE_WEIGHTS", "FluxImageDiT", "IMAGE_SHAPE", "NUM_CLASSES", "PROMPT_LEN",
           "SHAPES_CONFIG", "WEIGHTS_DIR", "build_dit", "class_conditioning", "image_ids", "load_base", "pack",
           "unpack"]
