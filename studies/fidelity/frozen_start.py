"""The fidelity protocol's fixed starting point: a trainer after its warm-up, frozen as θ0
(``FrozenStart``); the fidelity study, the drift study and the guard study measure from it."""

from __future__ import annotations

import copy


class FrozenStart:
    """The protocol's fixed starting point: ``trainer`` after ``warmup`` GRPO iterations (so Adam's
    moments are warm) is frozen as θ0; ``minibatches(it)`` is rollout ``it`` at θ0 with every step
    but the σ≈0 last one trained, cut into the trainer's minibatches; ``restore()`` puts θ0 and the
    optimizer state back, so every rollout estimates the same expected gradient."""

    def __init__(self, trainer, warmup: int):
        for _ in range(warmup):
            trainer.step()
        self.trainer = trainer
        self.theta0 = copy.deepcopy(trainer.dit.state_dict())
        self.opt0 = copy.deepcopy(trainer.optimizer.state_dict())

    def minibatches(self, iteration: int) -> list[dict]:
        batch = self.trainer.collect(iteration)
        batch["train_steps"] = tuple(range(self.trainer.config.num_steps - 1))
        return self.trainer.minibatches(batch, iteration)

    def advance(self, condition: str, mbs: list[dict], done) -> dict:
        """Take ``condition``'s optimizer steps on rollout minibatches ``mbs`` (after the conditions
        in ``done``, measured earlier on the same rollout) and return the minibatch it is measured
        on: "on" mbs[0] at θ0; "off1" one step on mbs[0], then mbs[1]; "off4" four steps (the first
        is off1's if off1 ran), then mbs[1]."""
        optimize = self.trainer._optimize
        if condition == "on":
            return mbs[0]
        if condition == "off1":
            optimize(mbs[0])
        elif condition == "off4":
            if "off1" not in done:
                optimize(mbs[0])
            for j in (1, 0, 1):
                optimize(mbs[j % len(mbs)])
        else:
            raise ValueError(condition)
        return mbs[1 % len(mbs)]

    def restore(self) -> None:
        self.trainer.dit.load_state_dict(self.theta0)
        self.trainer.optimizer.load_state_dict(copy.deepcopy(self.opt0))

    def measured_batches(self, rollouts: int, conditions: Sequence[str]):
        """For each of ``rollouts`` rollouts (iterations 1000, 1001, ...) yield (r, condition,
        minibatch) for every condition in order, then put θ0 back before the next rollout."""
        for r in range(rollouts):
            mbs = self.minibatches(1000 + r)
            for i, cond in enumerate(conditions):
                yield r, cond, self.advance(cond, mbs, done=conditions[:i])
            self.restore()


__all__ = ["FrozenStart"]
