"""The third trained base: a tiny diffusers Qwen-Image DiT pretrained on procedurally generated 8x8
textures (6 classes), with offline texture classifiers as rewards. It runs through the digits GRPO
trainer and the fidelity study unchanged: ``trainer_kwargs()`` are the extra ``GRPOTrainer`` arguments."""

from jaggc_studies.textures.data import CLASS_NAMES, IMAGE_SHAPE, NUM_CLASSES, TexturesSplit, load_textures_split
from jaggc_studies.textures.model import TEXTURES_CONFIG, QwenImageDiT, build_dit, class_conditioning, load_base


def trainer_kwargs() -> dict:
    """``GRPOTrainer(dit, config, **trainer_kwargs())`` trains the textures DiT with its reward
    classifier (p(target class)), 6 classes, 8x8 images and its prompt table."""
    from jaggc_studies.textures.classifier import classifier_reward

    return dict(reward_fn=classifier_reward, num_classes=NUM_CLASSES, image_shape=IMAGE_SHAPE,
                conditioning=class_conditioning)


__all__ = ["CLASS_NAMES", "IMAGE_SHAPE", "NUM_CLASSES", "TEXTURES_CONFIG", "QwenImageDiT", "TexturesSplit",
           "build_dit", "class_conditioning", "load_base", "load_textures_split", "trainer_kwargs"]
