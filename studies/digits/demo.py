"""``jaggc demo``: GRPO on the pretrained digits DiT with four strategies, side by side.

The task: **bold digits**. The reward (``rewards.bold_reward``, in [0, 1]) is p(target digit) under a
trained classifier times a sigmoid of the image's ink, centred above the ink of any digit in the
data set; the shipped base scores about 0.02 on it, so GRPO has something visible to learn (heavier
strokes that still read as the right digit).

Each strategy (exact, dance, mix, jagg) trains its own copy of the same pretrained base with the
same rollout seeds. The strategies run **interleaved**, one iteration each in turn (the order
rotating every iteration), so a change in machine load hits them all alike; each iteration is timed
in wall-clock and in process CPU time. Reported per strategy: the evaluation reward before and after
(SDE samples of every digit from fixed seeds: the sampler GRPO optimises; ODE samples and the
held-out classifier below the table), wall and CPU seconds of training (rollout + reward + optimizer
steps), DiT backward passes per iteration, and the cosine of the strategy's gradient estimator to
the exact gradient at the base, on one held-out rollout minibatch. ``seeds > 1`` repeats the whole
run with other rollout seeds and reports means with their spread. With the defaults it finishes in
a few minutes on 2 CPU cores; ``out`` receives the sample grids and reward curves (``demo_plots``).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from jaggc.errors import JaggInputError

from jaggc_studies.digits.sampling import sample_ode
from jaggc_studies.digits.trainer import STRATEGIES, GRPOTrainer, TrainerConfig, evaluate_rewards, strategy_gradient, take_samples

HELD_OUT_SEED = 999_983  # rollout seed of the gradient-comparison batch, never used in training
GRID_SEED = 4242         # noise of the sample grids (the same for every strategy and the base)
GUARD_BLOCK = 16         # the demo's guard judges bias over blocks of 16 probes (a 40-iteration run has few)
SUMMARY_KEYS = ("reward_start", "reward_end", "wall_s", "cpu_s", "backward_passes", "grad_cosine")


@dataclass(frozen=True)
class DemoOptions:
    iterations: int = 40
    seed: int = 0
    seeds: int = 1                # repeat with seeds seed, seed+1, ...; spread reported when > 1
    reward: str = "bold"
    window: int = 4
    weights: str = "t"
    jagg_frac: float = 1.0
    rollout_cache: bool = True    # jagg: the first minibatch's interior outputs from the rollout
    num_steps: int = 10
    strategies: tuple = STRATEGIES
    base: str = "pretrained"      # "random": an untrained DiT (smoke runs); or a checkpoint path
    eval_per_class: int = 16
    classes_per_iter: int = 2
    group_size: int = 16
    lr: float = 3e-4
    progress: bool = True
    out: str | None = "jaggc-demo"   # folder for the PNGs; None: no pictures
    guard: int = 0                # jagg: Guard(every=guard, on_drift="warn", probes=GUARD_BLOCK); 0: none

    def validate(self) -> "DemoOptions":
        for name in ("iterations", "seeds", "eval_per_class"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise JaggInputError(f"--{name.replace('_', '-')} {value!r}: must be an int >= 1")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise JaggInputError(f"--strategies {list(self.strategies)}: choose from {list(STRATEGIES)}")
        if "exact" not in self.strategies:
            raise JaggInputError("--strategies must include 'exact': the gradient cosine is measured against it")
        if self.base not in ("pretrained", "random") and not os.path.isfile(self.base):
            raise JaggInputError(f"--base {self.base!r}: use 'pretrained', 'random' or the path of a "
                                 f"base checkpoint file")
        for name in self.strategies:
            self.trainer_config(name).validate()
        if not isinstance(self.guard, int) or self.guard < 0:
            raise JaggInputError(f"--guard {self.guard!r}: probe one call in EVERY, an int >= 1 (0: no guard)")
        if self.guard and "jagg" not in self.strategies:
            raise JaggInputError("--guard guards the jagg strategy: add jagg to --strategies")
        return self

    def trainer_config(self, strategy: str, seed: int | None = None) -> TrainerConfig:
        return TrainerConfig(strategy=strategy, num_steps=self.num_steps, window=self.window,
                             weights=self.weights, jagg_frac=self.jagg_frac, rollout_cache=self.rollout_cache,
                             reward=self.reward, seed=self.seed if seed is None else seed,
                             classes_per_iter=self.classes_per_iter, group_size=self.group_size, lr=self.lr)

    def jagg_settings(self) -> str:
        cache = ("rollout cache on (the first minibatch's interior outputs come from the rollout)"
                 if self.rollout_cache else "no rollout cache")
        return (f"window {self.window}, weights {self.weights!r}, jagg_frac {self.jagg_frac:g}, one joint backward "
                f"per loss call, {cache}")


def load_start_model(base: str) -> torch.nn.Module:
    """``"pretrained"``: the shipped base; ``"random"``: an untrained DiT; else a checkpoint path
    in the shipped format (e.g. written by ``python -m jaggc_studies.digits.train_base --out PATH``)."""
    from jaggc_studies.digits.model import build_dit, load_base

    if base == "random":
        return build_dit(seed=0)
    return load_base() if base == "pretrained" else load_base(base)


def reward_functions(reward: str) -> dict:
    from jaggc_studies.digits.rewards import get_reward

    fns = {"reward": get_reward(reward)}
    if reward in ("classifier", "bold"):
        # the held-out classifier: a rise in the training reward alone could be reward hacking
        fns["eval_classifier"] = get_reward("classifier_eval")
    if reward == "bold":
        from jaggc_studies.digits.rewards import ink

        fns["ink"] = lambda images, labels: ink(images)
    return fns


def gradient_cosines(models: dict, options: DemoOptions, seed: int) -> tuple[dict, dict]:
    """Each strategy's gradient estimator at the base model (its own copy, so the loss compiled here
    is the one its training reuses) on one held-out rollout minibatch, cosine to the exact gradient."""
    exact_cfg = options.trainer_config("exact", seed)
    collector = GRPOTrainer(models["exact"], replace(exact_cfg, seed=HELD_OUT_SEED))
    batch = collector.collect(0)
    size = batch["latents"].shape[0]
    order = torch.randperm(size, generator=torch.Generator().manual_seed(HELD_OUT_SEED))
    batch = take_samples(batch, order[:size // exact_cfg.minibatches])
    grads, timings = {}, {}
    for name, model in models.items():
        start = time.perf_counter()
        grads[name] = strategy_gradient(model, batch, options.trainer_config(name, seed), iteration=0)
        timings[name] = time.perf_counter() - start
    exact = grads["exact"].double()
    cosines = {name: float(torch.nn.functional.cosine_similarity(g.double(), exact, 0)) for name, g in grads.items()}
    return cosines, timings


@torch.no_grad()
def grid_samples(dit, config: TrainerConfig, per_class: int = 4) -> torch.Tensor:
    """ODE samples of every digit from fixed noise, (10 * per_class, 1, 8, 8): the deterministic
    sampler shows the drawings without the SDE's last-step noise (the rewards report both)."""
    labels = torch.arange(10).repeat_interleave(per_class)
    return sample_ode(dit, labels, num_steps=config.num_steps, shift=config.shift,
                      generator=torch.Generator().manual_seed(GRID_SEED)).clamp(-1, 1)


def run_seed(base: torch.nn.Module, options: DemoOptions, seed: int, start_eval: dict, reward_fns: dict) -> dict:
    """Train every strategy from ``base`` with rollout seed ``seed``, interleaved; per-strategy results."""
    from tqdm.auto import tqdm

    models = {name: copy.deepcopy(base) for name in options.strategies}
    cosines, first_grad_s = gradient_cosines(models, options, seed)
    guards = {}
    if options.guard and "jagg" in options.strategies:
        import jaggc

        guards["jagg"] = jaggc.Guard(every=options.guard, on_drift="warn", probes=GUARD_BLOCK)
    trainers = {name: GRPOTrainer(models[name], options.trainer_config(name, seed), reward_fn=reward_fns["reward"],
                                  guard=guards.get(name))
                for name in options.strategies}
    guard_curves = {name: [] for name in guards}
    names = list(options.strategies)
    bar = tqdm(range(options.iterations), desc=f"seed {seed}", disable=None if options.progress else True)
    for i in bar:
        for name in names[i % len(names):] + names[:i % len(names)]:   # rotate: no strategy always runs first
            trainers[name].step()
            if name in guards:
                guard_curves[name].append(dict(iteration=i, **guards[name].log()))
        bar.set_postfix({n: f"{trainers[n].history[-1]['reward_mean']:.2f}" for n in names})
    eval_kw = dict(config=options.trainer_config("exact", seed), per_class=options.eval_per_class)
    results = {}
    for name in names:
        end_eval = evaluate_rewards(models[name], reward_fns, **eval_kw)
        history = trainers[name].history
        results[name] = dict(
            reward_start=start_eval["reward"], reward_end=end_eval["reward"],
            wall_s=sum(h["wall_s"] for h in history), cpu_s=sum(h["cpu_s"] for h in history),
            backward_passes=sum(h["backward_passes"] for h in history) / len(history),
            grad_cosine=cosines[name],
            eval_start={k: v for k, v in start_eval.items() if k != "reward"},
            eval_end={k: v for k, v in end_eval.items() if k != "reward"},
            rollout_reward=[h["reward_mean"] for h in history],
            cpu_curve=list(itertools.accumulate(h["cpu_s"] for h in history)),
            wall_curve=list(itertools.accumulate(h["wall_s"] for h in history)),
            cache_hits=sum(h["cache_hits"] for h in history),
            clipfrac=[h["clipfrac"] for h in history], approx_kl=[h["approx_kl"] for h in history],
            train_steps=[h["train_steps"] for h in history],
            first_gradient_s=first_grad_s[name])
        if name in guards:
            results[name]["guard_curve"] = guard_curves[name]
            results[name]["guard_summary"] = guards[name].summary()
        results[name]["_samples"] = grid_samples(models[name], options.trainer_config(name, seed))
    return results


def combine_seeds(per_seed: list[dict]) -> dict:
    """One entry per strategy: the summary keys' means over seeds (the values themselves for one
    seed), their [min, max] and the per-seed values when there are several seeds."""
    out = {}
    for name in per_seed[0]:
        runs = [r[name] for r in per_seed]
        entry = {k: v for k, v in runs[0].items() if not k.startswith("_")}
        if len(runs) > 1:
            for key in SUMMARY_KEYS:
                values = [r[key] for r in runs]
                entry[key] = statistics.fmean(values)
                entry.setdefault("spread", {})[key] = [min(values), max(values)]
                entry.setdefault("per_seed", {})[key] = values
            entry["rollout_reward"] = [statistics.fmean(v) for v in zip(*(r["rollout_reward"] for r in runs))]
            entry["cpu_curve"] = [statistics.fmean(v) for v in zip(*(r["cpu_curve"] for r in runs))]
            entry["wall_curve"] = [statistics.fmean(v) for v in zip(*(r["wall_curve"] for r in runs))]
        out[name] = entry
    if "exact" in out:
        for entry in out.values():
            entry["cpu_vs_exact"] = entry["cpu_s"] / out["exact"]["cpu_s"]
            entry["wall_vs_exact"] = entry["wall_s"] / out["exact"]["wall_s"]
    return out


def run_demo(options: DemoOptions) -> dict:
    """Train every strategy from the base for every seed; returns the JSON-able results (and,
    under the private key ``_pictures``, the images and curves the plots need)."""
    options.validate()
    base = load_start_model(options.base)
    reward_fns = reward_functions(options.reward)
    start_eval = evaluate_rewards(base, reward_fns, config=options.trainer_config("exact"),
                                  per_class=options.eval_per_class)
    per_seed = [run_seed(base, options, options.seed + k, start_eval, reward_fns) for k in range(options.seeds)]
    strategies = combine_seeds(per_seed)
    return dict(
        strategies=strategies, options=_jsonable(asdict(options)), jagg_settings=options.jagg_settings(),
        seeds=[options.seed + k for k in range(options.seeds)], threads=torch.get_num_threads(),
        notes=["wall_s / cpu_s: rollout + reward + optimizer steps of all iterations, strategies interleaved "
               "iteration by iteration; cpu_s is process CPU time; a compiled strategy's one-time compile "
               "happens in the gradient comparison first (first_gradient_s)",
               "reward_start/end: mean reward of SDE samples (the trainer's sampler, what GRPO optimises) of "
               "every digit from fixed seeds; eval_start/end add the held-out classifier, the ink and ODE "
               "samples (suffix _ode)",
               "grad_cosine: at the base model, one held-out rollout minibatch, vs the exact gradient; "
               "dance/mix use their iteration-0 step subset"],
        _pictures=dict(base=grid_samples(base, options.trainer_config("exact")),
                       after={n: per_seed[0][n]["_samples"] for n in options.strategies}))


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=list))


def format_table(result: dict) -> str:
    multi = len(result.get("seeds", [0])) > 1
    rows = ["| strategy | reward before → after | CPU s (× exact) | wall s | DiT backward passes / iter "
            "| grad cosine vs exact |",
            "|---|---|---|---|---|---|"]
    for name, r in result["strategies"].items():
        end = f"{r['reward_end']:.3f}"
        if multi:
            lo, hi = r["spread"]["reward_end"]
            end += f" [{lo:.3f}–{hi:.3f}]"
        rows.append(f"| {name} | {r['reward_start']:.3f} → {end} | {r['cpu_s']:.1f} ({r['cpu_vs_exact']:.2f}) | "
                    f"{r['wall_s']:.1f} | {r['backward_passes']:.1f} | {r['grad_cosine']:.3f} |")
    extra = []
    for name, r in result["strategies"].items():
        extra.append(f"  {name}: " + ", ".join(f"{key} {before:.3f} → {r['eval_end'][key]:.3f}"
                                                  for key, before in r["eval_start"].items()))
    return "\n".join(rows + [""] + ["other evaluations of the first seed (before → after; _ode: ODE samples, "
                                    "eval_classifier: the held-out classifier, ink: mean pixel intensity):"] + extra)


def main_demo(options: DemoOptions, json_path: str | None = None) -> dict:
    start = time.perf_counter()
    result = run_demo(options)
    result["total_s"] = time.perf_counter() - start
    pictures = result.pop("_pictures")
    opts = result["options"]
    seeds = result["seeds"]
    print(f"\nGRPO on the digits DiT ({options.base} base, reward {options.reward}, {options.iterations} "
          f"iterations x {len(seeds)} seed(s) {seeds}, T={options.num_steps} sampling steps, "
          f"{opts['classes_per_iter']}x{opts['group_size']} samples per rollout, lr {options.lr:g}; "
          f"{result['threads']} thread(s), {result['total_s']:.0f} s total)")
    print(f"jagg: {result['jagg_settings']}\n")
    print(format_table(result))
    for name, entry in result["strategies"].items():
        if "guard_summary" in entry:
            print(f"\n{name} (seed {seeds[0]}): {entry['guard_summary']}")
    written = []
    if options.out:
        from jaggc_studies.digits.demo_plots import write_pictures

        written = write_pictures(result, pictures, options.out)
        result["pictures"] = written
    if json_path:
        from jaggc_studies.digits.demo_plots import write_results_json

        write_results_json(result, json_path)
        written.append(json_path)
    if written:
        print("\nwrote " + "\n      ".join(written))
    return result


__all__ = ["DemoOptions", "combine_seeds", "format_table", "gradient_cosines", "grid_samples", "load_start_model",
           "main_demo", "reward_functions", "run_demo", "run_seed"]
