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
import time
from dataclasses import dataclass

import torch

from jaggc.runtime import count_dit_passes

from jaggc_studies.digits.trainer import GRPOTrainer
from jaggc_studies.example_losses import sde_step_with_logprob
from jaggc_studies.fewsteps.decoupled import decoupled_backward
from jaggc_studies.fewsteps.schedules import Schedule


class PassTimer:
    """Process CPU time inside the DiT's forward calls (rollout's included) and inside the trainer's
    ``backward()`` calls (the DiT's backward and the few ops of the loss after it), per iteration.
    Installed by ``FewStepTrainer(timed=True)``; ``jaggc_studies.fewsteps.cost_shape`` reads it."""

    def __init__(self, dit):
        self.forward_s = self.grad_forward_s = self.backward_s = 0.0
        self._start = None
        self._handles = [dit.register_forward_pre_hook(self._pre), dit.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._start = time.process_time()

    def _post(self, module, args, output):
        spent = time.process_time() - self._start
        self.forward_s += spent
        if torch.is_grad_enabled():
            self.grad_forward_s += spent

    def backward(self, loss: torch.Tensor) -> None:
        start = time.process_time()
        loss.backward()
        self.backward_s += time.process_time() - start

    def take(self) -> dict:
        out = dict(forward_s=self.forward_s, grad_forward_s=self.grad_forward_s, backward_s=self.backward_s)
        self.forward_s = self.grad_forward_s = self.backward_s = 0.0
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


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


def per_step_backward(dit, batch: dict, stepwise=None, backward=None) -> tuple[float, torch.Tensor]:
    """The peers' loop over ``batch["train_steps"]`` in their order: one ``backward()`` per step of
    ``loss_j / steps`` (so ``.grad`` is the gradient of the mean over steps, as ``grpo_loss``'s).
    ``stepwise``: a ``jaggc.stepwise`` the loop is declared to. Returns the loss and the new
    log-probs (B, steps) in ``train_steps`` order. ``backward(loss)``: how to run each backward
    (a ``PassTimer``'s; default ``loss.backward()``)."""
    steps = list(batch["train_steps"])
    loop = steps if stepwise is None else stepwise.steps(steps, batch["timesteps"][:, steps])
    total, new_log_probs = 0.0, []
    for j in loop:
        loss, log_prob = step_loss(dit, batch, j)
        (backward or torch.Tensor.backward)(loss / len(steps))
        total += float(loss.detach()) / len(steps)
        new_log_probs.append(log_prob)
    return total, torch.stack(new_log_probs, 1)


@dataclass
class FewStepTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose rollout samples by ``schedule`` and whose optimizer steps run the
    per-step loop (through ``jaggc.stepwise`` when ``schedule.jagg``). ``config.strategy`` stays
    "exact" (the base trainer's whole-loss strategies are not used here)."""

    schedule: Schedule = Schedule("exact")
    timed: bool = False          # time the DiT's passes (PassTimer): the cost-shape measurement

    def __post_init__(self):
        super().__post_init__()
        self.schedule.validate(self.config.num_steps)
        self.timer = PassTimer(self.dit) if self.timed else None
        self.stepwise = None
        if self.schedule.jagg:
            import jaggc

            self.stepwise = jaggc.stepwise(self.dit, window=self.schedule.jagg,
                                           rollout_cache="first_order" if self.schedule.first_order else True)

    def sde_steps(self, iteration: int):
        return self.schedule.sde_steps(self.config.num_steps, iteration, self.config.seed)

    def train_steps(self, iteration: int) -> tuple[int, ...]:
        return self.schedule.train_steps(self.config.num_steps, iteration, self.config.seed)

    def step(self) -> dict:
        """One iteration (``GRPOTrainer.step``) plus ``backward_work``: the DiT backward work in
        per-step backward passes of one minibatch: one per exact step, two per JAGG window (its one
        joint pass runs on the two knots' rows). Without JAGG it is ``backward_passes``.
        ``rows``: the DiT passes the iteration ran, in sample rows (``rollout`` forwards, training
        ``forward`` s with or without grad, ``backward`` s; JAGG's from ``jaggc.stepwise``'s counts,
        cached forwards not run): the modelled GPU cost's input. ``timed``: ``passes`` (PassTimer)."""
        before = self._stepwise_counts()
        with count_dit_passes(self.dit) as counts:
            log = super().step()
        after = self._stepwise_counts()
        cfg = self.config
        batch = cfg.classes_per_iter * cfg.group_size
        rollout_rows = cfg.num_steps * batch
        mb = batch // cfg.minibatches
        if after is None:
            log["backward_work"] = log["backward_passes"]
            forward_rows = sum(counts.grad_forward_batches) + sum(counts.nograd_forward_batches) - rollout_rows
            backward_rows = sum(counts.backward_batches)
        else:
            delta = {k: getattr(after, k) - getattr(before, k)
                     for k in ("exact_steps", "jagg_windows", "grad_forwards", "nograd_forwards", "reruns")}
            log["backward_work"] = delta["exact_steps"] + 2 * delta["jagg_windows"]
            forward_rows = mb * (delta["grad_forwards"] + delta["nograd_forwards"] + delta["reruns"])
            backward_rows = mb * log["backward_work"]
        log["rows"] = dict(rollout=rollout_rows, forward=forward_rows, backward=backward_rows)
        if self.timer is not None:
            log["passes"] = self.timer.take()
        return log

    def _stepwise_counts(self):
        if self.stepwise is None:
            return None
        return copy.copy(self.stepwise.report.counts)

    def _optimize(self, minibatch: dict) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        backward = self.timer.backward if self.timer is not None else None
        if self.schedule.decoupled:
            self._minibatch = getattr(self, "_minibatch", 0) + 1
            generator = torch.Generator().manual_seed(
                ((self.config.seed * 1_000_003 + self.iteration) * 16 + 6) * 64 + self._minibatch % 64)
            stats = decoupled_backward(self.dit, minibatch, self.schedule.kind, self.schedule.k, generator, backward)
            torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
            self.optimizer.step()
            return stats
        loss, new_log_probs = per_step_backward(self.dit, minibatch, self.stepwise, backward)
        torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        old = minibatch["log_probs"][:, list(minibatch["train_steps"])]
        ratio = torch.exp(new_log_probs - old)
        clipped = (ratio - 1).abs() > self.config.clip_range
        return dict(loss=loss, clipfrac=float(clipped.float().mean()),
                    approx_kl=float(0.5 * ((new_log_probs - old) ** 2).mean()))

    def close(self) -> None:
        """Uninstall the ``jaggc.stepwise`` (the module's own forward back) and the pass timer."""
        if self.timer is not None:
            self.timer.close()
            self.timer = None
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


__all__ = ["FewStepTrainer", "PassTimer", "per_step_backward", "schedule_gradient", "step_loss"]
