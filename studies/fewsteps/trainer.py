"""The digits GRPO trainer with a few-step schedule and the peers' per-step loop.

Flow-GRPO-Fast, MixGRPO, DanceGRPO and Flow-Factory all train one step at a time: forward, SDE
log-prob, PPO clipped ratio, ``loss / steps``, ``backward()``; the optimizer steps after the
trajectory. ``FewStepTrainer`` runs that loop over its ``Schedule``'s trained steps (sampling the
rollout with the schedule's SDE steps, ODE elsewhere); a schedule with ``jagg=W`` declares the loop
to ``jaggc.stepwise(dit, window=W, rollout_cache=True)``, the user's one-line change, so the
gradient goes through JAGG windows and the first minibatch's interior forwards come from the rollout.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from jaggc_studies.digits.trainer import GRPOTrainer
from jaggc_studies.example_losses import sde_step_with_logprob
from jaggc_studies.fewsteps.schedules import Schedule


def step_loss(dit, batch: dict, j: int):
    """Flow-GRPO's loss of stored step ``j`` (PPO clipped ratio, mean over samples) and its new log-prob."""
    latents = batch["latents"][:, j]
    noise_pred = dit(hidden_states=latents, timestep=batch["timesteps"][:, j],
                     encoder_hidden_states=batch["prompt_embeds"],
                     pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
    _, log_prob, _, _ = sde_step_with_logprob(
        noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j], batch["next_latents"][:, j],
        batch["sigma_max"], noise_level=batch["noise_level"])
    advantages = torch.clamp(batch["advantages"], -batch["adv_clip_max"], batch["adv_clip_max"])
    ratio = torch.exp(log_prob - batch["log_probs"][:, j])
    clipped = torch.clamp(ratio, 1.0 - batch["clip_range"], 1.0 + batch["clip_range"])
    return torch.mean(torch.maximum(-advantages * ratio, -advantages * clipped)), log_prob.detach()


def per_step_backward(dit, batch: dict, stepwise=None) -> tuple[float, torch.Tensor]:
    """The peers' loop over ``batch["train_steps"]`` in their order: one ``backward()`` per step of
    ``loss_j / steps`` (so ``.grad`` is the gradient of the mean over steps, as ``grpo_loss``'s).
    ``stepwise``: a ``jaggc.stepwise`` the loop is declared to. Returns the loss and the new
    log-probs (B, steps) in ``train_steps`` order."""
    steps = list(batch["train_steps"])
    loop = steps if stepwise is None else stepwise.steps(steps, batch["timesteps"][:, steps])
    total, new_log_probs = 0.0, []
    for j in loop:
        loss, log_prob = step_loss(dit, batch, j)
        (loss / len(steps)).backward()
        total += float(loss.detach()) / len(steps)
        new_log_probs.append(log_prob)
    return total, torch.stack(new_log_probs, 1)


@dataclass
class FewStepTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose rollout samples by ``schedule`` and whose optimizer steps run the
    per-step loop (through ``jaggc.stepwise`` when ``schedule.jagg``). ``config.strategy`` stays
    "exact" (the base trainer's whole-loss strategies are not used here)."""

    schedule: Schedule = Schedule("exact")

    def __post_init__(self):
        super().__post_init__()
        self.schedule.validate(self.config.num_steps)
        self.stepwise = None
        if self.schedule.jagg:
            import jaggc

            self.stepwise = jaggc.stepwise(self.dit, window=self.schedule.jagg, rollout_cache=True)

    def sde_steps(self, iteration: int):
        return self.schedule.sde_steps(self.config.num_steps, iteration, self.config.seed)

    def train_steps(self, iteration: int) -> tuple[int, ...]:
        return self.schedule.train_steps(self.config.num_steps, iteration, self.config.seed)

    def step(self) -> dict:
        """One iteration (``GRPOTrainer.step``) plus ``backward_work``: the DiT backward work in
        per-step backward passes of one minibatch: one per exact step, two per JAGG window (its one
        joint pass runs on the two knots' rows). Without JAGG it is ``backward_passes``."""
        before = self._stepwise_counts()
        log = super().step()
        after = self._stepwise_counts()
        log["backward_work"] = (log["backward_passes"] if after is None else
                                (after.exact_steps - before.exact_steps) + 2 * (after.jagg_windows - before.jagg_windows))
        return log

    def _stepwise_counts(self):
        if self.stepwise is None:
            return None
        return copy.copy(self.stepwise.report.counts)

    def _optimize(self, minibatch: dict) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        loss, new_log_probs = per_step_backward(self.dit, minibatch, self.stepwise)
        torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        old = minibatch["log_probs"][:, list(minibatch["train_steps"])]
        ratio = torch.exp(new_log_probs - old)
        clipped = (ratio - 1).abs() > self.config.clip_range
        return dict(loss=loss, clipfrac=float(clipped.float().mean()),
                    approx_kl=float(0.5 * ((new_log_probs - old) ** 2).mean()))

    def close(self) -> None:
        """Uninstall the ``jaggc.stepwise`` (the module's own forward back)."""
        if self.stepwise is not None:
            self.stepwise.close()
            self.stepwise = None


def schedule_gradient(dit, batch: dict, params: list, stepwise=None) -> torch.Tensor:
    """The flat gradient of ``params`` the per-step loop gives on ``batch`` (before clipping)."""
    dit.zero_grad(set_to_none=True)
    per_step_backward(dit, batch, stepwise)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    dit.zero_grad(set_to_none=True)
    return flat


__all__ = ["FewStepTrainer", "per_step_backward", "schedule_gradient", "step_loss"]
