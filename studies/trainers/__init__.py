"""The GRPO losses in the shapes the trainers write them, one module per trainer (the list and what
each shape exercises: ``jaggc_studies.trainer_shapes``, which re-exports every name here)."""

from .common import OFF_POLICY_STEP, T_DEFAULT, GRPOConfig, TrainerShape, off_policy_step
from .dance_grpo import dance_grpo_flux
from .flow_grpo import flow_grpo_sd3
from .jagg_author import jagg_author_qwen
from .jaggc_helpers import jaggc_helpers_sd3
from .mix_grpo import mix_grpo_flux

SHAPES = {
    "flow_grpo_sd3": flow_grpo_sd3,
    "dance_grpo_flux": dance_grpo_flux,
    "mix_grpo_flux": mix_grpo_flux,
    "jagg_author_qwen": jagg_author_qwen,
    "jaggc_helpers_sd3": jaggc_helpers_sd3,
}

__all__ = ["GRPOConfig", "OFF_POLICY_STEP", "SHAPES", "T_DEFAULT", "TrainerShape", "dance_grpo_flux", "flow_grpo_sd3",
           "jagg_author_qwen", "jaggc_helpers_sd3", "mix_grpo_flux", "off_policy_step"]
