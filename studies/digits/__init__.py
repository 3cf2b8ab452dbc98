"""The digits end-to-end example: a class-conditional diffusers SD3 DiT pretrained on sklearn's
digits, offline rewards, and a Flow-GRPO trainer whose loss runs exact or through @jagg_compile."""

from jaggc_studies.digits.data import IMAGE_SHAPE, NUM_CLASSES, DigitsSplit, load_digits_split
from jaggc_studies.digits.model import DIGITS_CONFIG, build_dit, class_conditioning, load_base

__all__ = ["DIGITS_CONFIG", "IMAGE_SHAPE", "NUM_CLASSES", "DigitsSplit", "build_dit", "class_conditioning",
           "load_base", "load_digits_split"]
