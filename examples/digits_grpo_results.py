"""Reward curves of GRPO on the digits DiT: exact vs DanceGRPO vs MixGRPO vs JAGG, several seeds.

    python examples/digits_grpo_results.py [--seeds 0 1 2] [--iterations 30] [--eval-every 5]

Every (strategy, seed) run starts from the same pretrained base and uses the trainer of
``jaggc.digits.trainer`` with the seed's rollouts (the same seed gives every strategy the same
classes and the same first rollout). The evaluation reward (SDE samples of every digit from fixed
seeds, the sampler GRPO optimises; ODE samples and the held-out classifier are kept in the JSON)
is measured every ``--eval-every`` iterations; wall-clock counts training only (rollout,
reward, optimizer steps), not evaluation. Writes two PNGs (reward vs iteration, reward vs
wall-clock) and the raw numbers as JSON under ``--out`` (default docs/), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from jaggc.digits.demo import DemoOptions, gradient_cosines, load_start_model, reward_functions
from jaggc.digits.trainer import STRATEGIES, GRPOTrainer, evaluate_rewards


def run_one(dit, base_state, options: DemoOptions, strategy: str, reward_fns: dict, eval_every: int) -> dict:
    """One training run; returns the evaluation curve against iteration and training wall-clock."""
    dit.load_state_dict(base_state)
    trainer = GRPOTrainer(dit, options.trainer_config(strategy), reward_fn=reward_fns["reward"])
    eval_kw = dict(config=options.trainer_config("exact"), per_class=options.eval_per_class)
    curve = [dict(iteration=0, wall_s=0.0, **evaluate_rewards(dit, reward_fns, **eval_kw))]
    wall = 0.0
    for it in range(1, options.iterations + 1):
        log = trainer.step()
        wall += log["wall_s"]
        if it % eval_every == 0 or it == options.iterations:
            curve.append(dict(iteration=it, wall_s=wall, **evaluate_rewards(dit, reward_fns, **eval_kw)))
    return dict(curve=curve, history=trainer.history,
                backward_passes=sum(h["backward_passes"] for h in trainer.history) / len(trainer.history))


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def plot(results: dict, out: Path, reward_name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x_key, x_label, fname in (("iteration", "GRPO iteration", "digits_grpo_reward_vs_iteration.png"),
                                  ("wall_s", "training wall-clock (s)", "digits_grpo_reward_vs_wallclock.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for strategy, runs in results.items():
            xs = [statistics.fmean(r["curve"][i][x_key] for r in runs) for i in range(len(runs[0]["curve"]))]
            stats = [_mean_std([r["curve"][i]["reward"] for r in runs]) for i in range(len(runs[0]["curve"]))]
            mean = [m for m, _ in stats]
            std = [s for _, s in stats]
            ax.plot(xs, mean, marker="o", ms=3, label=strategy)
            ax.fill_between(xs, [m - s for m, s in stats], [m + s for m, s in zip(mean, std)], alpha=0.2)
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"eval reward ({reward_name}), mean ± std over seeds")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def table(results: dict, cosines: dict) -> str:
    rows = ["| strategy | seeds | eval reward start | eval reward end (mean ± std) | training wall-clock (s) "
            "| DiT backward passes / iter | grad cosine vs exact at base | held-out classifier end |",
            "|---|---|---|---|---|---|---|---|"]
    for strategy, runs in results.items():
        start = _mean_std([r["curve"][0]["reward"] for r in runs])
        end = _mean_std([r["curve"][-1]["reward"] for r in runs])
        wall = _mean_std([r["curve"][-1]["wall_s"] for r in runs])
        held_out = [r["curve"][-1]["eval_classifier"] for r in runs if "eval_classifier" in r["curve"][-1]]
        held = "n/a" if not held_out else "{:.4f} ± {:.4f}".format(*_mean_std(held_out))
        rows.append(f"| {strategy} | {len(runs)} | {start[0]:.4g} | {end[0]:.4g} ± {end[1]:.2g} | "
                    f"{wall[0]:.0f} ± {wall[1]:.0f} | {runs[0]['backward_passes']:.1f} | "
                    f"{cosines[strategy]:.3f} | {held} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--reward", default="classifier", choices=["classifier", "jpeg"])
    parser.add_argument("--base", default="pretrained", help="'pretrained', 'random' or a checkpoint path")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--weights", default="t", choices=["t", "index"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    base_options = DemoOptions(iterations=args.iterations, reward=args.reward, base=args.base,
                               num_steps=args.num_steps, window=args.window, weights=args.weights,
                               strategies=tuple(args.strategies)).validate()
    # one module object for every run (reset to the base each time): one jagg compile in all
    dit = load_start_model(args.base)
    base_state = copy.deepcopy(dit.state_dict())
    reward_fns = reward_functions(args.reward)
    # also compiles the jagg loss (minibatch shape), so no timed run pays for the compile
    start = time.perf_counter()
    cosines, _ = gradient_cosines(dit, base_options)
    print(f"gradient cosine to exact at the base (held-out batch): {cosines} "
          f"({time.perf_counter() - start:.0f} s incl. the jagg compile)", flush=True)
    results = {s: [] for s in args.strategies}
    for seed in args.seeds:
        for strategy in args.strategies:
            options = dataclasses.replace(base_options, seed=seed)
            run = run_one(dit, base_state, options, strategy, reward_fns, args.eval_every)
            results[strategy].append(dict(seed=seed, **run))
            end = run["curve"][-1]
            print(f"seed {seed} {strategy:>5}: reward {run['curve'][0]['reward']:.4f} -> {end['reward']:.4f} "
                  f"in {end['wall_s']:.0f} s ({time.perf_counter() - start:.0f} s elapsed)", flush=True)
    with open(args.out / "digits_grpo_results.json", "w") as f:
        json.dump(dict(args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                       grad_cosine=cosines, results=results), f, indent=1)
    paths = plot(results, args.out, args.reward)
    print(f"\n{args.base} base, reward {args.reward}, {args.iterations} iterations, T={args.num_steps}, "
          f"jagg W={args.window}, {args.threads} thread(s), seeds {args.seeds}\n")
    print(table(results, cosines))
    print("\nwrote " + ", ".join(str(p) for p in paths + [args.out / "digits_grpo_results.json"]))


if __name__ == "__main__":
    main()
