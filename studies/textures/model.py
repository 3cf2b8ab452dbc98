"""The textures DiT: the real diffusers ``QwenImageTransformer2DModel`` at a tiny config, class-conditional.

A third architecture, after SD3 (digits) and Flux (shapes): Qwen-Image's MMDiT with a text mask, no
pooled text embedding, 3-axis rotary embeddings built from ``img_shapes``, and 2x2-packed latent
tokens. ``QwenImageDiT`` wraps it so that it is called like the digits DiT, on images (B, 1, 8, 8)
with the timestep in [0, 1000] (Qwen-Image takes timestep / 1000); the pooled embedding the digits
trainer passes is ignored. Weights ship in ``weights/base_qwen.pt`` (fp16);
``python -m jaggc_studies.textures.train_base`` regenerates them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from jaggc_studies.digits.model import conditioning_of, load_shipped, prompt_table
from jaggc_studies.shapes.model import PACK, pack, unpack

from jaggc_studies.textures.data import IMAGE_SHAPE, NUM_CLASSES

# 3 blocks, inner width 64 (4 heads x 16); RoPE axes (frame, y, x) split 16 head dims as 4 + 6 + 6;
# tokens are 2x2 pixel patches of the 1-channel image: 4 input channels, out 1 x (2x2)
TEXTURES_CONFIG = dict(patch_size=2, in_channels=4, out_channels=1, num_layers=3, attention_head_dim=16,
                       num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
PROMPT_LEN = 4
_PROMPT_SEED = 2468

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BASE_WEIGHTS = WEIGHTS_DIR / "base_qwen.pt"
BASE_REGEN_COMMAND = "python -m jaggc_studies.textures.train_base"


class QwenImageDiT(nn.Module):
    """A ``QwenImageTransformer2DModel`` called on images with the digits DiT's signature."""

    def __init__(self, config: dict | None = None, image_shape: tuple[int, int, int] = IMAGE_SHAPE):
        super().__init__()
        from diffusers import QwenImageTransformer2DModel

        self.config_dict = dict(config or TEXTURES_CONFIG)
        self.image_shape = tuple(image_shape)
        self.qwen = QwenImageTransformer2DModel(**self.config_dict)

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections=None,
                return_dict: bool = False):
        b = hidden_states.shape[0]
        _, h, w = self.image_shape
        t = torch.as_tensor(timestep, dtype=hidden_states.dtype, device=hidden_states.device)
        t = t.expand(b) if t.ndim == 0 else t
        mask = torch.ones(encoder_hidden_states.shape[:2], dtype=torch.long, device=hidden_states.device)
        out = self.qwen(hidden_states=pack(hidden_states), encoder_hidden_states=encoder_hidden_states,
                        encoder_hidden_states_mask=mask, timestep=t / 1000.0,
                        img_shapes=[(1, h // PACK, w // PACK)], return_dict=False)[0]
        v = unpack(out, self.image_shape)
        return (v,) if not return_dict else {"sample": v}


def build_dit(*, seed: int = 0, config: dict | None = None) -> QwenImageDiT:
    """A freshly initialised textures DiT (deterministic in ``seed``)."""
    torch.manual_seed(seed)
    return QwenImageDiT(config)


def class_conditioning(labels: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                       config: dict | None = None) -> dict:
    """The frozen per-class "prompt embeddings" of ``labels`` (B,), as DiT keyword arguments (the
    pooled one has one unused dimension: Qwen-Image has no pooled text embedding)."""
    table = prompt_table(dict(config or TEXTURES_CONFIG, pooled_projection_dim=1), num_classes=NUM_CLASSES,
                         prompt_len=PROMPT_LEN, seed=_PROMPT_SEED)
    return conditioning_of(table, labels, dtype)


def load_base(path: str | Path | None = None) -> QwenImageDiT:
    """The pretrained textures DiT: eval mode, float32; parameters keep requires_grad."""
    return load_shipped(build_dit(seed=0), Path(path) if path is not None else BASE_WEIGHTS, BASE_REGEN_COMMAND,
                        weights_dir=WEIGHTS_DIR, config=TEXTURES_CONFIG, config_name="TEXTURES_CONFIG")
