"""The few-step study's pictures: reward vs training CPU time and vs iteration (mean over seeds, the
band their min–max), and the Pareto picture (CPU time to the fixed iteration count vs reward there)."""

from __future__ import annotations

import itertools
import os

from jaggc_studies.digits.demo_plots import pyplot, running_mean

FAMILY_COLOURS = {"exact": "#222222", "fast": "#1f77b4", "mix": "#2ca02c", "dance": "#9467bd", "nft": "#ff7f0e",
                  "awm": "#d62728"}


def _style(entry: dict) -> dict:
    schedule = entry["schedule"]
    shade = {1: 0.45, 2: 0.7}.get(schedule["k"], 1.0)
    decoupled = schedule["kind"] in ("nft", "awm")
    return dict(color=FAMILY_COLOURS[schedule["kind"]], alpha=1.0 if decoupled else shade,
                linestyle="-" if schedule["jagg"] else (":" if decoupled else "--"),
                linewidth=2.0 if schedule["jagg"] or decoupled else 1.3)


def _mean_curve(runs: list[list[float]]) -> list[float]:
    length = min(len(r) for r in runs)
    return [sum(r[i] for r in runs) / len(runs) for i in range(length)]


def write_pictures(result: dict, out_dir: str) -> list[str]:
    plt = pyplot(out_dir)
    if plt is None:
        return []
    base = result["options"]["base"]
    trainable = result["options"].get("trainable", "attention")
    fig, (by_cpu, by_gpu, by_iter, pareto) = plt.subplots(1, 4, figsize=(20, 4.4))
    for name, entry in result["strategies"].items():
        runs = entry["per_seed"]
        rewards = [running_mean(r["rollout_reward"]) for r in runs]
        mean = _mean_curve(rewards)
        cpu = _mean_curve([r["cpu_curve"] for r in runs])
        lo = [min(r[i] for r in rewards) for i in range(len(mean))]
        hi = [max(r[i] for r in rewards) for i in range(len(mean))]
        style = _style(entry)
        by_cpu.plot(cpu, mean, label=name, **style)
        if all("gpu_cost" in r for r in runs):
            gpu = _mean_curve([list(itertools.accumulate(r["gpu_cost"])) for r in runs])
            by_gpu.plot([c / 1e3 for c in gpu], mean[:len(gpu)], label=name, **style)
        by_iter.plot(range(1, len(mean) + 1), mean, label=name, **style)
        by_iter.fill_between(range(1, len(mean) + 1), lo, hi, color=style["color"], alpha=0.06)
        x, y = entry["iterations.cpu_s"]["mean"], entry["iterations.reward"]["mean"]
        pareto.errorbar(x, y, yerr=[[y - entry["iterations.reward"]["min"]], [entry["iterations.reward"]["max"] - y]],
                        fmt="o" if entry["schedule"]["jagg"] else "s", color=style["color"], alpha=style["alpha"])
        pareto.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    budget = result["options"]["budget"]
    for ax in (by_cpu,):
        ax.axvline(budget, color="#888888", linewidth=0.8, linestyle=":")
        ax.axvline(0.8 * budget, color="#888888", linewidth=0.8, linestyle=":")
    by_cpu.set_xlabel("training CPU time (s, rollout included; mean of seeds)")
    by_iter.set_xlabel("GRPO iteration")
    by_gpu.set_xlabel("modelled GPU cost (thousands of sample-forwards)")
    by_gpu.set_title(f"{base} ({trainable}): reward vs modelled GPU cost\n(backward = "
                     f"{result.get('gpu_bwd_fwd', float('nan')):.2f} forwards, CFG x{result['options'].get('cfg', 1):g} "
                     "on the per-step GRPO schedules)", fontsize=9)
    by_cpu.set_ylabel("rollout reward (running mean of 5, mean of seeds)")
    by_cpu.set_title(f"{base} ({trainable}): reward vs CPU time (dotted: 0.8x and 1x the budget)", fontsize=9)
    by_iter.set_title(f"{base}: reward vs iteration (band: min–max of seeds)", fontsize=9)
    front = set(result["pareto_iterations"])
    pareto.set_title(f"{base}: evaluation reward at iteration {result['options']['iterations']} vs the CPU s to get "
                     f"there\nPareto front: {', '.join(result['pareto_iterations'])}" if front else base, fontsize=8)
    pareto.set_xlabel("training CPU s (mean of seeds)")
    pareto.set_ylabel("evaluation reward (SDE samples; bars: min–max)")
    by_iter.legend(fontsize=7, loc="upper left", ncol=2)
    for ax in (by_cpu, by_gpu, by_iter, pareto):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    suffix = "" if trainable == "attention" else f"_{trainable}"
    path = os.path.join(out_dir, f"fewsteps_{base}{suffix}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


__all__ = ["write_pictures"]
