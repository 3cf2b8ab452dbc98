"""A Flow-GRPO trainer for the digits DiT whose strategies differ only in which steps the one GRPO
loss trains and whether it runs through ``@jagg_compile``.

Per iteration (yifan123/flow_grpo scripts/train_sd3.py, reduced to what the digits need):
1. rollout, no grad: for ``classes_per_iter`` random classes, ``group_size`` samples each, run T
   Flow-GRPO SDE steps (``jaggc.grpo.flow_grpo_sde_step``) and store every state, next state,
   log-prob and timestep;
2. reward the final images, advantages normalised within each class group;
3. split the rollout into ``minibatches`` shuffled chunks and take one AdamW step per chunk on the
   PPO clipped-ratio loss (the first chunk is on-policy, later ones are slightly off-policy, as in
   Flow-GRPO where one rollout feeds several optimizer steps).

Strategies (all use ``grpo_loss`` below, unchanged):
- ``exact``: every trained step. Like Flow-GRPO, the last step (sigma -> 0) is sampled but not
  trained, so T sampling steps give T-1 trained steps.
- ``dance``: a random 60% of the trained steps each iteration (DanceGRPO's timestep_fraction).
- ``mix``: a 4-step window that slides one step per iteration along the trajectory and wraps
  around (MixGRPO's sliding window; MixGRPO also samples with the ODE outside the window, which we
  do not: all strategies share the same SDE rollout so their rewards are comparable; the
  ``jaggc_studies.fewsteps`` schedules sample as MixGRPO and Flow-GRPO-Fast do, through ``sde_steps``).
- ``jagg``: ``jaggc.jagg_compile(grpo_loss, window=W, weights=..., routing=Routing(jagg_frac=...))`` over every
  trained step; with ``rollout_cache=True`` the rollout is recorded in a ``jaggc.RolloutCache``, so
  on the first minibatch (parameters still the rollout's) the windows' interior outputs come from
  the rollout instead of a forward; after the first optimizer step the cache's parameter-version
  guard drops it and the interior forwards run again.
Trained parameters: the attention projections (Flow-GRPO's LoRA targets, here at full rank) by
default, every parameter with ``trainable="all"`` (``trainable_parameters`` says why not the
default). No KL-to-reference term (Flow-GRPO's beta is 0 in several of its configs; it would add
one no-grad reference forward per step and a frozen copy of the DiT).
"""

from __future__ import annotations

import contextlib
import re
import time
import weakref
from dataclasses import dataclass, field

import torch

from jaggc import grpo
from jaggc.errors import JaggInputError
from jaggc_studies.example_losses import sde_step_with_logprob
from jaggc.runtime import count_dit_passes

from jaggc_studies.digits.data import IMAGE_SHAPE
from jaggc_studies.digits.model import class_conditioning
from jaggc_studies.digits.sampling import sample_ode

STRATEGIES = ("exact", "dance", "mix", "jagg")
TRAINABLE = ("attention", "all", "lora", "blocks")
LORA_RANK = 8
# Flow-GRPO's LoRA target modules on SD3 (scripts/train_sd3.py), here trained at full rank
_BLOCKS = re.compile(r"\.(single_)?transformer_blocks\.")     # trainable="blocks"
_ATTENTION_PROJECTIONS = re.compile(
    r"\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)\.")


@dataclass(frozen=True)
class TrainerConfig:
    strategy: str = "exact"
    num_steps: int = 10          # T SDE sampling steps; steps 0..T-2 are trained
    shift: float = 3.0           # SD3's flow-matching schedule shift
    noise_level: float = 0.7     # Flow-GRPO's SDE noise level a
    classes_per_iter: int = 2    # prompts per rollout
    group_size: int = 16         # samples per prompt (the GRPO group)
    minibatches: int = 2         # optimizer steps per rollout (Flow-GRPO takes 2 per epoch)
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0   # Flow-GRPO's gradient clipping
    clip_range: float = 1e-2     # PPO epsilon (Flow-GRPO SD3: 1e-4; the JAGG author: 0.1)
    adv_clip_max: float = 5.0
    global_std: bool = True      # Flow-GRPO's default: std over the whole batch
    dance_frac: float = 0.6
    mix_window: int = 4
    window: int = 4              # JAGG window W
    weights: str = "t"
    jagg_frac: float = 1.0
    rollout_cache: bool = False  # jagg: interior outputs of the first minibatch from the rollout
    trainable: str = "attention"  # or "all" (see trainable_parameters)
    reward: str = "classifier"
    seed: int = 0

    def validate(self) -> "TrainerConfig":
        if self.strategy not in STRATEGIES:
            raise JaggInputError(f"strategy={self.strategy!r}: use one of {STRATEGIES}")
        for name in ("num_steps", "classes_per_iter", "group_size", "minibatches", "mix_window", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise JaggInputError(f"{name}={value!r}: must be an int >= 1")
        if self.num_steps < 3:
            raise JaggInputError(f"num_steps={self.num_steps}: need >= 3 sampling steps (the last one is "
                                 f"not trained, and a JAGG window needs >= 2 trained steps)")
        if self.group_size < 2:
            raise JaggInputError(f"group_size={self.group_size}: a GRPO group needs >= 2 samples per prompt")
        if not 1 <= self.classes_per_iter <= 10:
            raise JaggInputError(f"classes_per_iter={self.classes_per_iter}: must be in 1..10 (digits)")
        if (self.classes_per_iter * self.group_size) % self.minibatches:
            raise JaggInputError(f"minibatches={self.minibatches} must divide the rollout batch "
                                 f"classes_per_iter*group_size={self.classes_per_iter * self.group_size}")
        if self.trainable not in TRAINABLE:
            raise JaggInputError(f"trainable={self.trainable!r}: use one of {TRAINABLE}")
        if not 0 < self.dance_frac <= 1:
            raise JaggInputError(f"dance_frac={self.dance_frac}: must be in (0, 1]")
        trained = self.num_steps - 1
        if self.strategy == "mix" and self.mix_window > trained:
            raise JaggInputError(f"mix_window={self.mix_window} exceeds the {trained} trained steps; "
                                 f"lower it or raise num_steps")
        if self.strategy == "jagg" and not 2 <= self.window <= trained:
            raise JaggInputError(f"window={self.window}: must be in 2..{trained} (the trained steps); "
                                 f"lower the window or raise num_steps")
        return self


# ---------------------------------------------------------------------------------------------
# the GRPO loss: user code, one function for every strategy


def grpo_loss(dit, batch):
    """Flow-GRPO's training loss over the steps ``batch["train_steps"]`` of stored rollouts:
    SDE-step log-prob of each stored transition, PPO clipped ratio, mean over the trained steps
    (Flow-GRPO and DanceGRPO both divide by the number of trained steps). Returns the loss and
    the new log-probs (B, steps), detached, for the clip-fraction and KL diagnostics."""
    steps = batch["train_steps"]
    total = 0.0
    new_log_probs = []
    for j in steps:
        latents = batch["latents"][:, j]
        noise_pred = dit(hidden_states=latents, timestep=batch["timesteps"][:, j],
                         encoder_hidden_states=batch["prompt_embeds"],
                         pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
        _, log_prob, _, _ = sde_step_with_logprob(
            noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
            batch["next_latents"][:, j], batch["sigma_max"], noise_level=batch["noise_level"])
        advantages = torch.clamp(batch["advantages"], -batch["adv_clip_max"], batch["adv_clip_max"])
        ratio = torch.exp(log_prob - batch["log_probs"][:, j])
        unclipped_loss = -advantages * ratio
        clipped_loss = -advantages * torch.clamp(ratio, 1.0 - batch["clip_range"], 1.0 + batch["clip_range"])
        total = total + torch.mean(torch.maximum(unclipped_loss, clipped_loss))
        new_log_probs.append(log_prob.detach())
    return total / len(steps), torch.stack(new_log_probs, 1)


# dit -> {(window, weights, jagg_frac, rollout_cache): compiled loss}; dit -> its rollout cache
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_ROLLOUT_CACHES: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def rollout_cache_for(dit: torch.nn.Module):
    """The one ``jaggc.RolloutCache`` of ``dit``: the trainer records into it, the compiled loss reads it."""
    if dit not in _ROLLOUT_CACHES:
        from jaggc import RolloutCache

        _ROLLOUT_CACHES[dit] = RolloutCache(dit)
    return _ROLLOUT_CACHES[dit]


def loss_for_strategy(config: TrainerConfig, dit: torch.nn.Module, guard=None):
    """``grpo_loss`` itself, or (jagg) its ``jagg_compile`` wrapper for ``dit``.

    One compiled wrapper per DiT module object: a wrapper whose Dynamo graph was captured with
    one module silently keeps calling that module when handed another one of the same class
    (measured with torch 2.13: the loss value and the gradient belong to the first module).
    Wrappers are reused per module because each new one is another Dynamo graph of the same
    code object, and Dynamo caps those (recompile_limit)."""
    if config.strategy != "jagg":
        return grpo_loss
    import jaggc

    if guard is not None:        # a guard belongs to one run: its own wrapper (jaggc.Guard)
        cache = rollout_cache_for(dit) if config.rollout_cache else None
        return jaggc.jagg_compile(grpo_loss, window=config.window, weights=config.weights, guard=guard,
                                  options=jaggc.Options(rollout_cache=cache),
                                  routing=jaggc.Routing(jagg_frac=config.jagg_frac))
    per_dit = _COMPILED.setdefault(dit, {})
    key = (config.window, config.weights, float(config.jagg_frac), config.rollout_cache)
    if key not in per_dit:
        cache = rollout_cache_for(dit) if config.rollout_cache else None
        per_dit[key] = jaggc.jagg_compile(
            grpo_loss,
            window=config.window,
            weights=config.weights,
            options=jaggc.Options(rollout_cache=cache),
            routing=jaggc.Routing(jagg_frac=config.jagg_frac))
    return per_dit[key]


def select_steps(config: TrainerConfig, iteration: int) -> tuple[int, ...]:
    """The trained step indices of ``iteration`` for the config's strategy (sorted)."""
    trained = config.num_steps - 1
    if config.strategy in ("exact", "jagg"):
        return tuple(range(trained))
    if config.strategy == "dance":
        count = max(1, int(trained * config.dance_frac))
        perm = torch.randperm(trained, generator=_generator(config.seed, iteration, 3))
        return tuple(sorted(perm[:count].tolist()))
    start = iteration % (trained - config.mix_window + 1)
    return tuple(range(start, start + config.mix_window))


def trainable_parameters(dit: torch.nn.Module, trainable: str) -> list[torch.nn.Parameter]:
    """Set ``requires_grad`` for ``trainable`` and return the trained parameters.

    ``"attention"``: the attention projections only (Flow-GRPO's LoRA targets). Measured on the
    pretrained digits DiT: the full-model GRPO gradient is ~80% input patch embedding
    (``pos_embed.proj``, whose Jacobian is linear in the noisy state) and so sharp there that a
    step of norm 0.01 along it drops the reward from 0.92 to 0.68 whichever its sign, so full
    fine-tuning with Adam degrades the base within a few iterations. ``"all"``: every parameter.
    ``"lora"``: a rank-``LORA_RANK`` peft LoRA on the same projections (Flow-GRPO's recipe: Gaussian
    A, zero B, so the model is unchanged at first), injected into ``dit`` if it has none yet.
    ``"blocks"``: every parameter of the transformer blocks (attention, MLPs, their norms: full
    fine-tuning of the DiT's blocks), the input/conditioning embeddings and the output layer frozen
    (the patch embedding is the sharp direction above).
    """
    if trainable not in TRAINABLE:
        raise JaggInputError(f"trainable={trainable!r}: use one of {TRAINABLE}")
    if trainable == "lora" and not any("lora_" in name for name, _ in dit.named_parameters()):
        add_lora(dit)
    params = []
    for name, p in dit.named_parameters():
        if trainable == "lora":
            train = "lora_" in name
        elif trainable == "blocks":
            train = _BLOCKS.search("." + name) is not None
        else:
            train = trainable == "all" or _ATTENTION_PROJECTIONS.search("." + name) is not None
        p.requires_grad_(train)
        if train:
            params.append(p)
    if not params:
        raise JaggInputError(f"trainable={trainable!r} selects no parameter of {type(dit).__name__}; use 'all'")
    return params


def add_lora(dit: torch.nn.Module, rank: int = LORA_RANK, seed: int = 0) -> None:
    """Inject a peft LoRA adapter into the attention projections of ``dit`` (deterministic in ``seed``)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = [name for name, _ in dit.named_modules() if _ATTENTION_PROJECTIONS.search("." + name + ".")]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                           target_modules=targets), dit)


def _generator(seed: int, iteration: int, purpose: int) -> torch.Generator:
    # one independent, reproducible stream per (seed, iteration, purpose)
    return torch.Generator().manual_seed(((seed * 1_000_003) + iteration) * 16 + purpose)


# ---------------------------------------------------------------------------------------------
# rollout


@torch.no_grad()
def rollout(dit, labels: torch.Tensor, config: TrainerConfig, generator: torch.Generator, *,
            image_shape: tuple = IMAGE_SHAPE, conditioning=None, sde_steps=None) -> dict:
    """T Flow-GRPO SDE steps from N(0, I) for ``labels``; the stored trajectory as a loss batch
    (every sampled step; ``train_steps`` selects) plus ``images`` (the final states).
    ``image_shape`` / ``conditioning`` (labels -> DiT kwargs): the digits' unless another base's.
    ``sde_steps`` (step indices; None: all): the steps sampled by the SDE; the others take the
    deterministic Euler step (the SDE at noise level 0, as Flow-GRPO-Fast and MixGRPO sample outside
    their window), draw no noise and store a NaN log-prob (a step with no density: training one fails
    loudly)."""
    sigmas = grpo.flow_match_sigmas(config.num_steps, config.shift).to(torch.float32)
    bsz = labels.shape[0]
    cond = (conditioning or class_conditioning)(labels)
    z = torch.randn(bsz, *image_shape, generator=generator)
    states, next_states, log_probs = [], [], []
    for k in range(config.num_steps):
        s, s_next = sigmas[k].expand(bsz), sigmas[k + 1].expand(bsz)
        v = dit(hidden_states=z, timestep=1000 * s, **cond, return_dict=False)[0]
        states.append(z)
        if sde_steps is None or k in sde_steps:
            step = grpo.flow_grpo_sde_step(v, z, s, s_next, noise_level=config.noise_level,
                                           sigma_max=float(sigmas[1]), generator=generator)
            z = step.prev_sample
            log_probs.append(step.log_prob)
        else:
            z = z + (s_next - s).view(-1, *([1] * (z.ndim - 1))) * v
            log_probs.append(torch.full((bsz,), float("nan"), dtype=z.dtype))
        next_states.append(z)
    sigma_grid = sigmas[:-1].expand(bsz, -1).contiguous()
    return dict(
        latents=torch.stack(states, 1), next_latents=torch.stack(next_states, 1),
        log_probs=torch.stack(log_probs, 1), sigmas=sigma_grid,
        sigmas_next=sigmas[1:].expand(bsz, -1).contiguous(), timesteps=1000 * sigma_grid,
        sigma_max=sigmas[1].clone(), prompt_embeds=cond["encoder_hidden_states"],
        pooled_prompt_embeds=cond["pooled_projections"], labels=labels, images=z,
        noise_level=config.noise_level, clip_range=config.clip_range, adv_clip_max=config.adv_clip_max)


def take_samples(batch: dict, index: torch.Tensor) -> dict:
    """The samples ``index`` of a rollout batch (per-sample tensors sliced, the rest shared)."""
    bsz = batch["latents"].shape[0]
    return {k: (v[index] if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == bsz else v)
            for k, v in batch.items()}


def evaluate_rewards(dit, reward_fns: dict, config: TrainerConfig, *, per_class: int = 16,
                     seed: int = 12345, num_classes: int = 10, image_shape: tuple = IMAGE_SHAPE,
                     conditioning=None) -> dict[str, float]:
    """Mean of each reward in ``reward_fns`` over ``per_class`` samples of every class, drawn
    two ways from fixed seeds (so models are compared on paired noise):
    ``name``: the trainer's own SDE sampler (what GRPO optimises);
    ``name + "_ode"``: deterministic Euler-ODE samples (what Flow-GRPO evaluates with).
    ``num_classes`` / ``image_shape`` / ``conditioning``: the digits' unless another base's."""
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    sde = rollout(dit, labels, config, torch.Generator().manual_seed(seed), image_shape=image_shape,
                  conditioning=conditioning)["images"].clamp(-1, 1)
    ode = sample_ode(dit, labels, num_steps=config.num_steps, shift=config.shift,
                     generator=torch.Generator().manual_seed(seed), image_shape=image_shape,
                     conditioning=conditioning or class_conditioning).clamp(-1, 1)
    out = {}
    for name, fn in reward_fns.items():
        out[name] = float(fn(sde, labels).mean())
        out[name + "_ode"] = float(fn(ode, labels).mean())
    return out


# ---------------------------------------------------------------------------------------------
# the trainer


@dataclass
class GRPOTrainer:
    """Flow-GRPO on ``dit`` (trained in place). ``step()`` runs one iteration and returns its log.

    ``num_classes`` / ``image_shape`` / ``conditioning`` default to the digits; another base
    (e.g. ``jaggc_studies.shapes``) passes its own together with its ``reward_fn``."""

    dit: torch.nn.Module
    config: TrainerConfig = field(default_factory=TrainerConfig)
    reward_fn: object = None
    num_classes: int = 10
    image_shape: tuple = IMAGE_SHAPE
    conditioning: object = None
    guard: object = None        # jaggc.Guard for strategy "jagg": the loss probes its own fidelity

    def __post_init__(self):
        self.config.validate()
        if self.config.classes_per_iter > self.num_classes:
            raise JaggInputError(f"classes_per_iter={self.config.classes_per_iter} exceeds the "
                                 f"{self.num_classes} classes")
        if self.reward_fn is None:
            from jaggc_studies.digits.rewards import get_reward

            self.reward_fn = get_reward(self.config.reward)
        self.loss_fn = loss_for_strategy(self.config, self.dit, guard=self.guard)
        self.params = trainable_parameters(self.dit, self.config.trainable)
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        self.iteration = 0
        self.history: list[dict] = []

    def collect(self, iteration: int) -> dict:
        """Rollout + rewards + advantages of ``iteration`` (deterministic in seed and iteration)."""
        cfg = self.config
        classes = torch.randperm(self.num_classes, generator=_generator(cfg.seed, iteration, 1))[:cfg.classes_per_iter]
        labels = classes.repeat_interleave(cfg.group_size)
        with self._recording():
            batch = rollout(self.dit, labels, cfg, _generator(cfg.seed, iteration, 2), image_shape=self.image_shape,
                            conditioning=self.conditioning, sde_steps=self.sde_steps(iteration))
        rewards = self.reward_fn(batch["images"].clamp(-1, 1), labels).float()
        batch["rewards"] = rewards
        batch["advantages"] = grpo.flow_grpo_advantages(rewards, labels, global_std=cfg.global_std).float()
        return batch

    def sde_steps(self, iteration: int):
        """The steps the rollout of ``iteration`` samples by the SDE (None: all of them)."""
        return None

    def train_steps(self, iteration: int) -> tuple[int, ...]:
        """The steps ``iteration`` trains, in the order the loss visits them."""
        return select_steps(self.config, iteration)

    def _recording(self):
        if self.config.strategy == "jagg" and self.config.rollout_cache:
            return rollout_cache_for(self.dit).record()
        return contextlib.nullcontext()

    def step(self) -> dict:
        cfg = self.config
        start, cpu_start = time.perf_counter(), time.process_time()
        cache = rollout_cache_for(self.dit) if cfg.strategy == "jagg" and cfg.rollout_cache else None
        hits = cache.stats.hits if cache is not None else 0
        batch = self.collect(self.iteration)
        batch["train_steps"] = self.train_steps(self.iteration)
        rollout_s = time.perf_counter() - start
        stats = []
        with count_dit_passes(self.dit) as counts:
            for minibatch in self.minibatches(batch, self.iteration):
                stats.append(self._optimize(minibatch))
        log = dict(iteration=self.iteration, reward_mean=float(batch["rewards"].mean()),
                   reward_std=float(batch["rewards"].std()), train_steps=list(batch["train_steps"]),
                   loss=sum(s["loss"] for s in stats) / len(stats),
                   clipfrac=sum(s["clipfrac"] for s in stats) / len(stats),
                   approx_kl=sum(s["approx_kl"] for s in stats) / len(stats),
                   backward_passes=counts.backwards, rollout_s=rollout_s,
                   cache_hits=(cache.stats.hits - hits) if cache is not None else 0,
                   wall_s=time.perf_counter() - start, cpu_s=time.process_time() - cpu_start)
        self.history.append(log)
        self.iteration += 1
        return log

    def evaluate(self, reward_fns: dict, **kwargs) -> dict[str, float]:
        """``evaluate_rewards`` on this trainer's DiT, classes, image shape and conditioning."""
        return evaluate_rewards(self.dit, reward_fns, self.config, num_classes=self.num_classes,
                                image_shape=self.image_shape, conditioning=self.conditioning, **kwargs)

    def minibatches(self, batch: dict, iteration: int) -> list[dict]:
        """``batch`` shuffled into the trainer's minibatches (deterministic in seed and iteration)."""
        cfg = self.config
        order = torch.randperm(batch["latents"].shape[0], generator=_generator(cfg.seed, iteration, 4))
        return [take_samples(batch, chunk) for chunk in order.chunk(cfg.minibatches)]

    def _optimize(self, minibatch: dict) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        loss, new_log_probs = self.loss_fn(self.dit, minibatch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        old = minibatch["log_probs"][:, list(minibatch["train_steps"])]
        ratio = torch.exp(new_log_probs - old)
        clipped = (ratio - 1).abs() > self.config.clip_range   # Flow-GRPO's clipfrac
        return dict(loss=float(loss.detach()), clipfrac=float(clipped.float().mean()),
                    approx_kl=float(0.5 * ((new_log_probs - old) ** 2).mean()))


def strategy_gradient(dit, batch: dict, config: TrainerConfig, iteration: int = 0) -> torch.Tensor:
    """The flat gradient (trained parameters only) the strategy's trainer would apply on ``batch``
    at ``iteration``, before clipping: same step selection, loss scaling and (compiled) loss."""
    config.validate()
    params = trainable_parameters(dit, config.trainable)
    batch = dict(batch, train_steps=select_steps(config, iteration))
    dit.zero_grad(set_to_none=True)
    loss, _ = loss_for_strategy(config, dit)(dit, batch)
    loss.backward()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    dit.zero_grad(set_to_none=True)
    return flat


__all__ = ["STRATEGIES", "GRPOTrainer", "TrainerConfig", "evaluate_rewards", "grpo_loss", "loss_for_strategy",
           "rollout", "select_steps", "strategy_gradient", "take_samples", "trainable_parameters"]
