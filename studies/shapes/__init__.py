"""The second trained base: a tiny diffusers Flux DiT pretrained on procedurally generated 8x8 shapes
(6 classes), with offline shape classifiers as rewards. It runs through the digits GRPO trainer
and the fidelity study unchanged: ``trainer_kwargs()`` are the extra ``GRPOTrainer`` arguments."""

from jaggc_studies.shapes.data import CLASS_NAMES, IMAGE_SHAPE, NUM_CLASSES, ShapesSplit, load_shapes_split
from jaggc_studies.shapes.model import SHAPES_CONFIG, FluxImageDiT, build_dit, class_conditioning, load_base


def trainer_kwargs() -> dict:
    """``GRPOTrainer(dit, config, **trainer_kwargs())`` trains the shapes DiT with the shapes
    reward classifier (p(target class)), 6 classes, 8x8 images and the shapes prompt table."""
    from jaggc_studies.shapes.classifier import classifier_reward

    return dict(reward_fn=classifier_reward, num_classes=NUM_CLASSES, image_shape=IMAGE_SHAPE,
                conditioning=class_conditioning)


__all__ = ["CLASS_NAMES", "IMAGE_SHAPE", "NUM_CLASSES", "SHAPES_CONFIG", "FluxImageDiT", "ShapesSplit",
           "build_dit", "class_conditioning", "load_base", "load_shapes_split", "trainer_kwargs"]
