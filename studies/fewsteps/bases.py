"""The two bases of the few-step study, each with a reward its base does not already satisfy.

``digits``: the demo's bold-digits reward (the base scores ~0.02). ``shapes``: the fidelity studies'
second base (tiny Flux DiT on generated shapes, docs/fidelity.md), whose plain classifier reward the
base already meets (0.97), so the study asks for bold shapes too: p(target shape) under the shapes
reward classifier x sigmoid((ink - SHAPES_BOLD_INK) / SHAPES_BOLD_WIDTH). The shapes data's ink: median
0.19, 99th percentile 0.49 (per class medians 0.11 to 0.26), so the threshold sits above most shapes
of every class and the base scores low; the classifier factor keeps them the right shape.
``digits-wide``: the digits base with its feed-forwards widened 8x without changing its function
(``jaggc_studies.fewsteps.wide``: 2.2M parameters, derived at first use and cached), so the DiT's
passes are the cost of an iteration; the same bold-digits reward (the base scores ~0.02).
"""

from __future__ import annotations

import torch

from jaggc.errors import JaggInputError

BASES = ("digits", "shapes", "digits-wide")
SHAPES_BOLD_INK = 0.35
SHAPES_BOLD_WIDTH = 0.05


def shapes_bold_reward(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from jaggc_studies.digits.rewards import ink
    from jaggc_studies.shapes.classifier import classifier_reward

    return classifier_reward(images, labels) * torch.sigmoid((ink(images) - SHAPES_BOLD_INK) / SHAPES_BOLD_WIDTH)


def load_base(name: str, *, random_init: bool = False):
    """(DiT, extra ``GRPOTrainer`` kwargs with the base's training reward, evaluation rewards)."""
    if name == "digits":
        from jaggc_studies.digits.demo import load_start_model, reward_functions

        fns = reward_functions("bold")
        return load_start_model("random" if random_init else "pretrained"), dict(reward_fn=fns["reward"]), fns
    if name == "digits-wide":
        from jaggc_studies.digits.demo import reward_functions
        from jaggc_studies.digits.model import build_dit
        from jaggc_studies.fewsteps.wide import WIDE_FACTOR, load_wide_base, widen_feedforward

        fns = reward_functions("bold")
        dit = widen_feedforward(build_dit(seed=0), WIDE_FACTOR) if random_init else load_wide_base()
        return dit, dict(reward_fn=fns["reward"]), fns
    if name == "shapes":
        import jaggc_studies.shapes as shapes
        from jaggc_studies.digits.rewards import ink

        dit = shapes.build_dit(seed=0) if random_init else shapes.load_base()
        kwargs = dict(shapes.trainer_kwargs(), reward_fn=shapes_bold_reward)
        fns = {"reward": shapes_bold_reward, "classifier": shapes.trainer_kwargs()["reward_fn"],
               "ink": lambda images, labels: ink(images)}
        return dit, kwargs, fns
    raise JaggInputError(f"base {name!r}: use one of {BASES}")


__all__ = ["BASES", "SHAPES_BOLD_INK", "SHAPES_BOLD_WIDTH", "load_base", "shapes_bold_reward"]
