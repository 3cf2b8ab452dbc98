"""The digits DiT: the real diffusers ``SD3Transformer2DModel`` at a small config, class-conditional.

Conditioning follows how SD3 is conditioned by a frozen text encoder: every class has a fixed,
seeded "prompt embedding" (``encoder_hidden_states``) and pooled embedding
(``pooled_projections``); the transformer's own context and pooled projections are trained.
So a DiT call in the GRPO loss is an ordinary diffusers call:
``dit(hidden_states=z, timestep=1000 * sigma, **class_conditioning(labels), return_dict=False)[0]``.

The pretrained base weights ship in ``weights/`` as fp16 (to keep the package small) and load as
float32; ``python -m jaggc_studies.digits.train_base`` regenerates them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from jaggc_studies.digits.data import IMAGE_SHAPE, NUM_CLASSES

# Inner width 64 (4 heads x 16): ~0.58M parameters, so a GRPO forward+backward stays cheap on CPU
# (batch 64 forward+backward ~0.1 s on one core) while still learning all ten digits.
# caption_projection_dim must equal the inner width (heads x head_dim) in SD3's joint blocks.
DIGITS_CONFIG = dict(sample_size=8, patch_size=2, in_channels=1, out_channels=1, num_layers=4,
                     attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                     caption_projection_dim=64, pooled_projection_dim=32)
PROMPT_LEN = 4
_PROMPT_SEED = 1234

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BASE_WEIGHTS = WEIGHTS_DIR / "base_dit.pt"
BASE_REGEN_COMMAND = "python -m jaggc_studies.digits.train_base"


class MissingWeightsError(FileNotFoundError):
    """A shipped weights file is absent; the message names the command that regenerates it."""


def build_dit(*, seed: int = 0, config: dict | None = None):
    """A freshly initialised digits DiT (deterministic in ``seed``)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(**(config or DIGITS_CONFIG))


def prompt_table(config: dict, *, num_classes: int = NUM_CLASSES, prompt_len: int = PROMPT_LEN,
                 seed: int = _PROMPT_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random "prompt embeddings" per class (sequence, pooled), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randn(num_classes, prompt_len, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(num_classes, config["pooled_projection_dim"], generator=g)
    return prompts, pooled


def conditioning_of(table: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> dict:
    """The DiT keyword arguments of ``labels`` (B,) from a ``prompt_table``."""
    prompts, pooled = table
    labels = torch.as_tensor(labels, dtype=torch.int64)
    return dict(encoder_hidden_states=prompts[labels].to(dtype), pooled_projections=pooled[labels].to(dtype))


def class_conditioning(labels: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                       config: dict | None = None) -> dict:
    """The frozen per-class "prompt embeddings" of ``labels`` (B,), as DiT keyword arguments."""
    return conditioning_of(prompt_table(config or DIGITS_CONFIG), labels, dtype)


def save_fp16_state(module: torch.nn.Module, path: Path, **meta) -> None:
    """Store ``module``'s parameters as fp16 (halves the shipped size) plus metadata.

    Buffers are left out: the DiT's only buffer is its fixed sin-cos position table (9216 x 64,
    twice the size of the parameters), which ``build_dit`` recreates identically.
    """
    state = {k: v.detach().half() for k, v in module.named_parameters()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(state_dict=state, **meta), path)


def load_parameters(module: torch.nn.Module, state_dict: dict) -> None:
    """Load a parameters-only state dict; every parameter must be present (buffers keep their init)."""
    missing, unexpected = module.load_state_dict(state_dict, strict=False)
    buffers = {name for name, _ in module.named_buffers()}
    if unexpected or set(missing) - buffers:
        raise ValueError(f"weights do not match the module: missing {sorted(set(missing) - buffers)}, "
                         f"unexpected {sorted(unexpected)}")


def load_fp16_state(path: Path, regen_command: str, *, weights_dir: Path | None = None) -> dict:
    """The checkpoint dict at ``path``; a clear error naming ``regen_command`` (which writes to
    ``weights_dir``, default the digits weights folder) if it is missing."""
    path = Path(path)
    if not path.is_file():
        raise MissingWeightsError(
            f"weights file {path} is missing; regenerate it with `{regen_command}` "
            f"(it writes to {weights_dir or WEIGHTS_DIR} by default)")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ckpt["state_dict"] = {k: (v.float() if v.is_floating_point() else v) for k, v in ckpt["state_dict"].items()}
    return ckpt


def load_shipped(module: torch.nn.Module, path: Path, regen_command: str, *, weights_dir: Path | None = None,
                 config: dict | None = None, config_name: str = "") -> torch.nn.Module:
    """``module`` with the shipped fp16 weights at ``path``: float32, eval mode, parameters keep
    requires_grad. With ``config``, a checkpoint trained with another config is refused."""
    ckpt = load_fp16_state(path, regen_command, weights_dir=weights_dir)
    if config is not None and ckpt.get("config") != config:
        # The class prompt table is derived from the config, so a stale checkpoint would be
        # conditioned on the wrong embeddings: refuse rather than load something subtly broken.
        raise ValueError(f"base weights were trained with config {ckpt.get('config')} but "
                         f"{config_name} is {config}; regenerate with `{regen_command}`")
    load_parameters(module, ckpt["state_dict"])
    return module.float().eval()


def load_base(path: str | Path | None = None):
    """The pretrained digits DiT: eval mode, float32; parameters keep requires_grad (fine-tunable)."""
    return load_shipped(build_dit(seed=0), Path(path) if path is not None else BASE_WEIGHTS, BASE_REGEN_COMMAND,
                        config=DIGITS_CONFIG, config_name="DIGITS_CONFIG")


__all__ = ["BASE_REGEN_COMMAND", "BASE_WEIGHTS", "DIGITS_CONFIG", "IMAGE_SHAPE", "MissingWeightsError",
           "NUM_CLASSES", "PROMPT_LEN", "WEIGHTS_DIR", "build_dit", "class_conditioning", "load_base",
           "load_fp16_state", "load_parameters", "save_fp16_state"]
