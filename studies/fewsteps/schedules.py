"""The few-step GRPO schedules, in their own form: which steps a rollout samples by the SDE and which
steps the iteration trains (and in which order the per-step loop visits them).

Shapes read from the peers (not their code):
- Flow-GRPO-Fast (yifan123/flow_grpo, ``pipeline_with_logprob`` with ``sde_window_size`` /
  ``sde_window_range``): per rollout a start is drawn uniformly from ``[lo, hi - size]`` and the SDE
  runs on the ``size`` consecutive steps ``[start, start + size)``; every other step is the SDE at
  noise level 0 (the Euler ODE step); only the window's steps store latents and log-probs and only
  they are trained, in order. ``fast`` k here: ``size = k`` within the early range ``[0, T // 2)``
  (Flow-Factory's GRPO examples: ``num_sde_steps`` of ``sde_steps: [1..5]`` on 10 steps, the same
  early half).
- MixGRPO (Tencent-Hunyuan/MixGRPO, ``GRPOTrainingStates``): SDE on the window
  ``range(cur, min(cur + w, T - 1))``, ODE elsewhere, the window's steps trained in order; ``cur``
  moves one step every ``shift_interval`` iterations (25 in its 300-iteration run, which so covers
  the first half of its trajectory); near the end the window shrinks. ``MIX_SHIFT_INTERVAL`` scales
  that to the study's ~40 iterations over 10 steps.
- DanceGRPO (``train_grpo_flux.py``): an all-SDE trajectory; a random permutation of the steps, the
  first ``int(T * timestep_fraction)`` (0.6) trained in that random order. One permutation per
  iteration here (DanceGRPO draws one per sample; the stored-batch loss trains one set of steps).
- ``exact``: Flow-GRPO's all-SDE trajectory, every step but the sigma -> 0 one trained.
A schedule with ``jagg`` set trains the same steps through ``jaggc.stepwise(window=jagg)``.

The two decoupled trainers (``nft`` k, ``awm`` k: DiffusionNFT and Advantage Weighted Matching, as
Flow-Factory's ``nft`` / ``awm`` trainers define them, ``jaggc_studies.fewsteps.decoupled``) sample by
the ODE (no SDE step, no log-probability) and train ``k`` forward-process timesteps per sample, drawn
from the sampler's grid; they have no per-step GRPO loop, so JAGG does not apply to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jaggc.errors import JaggInputError

MIX_SHIFT_INTERVAL = 8      # iterations per MixGRPO window move (its 25 of 300, scaled to ~40 iterations)
DANCE_FRACTION = 0.6        # DanceGRPO's timestep_fraction
KINDS = ("exact", "fast", "mix", "dance", "nft", "awm")
DECOUPLED = ("nft", "awm")


@dataclass(frozen=True)
class Schedule:
    """One few-step schedule: ``kind`` (exact, fast, mix, dance), its size ``k`` (fast: SDE steps;
    mix: window), and ``jagg`` (None, or the ``jaggc.stepwise`` window it trains through)."""

    kind: str
    k: int = 0
    jagg: int | None = None
    first_order: bool = False    # +jaggWfo: rollout_cache="first_order" (the later minibatches served off-policy)

    @property
    def decoupled(self) -> bool:
        """DiffusionNFT / AWM: ODE rollout, forward-process timesteps, no log-probabilities."""
        return self.kind in DECOUPLED

    @property
    def name(self) -> str:
        base = {"exact": "exact", "dance": "dance"}.get(self.kind, f"{self.kind}{self.k}")
        return base + (f"+jagg{self.jagg}" + ("fo" if self.first_order else "") if self.jagg else "")

    def validate(self, num_steps: int) -> "Schedule":
        trained = num_steps - 1
        if self.kind not in KINDS:
            raise JaggInputError(f"schedule {self.kind!r}: use one of {KINDS}")
        if self.kind == "fast" and not 1 <= self.k <= early_range(num_steps):
            raise JaggInputError(f"{self.name}: k={self.k} must be in 1..{early_range(num_steps)} (the early "
                                 f"range [0, T // 2) of T={num_steps} steps)")
        if self.kind == "mix" and not 1 <= self.k <= trained:
            raise JaggInputError(f"{self.name}: window {self.k} must be in 1..{trained}")
        if self.kind in DECOUPLED and not 1 <= self.k <= trained:
            raise JaggInputError(f"{self.name}: {self.k} timesteps per sample must be in 1..{trained}")
        if self.kind in DECOUPLED and self.jagg is not None:
            raise JaggInputError(f"{self.name}: {self.kind} trains forward-process timesteps, not a trajectory's "
                                 "steps: JAGG does not apply to it")
        if self.jagg is not None and self.jagg < 2:
            raise JaggInputError(f"{self.name}: a JAGG window needs >= 2 steps")
        return self

    def sde_steps(self, num_steps: int, iteration: int, seed: int) -> tuple[int, ...]:
        """The steps the rollout of ``iteration`` samples by the SDE (sorted)."""
        if self.kind in ("exact", "dance"):
            return tuple(range(num_steps))
        if self.kind in DECOUPLED:
            return ()
        return tuple(sorted(self._window(num_steps, iteration, seed)))

    def train_steps(self, num_steps: int, iteration: int, seed: int) -> tuple[int, ...]:
        """The steps ``iteration`` trains, in the order the peer's loop visits them (decoupled: the
        ``k`` timestep slots; each sample draws its own grid step per slot, ``decoupled.py``)."""
        trained = num_steps - 1
        if self.kind in DECOUPLED:
            return tuple(range(self.k))
        if self.kind == "exact":
            return tuple(range(trained))
        if self.kind == "dance":
            perm = torch.randperm(trained, generator=_generator(seed, iteration, 3)).tolist()
            return tuple(perm[:max(1, int(trained * DANCE_FRACTION))])
        return tuple(self._window(num_steps, iteration, seed))

    def _window(self, num_steps: int, iteration: int, seed: int) -> range:
        trained = num_steps - 1
        if self.kind == "fast":
            hi = early_range(num_steps)
            start = int(torch.randint(0, hi - self.k + 1, (), generator=_generator(seed, iteration, 5)))
            return range(start, start + self.k)
        cur = min(iteration // MIX_SHIFT_INTERVAL, trained - 1)
        return range(cur, min(cur + self.k, trained))


def early_range(num_steps: int) -> int:
    """The end (exclusive) of Flow-GRPO-Fast's SDE window range: the first half of the trajectory."""
    return max(1, num_steps // 2)


def _generator(seed: int, iteration: int, purpose: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003) + iteration) * 16 + purpose)


def parse_schedule(name: str) -> Schedule:
    """``exact``, ``dance``, ``fastK``, ``mixW``, each optionally ``+jaggW`` (e.g. ``fast4+jagg4``) or
    ``+jaggWfo`` (with off-policy serving: ``rollout_cache="first_order"``)."""
    base, _, jagg = name.partition("+")
    window, first_order = None, jagg.endswith("fo")
    if jagg:
        digits = jagg[4:-2] if first_order else jagg[4:]
        if not jagg.startswith("jagg") or not digits.isdigit():
            raise JaggInputError(f"schedule {name!r}: the composition is written +jaggW or +jaggWfo, e.g. fast4+jagg4")
        window = int(digits)
    for kind in ("fast", "mix", "nft", "awm"):
        if base.startswith(kind) and base[len(kind):].isdigit():
            return Schedule(kind, int(base[len(kind):]), window, first_order)
    if base in ("exact", "dance"):
        return Schedule(base, 0, window, first_order)
    raise JaggInputError(f"schedule {name!r}: use exact, dance, fastK or mixW, optionally +jaggW or +jaggWfo; "
                         f"or nftK / awmK")


DEFAULT_SCHEDULES = ("exact", "exact+jagg4", "fast1", "fast2", "fast4", "fast4+jagg4", "mix4", "mix4+jagg4",
                     "dance", "dance+jagg4")

WIDE_SCHEDULES = ("exact", "fast1", "fast2", "fast4", "fast4+jagg4", "mix4", "mix4+jagg4", "dance", "nft2", "awm2")

__all__ = ["DANCE_FRACTION", "DECOUPLED", "WIDE_SCHEDULES", "DEFAULT_SCHEDULES", "KINDS", "MIX_SHIFT_INTERVAL", "Schedule", "early_range",
           "parse_schedule"]
