"""The demo's pictures: before/after sample grids and reward-vs-time curves, as PNG files.

matplotlib (the ``examples`` extra) draws them with the Agg backend, so no display is needed;
without matplotlib the demo says so and writes none.
"""

from __future__ import annotations

import json
import os

import torch

COLOURS = {"exact": "#222222", "dance": "#1f77b4", "mix": "#2ca02c", "jagg": "#d62728"}
SMOOTH = 5   # iterations in the running mean of the (noisy, 2-class) rollout reward


def tile(images: torch.Tensor, per_class: int, gap: int = 1) -> torch.Tensor:
    """(10 * per_class, 1, 8, 8) in [-1, 1] -> one (H, W) panel in [0, 1]: one row per digit,
    its ``per_class`` samples left to right, a ``gap`` of background between tiles."""
    n, _, h, w = images.shape
    classes = n // per_class
    x = ((images[:, 0] + 1) / 2).clamp(0, 1).reshape(classes, per_class, h, w)
    out = torch.zeros(classes * (h + gap) - gap, per_class * (w + gap) - gap)
    for c in range(classes):
        for k in range(per_class):
            out[c * (h + gap):c * (h + gap) + h, k * (w + gap):k * (w + gap) + w] = x[c, k]
    return out


def running_mean(values: list[float], width: int = SMOOTH) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / (i + 1 - max(0, i - width + 1)) for i in range(len(values))]


def pyplot(out_dir: str):
    """matplotlib.pyplot on the Agg backend with ``out_dir`` created, or None (said) without
    matplotlib: the one entry of the demo's and the studies' pictures."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no pictures: matplotlib is not installed (pip install 'jaggc[examples]')")
        return None
    os.makedirs(out_dir, exist_ok=True)
    return plt


def _rounded(obj, digits: int):
    if isinstance(obj, float):
        return obj if obj != obj or obj in (float("inf"), float("-inf")) else round(obj, digits)
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


def write_results_json(result: dict, path: str, digits: int | None = None) -> None:
    """The demo's and the studies' JSON tail: floats rounded to ``digits`` decimals (None: kept), the
    summary keys one per line and every list of numbers on one line (the per-iteration curves stay small)."""
    import re

    text = json.dumps(result if digits is None else _rounded(result, digits), indent=1)
    # a list holding no list or object: on one line
    text = re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0)), separators=(",", ":")), text)
    with open(path, "w") as f:
        f.write(text + "\n")


def write_pictures(result: dict, pictures: dict, out_dir: str) -> list[str]:
    plt = pyplot(out_dir)
    if plt is None:
        return []
    return [_samples_figure(plt, result, pictures, os.path.join(out_dir, "samples.png")),
            _curves_figure(plt, result, os.path.join(out_dir, "reward_curves.png"))]


def _samples_figure(plt, result: dict, pictures: dict, path: str) -> str:
    per_class = pictures["base"].shape[0] // 10
    panels = [("base", pictures["base"], next(iter(result["strategies"].values()))["reward_start"])]
    panels += [(name, pictures["after"][name], r["reward_end"]) for name, r in result["strategies"].items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(0.6 + 0.4 * per_class * len(panels), 4.4))
    for i, (ax, (label, images, reward)) in enumerate(zip(axes, panels)):
        ax.imshow(tile(images, per_class).numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"{label}\nreward {reward:.2f}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([4 + 9 * c for c in range(10)], [str(c) for c in range(10)] if i == 0 else [], fontsize=7)
        ax.tick_params(length=0)
    fig.suptitle("the base, then each strategy after GRPO on the bold-digits reward: ODE samples from the same "
                 "noise\n(reward: mean over the SDE evaluation samples)", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curves_figure(plt, result: dict, path: str) -> str:
    guarded = {n: r["guard_curve"] for n, r in result["strategies"].items() if r.get("guard_curve")}
    if guarded:
        fig, (by_cpu, by_iter, guard_ax) = plt.subplots(1, 3, figsize=(13.5, 3.4))
        by_iter.sharey(by_cpu)
        _guard_panel(guard_ax, guarded)
    else:
        fig, (by_cpu, by_iter) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for name, r in result["strategies"].items():
        smooth = running_mean(r["rollout_reward"])
        style = dict(color=COLOURS.get(name), label=f"{name} (end {r['reward_end']:.2f}, {r['cpu_s']:.0f} CPU s)",
                     linewidth=2.2 if name in ("exact", "jagg") else 1.2)
        by_cpu.plot(r["cpu_curve"], smooth, **style)
        by_iter.plot(range(1, len(smooth) + 1), smooth, **style)
    by_cpu.set_xlabel("training CPU time (s, rollout included)")
    by_iter.set_xlabel("GRPO iteration")
    by_cpu.set_ylabel(f"rollout reward (running mean of {SMOOTH})")
    seeds = result.get("seeds", [0])
    by_cpu.set_title("reward vs time" + (f" (mean of {len(seeds)} seeds)" if len(seeds) > 1 else ""), fontsize=9)
    by_iter.set_title("reward vs iteration", fontsize=9)
    by_iter.legend(fontsize=7, loc="lower right")
    for ax in (by_cpu, by_iter):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _guard_panel(ax, guarded: dict) -> None:
    """The guard's running figures by iteration: the latest probe's cosine to the exact gradient
    (left axis) and the running block's bias over its noise floor (right axis, 1.5 = the limit)."""
    bias_ax = ax.twinx()
    for name, curve in guarded.items():
        its = [c["iteration"] + 1 for c in curve if "guard/cosine" in c]
        ax.plot(its, [c["guard/cosine"] for c in curve if "guard/cosine" in c], color=COLOURS.get(name),
                label=f"{name}: cosine to exact (latest probe)")
        pts = [(c["iteration"] + 1, c["guard/bias_over_floor"]) for c in curve
               if c.get("guard/bias_over_floor") == c.get("guard/bias_over_floor") and "guard/bias_over_floor" in c]
        if pts:
            bias_ax.plot(*zip(*pts), color=COLOURS.get(name), linestyle="--", label=f"{name}: bias / noise floor")
    bias_ax.axhline(1.5, color="#888888", linewidth=0.8, linestyle=":")
    ax.set_xlabel("GRPO iteration")
    ax.set_ylabel("cosine to the exact gradient")
    bias_ax.set_ylabel("bias / noise floor (running block)")
    ax.set_title("the guard, measured during the run", fontsize=9)
    lines = ax.get_legend_handles_labels()
    more = bias_ax.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
