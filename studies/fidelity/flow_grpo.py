"""The digits trainer's Flow-GRPO batches for the fidelity estimators and ``jaggc calibrate``:
the SDE step means the ``denoised`` variant needs, and on-/off-policy calibration batches."""

from __future__ import annotations

from jaggc.errors import JaggInputError
from jaggc.fidelity import estimators as E
from jaggc.fidelity.calibrate import calibrate

from jaggc_studies.example_losses import sde_step_with_logprob


def flow_grpo_extras(rec: E.Recording, batch: dict) -> E.Recording:
    """Fill ``rec.extra`` with the SDE step means μ_k (at the evaluating parameters, from the
    recorded v_k) and the end time, for a batch of ``jaggc_studies.digits.trainer.rollout`` layout whose
    ``train_steps`` are consecutive from 0."""
    steps = list(batch["train_steps"])
    if steps != list(range(len(steps))) or len(steps) != rec.num_steps:
        raise JaggInputError("flow_grpo_extras needs train_steps = 0..S-1 matching the recorded calls")
    means = []
    for j, v in zip(steps, rec.outputs):
        _, _, mu, _ = sde_step_with_logprob(v, batch["latents"][:, j], batch["sigmas"][:, j],
                                            batch["sigmas_next"][:, j], batch["next_latents"][:, j],
                                            batch["sigma_max"], noise_level=batch["noise_level"])
        means.append(mu.detach().to(v.dtype))
    rec.extra["means"] = means
    last = steps[-1] + 1
    if last < batch["timesteps"].shape[1]:
        rec.extra["end_time"] = batch["timesteps"][:, last]
    else:   # the state after the last stored step: its time from sigmas_next
        rec.extra["end_time"] = 1000 * batch["sigmas_next"][:, steps[-1]]
    return rec


def digits_batches(num_batches: int = 2, *, seed: int = 0, warmup: int = 1, num_steps: int = 10) -> tuple:
    """Calibration batches for the digits example: per rollout, the trainer's first minibatch
    on-policy and its second minibatch after one real optimizer step (then θ is restored).
    Returns (dit, batches)."""
    import copy

    from jaggc_studies.digits.model import load_base
    from jaggc_studies.digits.trainer import GRPOTrainer, TrainerConfig

    from .frozen_start import FrozenStart

    config = TrainerConfig(strategy="exact", seed=seed, num_steps=num_steps)
    dit = load_base()
    trainer = GRPOTrainer(dit, config)
    frozen = FrozenStart(trainer, warmup)
    batches = []
    for r in range(num_batches):
        it = 2000 + r
        mbs = frozen.minibatches(it)
        batches.append(("on", mbs[0], copy.deepcopy(dit.state_dict())))
        trainer._optimize(mbs[0])
        batches.append(("off1", mbs[-1], copy.deepcopy(dit.state_dict())))
        frozen.restore()
    return dit, batches


def calibrate_digits(target_cosine: float = 0.95, num_batches: int = 2, seed: int = 0, candidates=None) -> dict:
    """``calibrate`` on the digits example, over on-policy and one-step-off-policy batches, each
    measured at its own parameters; cosines and errors are pooled over all of them."""
    from jaggc_studies.digits.trainer import grpo_loss

    dit, batches = digits_batches(num_batches, seed=seed)
    return calibrate(grpo_loss, dit, [b for _, b, _ in batches], target_cosine, candidates, seed=seed,
                     extras=flow_grpo_extras, states=[state for _, _, state in batches])


__all__ = ["calibrate_digits", "digits_batches", "flow_grpo_extras"]
