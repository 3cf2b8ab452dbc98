"""The on-policy ratio check: does jaggc's batching move the PPO ratio of an on-policy batch?

On-policy (parameters as at the rollout) every ratio exp(log π − log π_old) is 1 in exact
arithmetic, and Flow-GRPO clips it at 1 ± 1e-4. The rollout ran the DiT once per step at batch B;
the per-step training loop runs it the same way, so on a deterministic device its ratios are
exactly 1. jaggc runs a window's two knots as one forward of 2B and its interior steps as one
no-grad forward of (W−2)B. On a CPU a batched GEMM is per-row bit-identical to the per-step one;
on a GPU, cuBLAS picks kernels by shape, so batching can change values in the last bits, and with
them the ratio.

``ratio_check`` builds an on-policy problem, plays the rollout (no-grad per-step calls, recorded by
a ``RolloutCache``), sets the old log-probabilities from those velocities with the loss's own
log-density, then reports the largest |ratio − 1| over the batch and the trained steps:
  * ``per_step_loop``: Flow-GRPO's loop, one grad-enabled call of batch B per step;
  * ``jagg``: jaggc's windows as ``@jagg_compile(window=W)`` runs them (``jagg_calls``, the runtime
    the compiled loss calls): 2B knots, batched interior;
  * ``jagg_unbatched``: ``batch_knots=False, interior_chunk=1``: every forward at batch B;
  * ``jagg_fast``: ``rollout_cache=``: interior outputs are the rollout's own, knots batched;
  * ``jagg_fast_unbatched``: the rollout cache and ``batch_knots=False``: every value comes from a
    forward of the rollout's shape (interior: the rollout's own values).
Each variant also reports which steps moved (knot or interior position).
"""

from __future__ import annotations

import torch

from jaggc.runtime import RolloutCache, WindowOptions, jagg_calls, partition
from jaggc_studies.bench.problems import build_problem

VARIANTS = {
    "jagg": dict(),
    "jagg_unbatched": dict(batch_knots=False, interior_chunk=1),
    "jagg_fast": dict(rollout_cache=True),
    "jagg_fast_unbatched": dict(rollout_cache=True, batch_knots=False),
}


def ratio_check(family: str | None, size: str, *, window: int = 4, num_steps: int = 8, batch: int = 2,
                seed: int = 0, device="cpu", dtype=torch.float32, layers=None, resolution=None) -> dict:
    """The largest |ratio − 1| per way of running the on-policy batch (module docstring)."""
    problem = build_problem(family, size, num_steps=num_steps, batch=batch, seed=seed, device=device, dtype=dtype,
                            layers=layers, resolution=resolution, on_policy=True)
    model, data = problem.model, problem.batch
    calls = problem.dit_calls(data)
    cache = RolloutCache(model)
    with torch.no_grad(), cache.record():
        rollout = [call(model) for call in calls]
    data["log_probs"] = torch.stack([problem.log_prob(out, data, j).detach().float()
                                     for j, out in enumerate(rollout)], 1).contiguous()
    del rollout

    def worst(outputs) -> list[float]:
        with torch.no_grad():
            return [(torch.exp(problem.log_prob(out, data, j).float() - data["log_probs"][:, j]) - 1).abs().max().item()
                    for j, out in enumerate(outputs)]

    with torch.enable_grad():
        loop = worst([call(model) for call in calls])
    results = {"per_step_loop": _summary(loop, None, window, num_steps)}
    for name, options in VARIANTS.items():
        options = dict(options)
        if options.pop("rollout_cache", False):
            options["rollout_cache"] = cache
        hits = cache.stats.hits
        with torch.enable_grad():
            per_step = worst(jagg_calls(model, calls, window=window, options=WindowOptions(**options)))
        results[name] = _summary(per_step, options, window, num_steps)
        if "rollout_cache" in options:
            results[name]["cache_hits"] = cache.stats.hits - hits
    return dict(model=problem.name, params=problem.num_params, device=str(problem.device),
                dtype=str(problem.dtype).removeprefix("torch."), window=window, num_steps=num_steps, batch=batch,
                variants=results)


def _summary(per_step: list[float], options: dict | None, window: int, num_steps: int) -> dict:
    knots = {w[0] for w in partition(num_steps, window)} | {w[-1] for w in partition(num_steps, window)}
    moved = [j for j, x in enumerate(per_step) if x != 0.0]
    return dict(max_abs_ratio_minus_1=max(per_step), exactly_one=not moved, per_step=per_step,
                moved_knot_steps=[j for j in moved if j in knots],
                moved_interior_steps=[j for j in moved if j not in knots],
                options={k: ("RolloutCache" if k == "rollout_cache" else v) for k, v in (options or {}).items()})


def format_ratio_check(check: dict) -> str:
    lines = [f"on-policy ratio check: {check['model']} ({check['params'] / 1e6:.1f}M params), {check['device']} "
             f"{check['dtype']}, W={check['window']}, {check['num_steps']} steps, batch {check['batch']}: "
             "largest |ratio - 1| (Flow-GRPO clips at 1e-4)"]
    for name, v in check["variants"].items():
        where = ""
        if v["moved_knot_steps"] or v["moved_interior_steps"]:
            where = f"  (moved: knot steps {v['moved_knot_steps']}, interior steps {v['moved_interior_steps']})"
        lines.append(f"  {name:<22} {v['max_abs_ratio_minus_1']:.3g}{'  exactly 1' if v['exactly_one'] else ''}{where}")
    return "\n".join(lines)
