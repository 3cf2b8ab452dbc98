"""``jaggc demo``: GRPO on the pretrained digits DiT with four strategies, side by side.

Each strategy (exact, dance, mix, jagg) starts from the same pretrained base and trains for a few
iterations with the same rollout seeds. The table reports, per strategy: the evaluation reward
before and after (SDE samples of every digit from fixed seeds, the sampler GRPO optimises; ODE
samples and the held-out classifier are reported below the table), the training
wall-clock, the DiT backward passes per iteration, and the cosine of the strategy's gradient
estimator to the exact gradient, each computed once at the base model on the same held-out
rollout batch (how well the strategy's one-iteration update points where the full per-step
gradient points). With the defaults it finishes in under 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass, replace

import torch

from jaggc.errors import JaggInputError

from .trainer import STRATEGIES, GRPOTrainer, TrainerConfig, evaluate_rewards, strategy_gradient, take_samples

HELD_OUT_SEED = 999_983  # rollout seed of the gradient-comparison batch, never used in training


@dataclass(frozen=True)
class DemoOptions:
    iterations: int = 20
    seed: int = 0
    reward: str = "classifier"
    window: int = 4
    weights: str = "t"
    jagg_frac: float = 1.0
    num_steps: int = 10
    strategies: tuple = STRATEGIES
    base: str = "pretrained"      # "random": an untrained DiT (smoke runs); or a checkpoint path
    eval_per_class: int = 16
    classes_per_iter: int = 2
    group_size: int = 16
    lr: float = 1e-4
    progress: bool = True

    def validate(self) -> "DemoOptions":
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise JaggInputError(f"--iterations {self.iterations!r}: must be an int >= 1")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise JaggInputError(f"--strategies {list(self.strategies)}: choose from {list(STRATEGIES)}")
        if "exact" not in self.strategies:
            raise JaggInputError("--strategies must include 'exact': the gradient cosine is measured against it")
        if self.base not in ("pretrained", "random") and not os.path.isfile(self.base):
            raise JaggInputError(f"--base {self.base!r}: use 'pretrained', 'random' or the path of a "
                                 f"base checkpoint file")
        if self.eval_per_class < 1:
            raise JaggInputError(f"--eval-per-class {self.eval_per_class}: must be >= 1")
        for name in self.strategies:
            self.trainer_config(name).validate()
        return self

    def trainer_config(self, strategy: str) -> TrainerConfig:
        return TrainerConfig(strategy=strategy, num_steps=self.num_steps, window=self.window,
                             weights=self.weights, jagg_frac=self.jagg_frac, reward=self.reward,
                             seed=self.seed, classes_per_iter=self.classes_per_iter,
                             group_size=self.group_size, lr=self.lr)


def load_start_model(base: str) -> torch.nn.Module:
    """``"pretrained"``: the shipped base; ``"random"``: an untrained DiT; else a checkpoint path
    in the shipped format (e.g. written by ``python -m jaggc.digits.train_base --out PATH``)."""
    from .model import build_dit, load_base

    if base == "random":
        return build_dit(seed=0)
    return load_base() if base == "pretrained" else load_base(base)


def reward_functions(reward: str) -> dict:
    from .rewards import get_reward

    fns = {"reward": get_reward(reward)}
    if reward == "classifier":
        # the held-out classifier: a rise in the training reward alone could be reward hacking
        fns["eval_classifier"] = get_reward("classifier_eval")
    return fns


def gradient_cosines(base: torch.nn.Module, options: DemoOptions) -> tuple[dict, dict]:
    """Each strategy's gradient estimator at the base model on one held-out rollout batch,
    cosine to the exact gradient. The batch has the trainer's minibatch shape, so the jagg
    loss compiled here is the one training reuses (no second Dynamo compile)."""
    exact_cfg = options.trainer_config("exact")
    collector = GRPOTrainer(base, replace(exact_cfg, seed=HELD_OUT_SEED))
    batch = collector.collect(0)
    size = batch["latents"].shape[0]
    order = torch.randperm(size, generator=torch.Generator().manual_seed(HELD_OUT_SEED))
    batch = take_samples(batch, order[:size // exact_cfg.minibatches])
    grads, timings = {}, {}
    for name in options.strategies:
        start = time.perf_counter()
        grads[name] = strategy_gradient(base, batch, options.trainer_config(name), iteration=0)
        timings[name] = time.perf_counter() - start
    exact = grads["exact"].double()
    cosines = {name: float(torch.nn.functional.cosine_similarity(g.double(), exact, 0)) for name, g in grads.items()}
    return cosines, timings


def run_demo(options: DemoOptions) -> dict:
    """Train every strategy from the base; returns the JSON-able results."""
    options.validate()
    from tqdm.auto import tqdm

    # One module object, reset to the base weights before each strategy: a jagg-compiled loss is
    # bound to the module it was first captured with, so the gradient comparison and the jagg
    # training share one compile only if they share the module.
    dit = load_start_model(options.base)
    base_state = copy.deepcopy(dit.state_dict())
    reward_fns = reward_functions(options.reward)
    eval_kw = dict(config=options.trainer_config("exact"), per_class=options.eval_per_class)
    start_eval = evaluate_rewards(dit, reward_fns, **eval_kw)
    cosines, first_grad_s = gradient_cosines(dit, options)
    results = {}
    for name in options.strategies:
        dit.load_state_dict(base_state)
        trainer = GRPOTrainer(dit, options.trainer_config(name), reward_fn=reward_fns["reward"])
        bar = tqdm(range(options.iterations), desc=f"{name:>5}", disable=not options.progress, leave=True)
        for _ in bar:
            log = trainer.step()
            bar.set_postfix(reward=f"{log['reward_mean']:.3f}", bwd=log["backward_passes"])
        end_eval = evaluate_rewards(dit, reward_fns, **eval_kw)
        history = trainer.history
        results[name] = dict(
            reward_start=start_eval["reward"], reward_end=end_eval["reward"],
            wall_s=sum(h["wall_s"] for h in history),
            backward_passes=sum(h["backward_passes"] for h in history) / len(history),
            grad_cosine=cosines[name],
            eval_start={k: v for k, v in start_eval.items() if k != "reward"},
            eval_end={k: v for k, v in end_eval.items() if k != "reward"},
            rollout_reward=[h["reward_mean"] for h in history],
            clipfrac=[h["clipfrac"] for h in history], approx_kl=[h["approx_kl"] for h in history],
            train_steps=[h["train_steps"] for h in history],
            first_gradient_s=first_grad_s[name])
    return dict(strategies=results, options=_jsonable(asdict(options)), threads=torch.get_num_threads(),
                notes=["wall_s: rollout + reward + optimizer steps of all iterations; jagg's one-time "
                       "Dynamo compile happens in the gradient comparison first (first_gradient_s)",
                       "reward_start/end: mean reward of SDE samples (the trainer's sampler, what GRPO "
                "optimises) of every digit from fixed seeds; eval_start/end add the held-out "
                "classifier and ODE samples (suffix _ode)",
                       "grad_cosine: at the base model, one held-out rollout minibatch, vs the exact "
                       "gradient; dance/mix use their iteration-0 step subset"])


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=list))


def format_table(result: dict) -> str:
    rows = ["| strategy | reward before → after | wall-clock (s) | DiT backward passes / iter "
            "| grad cosine vs exact |",
            "|---|---|---|---|---|"]
    for name, r in result["strategies"].items():
        rows.append(f"| {name} | {r['reward_start']:.4g} → {r['reward_end']:.4g} | {r['wall_s']:.1f} | "
                    f"{r['backward_passes']:.1f} | {r['grad_cosine']:.3f} |")
    extra = []
    for name, r in result["strategies"].items():
        for key, before in r["eval_start"].items():
            extra.append(f"  {name}: {key} {before:.4f} → {r['eval_end'][key]:.4f}")
    return "\n".join(rows + ([""] + ["other evaluations (before → after; _ode: ODE samples, "
                                     "eval_classifier: the held-out classifier):"] + extra if extra else []))


def main_demo(options: DemoOptions, json_path: str | None = None) -> dict:
    start = time.perf_counter()
    result = run_demo(options)
    result["total_s"] = time.perf_counter() - start
    opts = result["options"]
    print(f"\nGRPO on the digits DiT ({options.base} base, reward {options.reward}, {options.iterations} "
          f"iterations, T={options.num_steps} sampling steps, {opts['classes_per_iter']}x{opts['group_size']} "
          f"samples per rollout, jagg W={options.window} weights={options.weights}; "
          f"{result['threads']} threads, {result['total_s']:.0f} s total)\n")
    print(format_table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {json_path}")
    return result


__all__ = ["DemoOptions", "format_table", "gradient_cosines", "load_start_model", "main_demo", "reward_functions",
           "run_demo"]
