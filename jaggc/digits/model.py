"""The digits DiT: the real diffusers ``SD3Transformer2DModel`` at a small config, class-conditional.

Conditioning follows how SD3 is conditioned by a frozen text encoder: every class has a fixed,
seeded "prompt embedding" (``encoder_hidden_states``) and pooled embedding
(``pooled_projections``); the transformer's own context and pooled projections are trained.
So a DiT call in the GRPO loss is an ordinary diffusers call:
``dit(hidden_states=z, timestep=1000 * sigma, **class_conditioning(labels), return_dict=False)[0]``.
"""

from __future__ import annotations

import torch

from .data import IMAGE_SHAPE, NUM_CLASSES

DIGITS_CONFIG = dict(sample_size=8, patch_size=2, in_channels=1, out_channels=1, num_layers=4,
                     attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32,
                     caption_projection_dim=128, pooled_projection_dim=32)
PROMPT_LEN = 4
_PROMPT_SEED = 1234


def build_dit(*, seed: int = 0, config: dict | None = None):
    """A freshly initialised digits DiT (deterministic in ``seed``)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(**(config or DIGITS_CONFIG))


def _prompt_table(config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(_PROMPT_SEED)
    prompts = torch.randn(NUM_CLASSES, PROMPT_LEN, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(NUM_CLASSES, config["pooled_projection_dim"], generator=g)
    return prompts, pooled


def class_conditioning(labels: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                       config: dict | None = None) -> dict:
    """The frozen per-class "prompt embeddings" of ``labels`` (B,), as DiT keyword arguments."""
    prompts, pooled = _prompt_table(config or DIGITS_CONFIG)
    labels = torch.as_tensor(labels, dtype=torch.int64)
    return dict(encoder_hidden_states=prompts[labels].to(dtype), pooled_projections=pooled[labels].to(dtype))


__all__ = ["DIGITS_CONFIG", "IMAGE_SHAPE", "NUM_CLASSES", "PROMPT_LEN", "build_dit", "class_conditioning"]
