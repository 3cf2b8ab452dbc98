"""``jaggc study fewsteps``: the few-step schedules and their JAGG compositions, side by side.

Each schedule (``schedules.py``) trains its own copy of a base with the same rollout seeds, run
**interleaved** one iteration each in turn (order rotating), each iteration timed in process CPU
time (rollout + reward + optimizer steps). A schedule trains until it has used ``budget`` CPU
seconds *and* run ``iterations`` iterations, so one run gives both views: the model at equal CPU
time (the last iteration within the budget; also within 0.8x of it, the issue's goal) and at equal
iteration count. Those snapshots are evaluated at the end on fixed seeds (SDE and ODE samples of
every class). Before training, at the base, each JAGG composition's gradient is compared with its
own exact schedule's (the same loop without ``jaggc.stepwise``) on one held-out rollout minibatch
sampled by that schedule. ``seeds`` repeats everything with other rollout seeds.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch

from jaggc.errors import JaggInputError
from jaggc_studies.digits.trainer import TrainerConfig, evaluate_rewards, take_samples
from jaggc_studies.fewsteps.bases import BASES, load_base
from jaggc_studies.fewsteps.schedules import DEFAULT_SCHEDULES, WIDE_SCHEDULES, Schedule, parse_schedule
from jaggc_studies.fewsteps.trainer import FewStepTrainer, schedule_gradient

HELD_OUT_SEED = 999_983
GOAL_FRACTION = 0.8         # the goal: a composition reaches the best peer's reward in <= 0.8x its time
SNAPSHOTS = ("goal", "budget", "iterations")
SMOOTH = 5                  # running mean of the rollout reward in the cost-to-reach curves


@dataclass(frozen=True)
class FewStepsOptions:
    base: str = "digits"
    schedules: tuple = DEFAULT_SCHEDULES
    budget: float = 10.0          # training CPU seconds per schedule
    iterations: int = 25          # and at least this many iterations
    seeds: int = 3
    seed: int = 0
    num_steps: int = 10
    classes_per_iter: int = 2
    group_size: int = 16
    lr: float = 3e-4
    eval_per_class: int = 12
    random_init: bool = False     # smoke runs: an untrained DiT
    progress: bool = True
    trainable: str = "attention"  # the trained set: "attention" (Flow-GRPO's LoRA targets) or "blocks" (full)
    cfg: float = 2.0              # modelled GPU cost: CFG's factor on the per-step GRPO peers' passes
    cost_shape: bool = True       # measure the base's cost shape first (cost_shape.py)

    def validate(self) -> "FewStepsOptions":
        if self.base not in BASES:
            raise JaggInputError(f"--base {self.base!r}: use one of {BASES}")
        for name in ("iterations", "seeds", "eval_per_class"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise JaggInputError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: must be an int >= 1")
        if self.trainable not in ("attention", "blocks", "all"):
            raise JaggInputError(f"--trainable {self.trainable!r}: use attention or blocks")
        if not self.cfg >= 1:
            raise JaggInputError(f"--cfg {self.cfg!r}: the CFG factor on the GRPO peers' passes, >= 1")
        if not self.budget > 0:
            raise JaggInputError(f"--budget {self.budget!r}: CPU seconds, > 0")
        names = [parse_schedule(n).validate(self.num_steps).name for n in self.schedules]
        if len(set(names)) != len(names):
            raise JaggInputError(f"--schedules {list(self.schedules)}: a schedule is named twice")
        return self

    def config(self, seed: int) -> TrainerConfig:
        return TrainerConfig(num_steps=self.num_steps, classes_per_iter=self.classes_per_iter,
                             group_size=self.group_size, lr=self.lr, seed=seed, trainable=self.trainable)


def gradient_cosine(base, kwargs: dict, options: FewStepsOptions, schedule: Schedule, seed: int) -> float:
    """Cosine of the composition's gradient to its own exact schedule's (the same per-step loop, no
    JAGG), at the base, on one held-out on-policy minibatch sampled by the schedule."""
    config = replace(options.config(seed), seed=HELD_OUT_SEED)
    plain = FewStepTrainer(copy.deepcopy(base), config, schedule=replace(schedule, jagg=None), **kwargs)
    batch = plain.collect(0)
    batch["train_steps"] = plain.train_steps(0)
    half = take_samples(batch, torch.arange(batch["latents"].shape[0] // config.minibatches))
    exact = schedule_gradient(plain.dit, half, plain.params)
    composed = FewStepTrainer(copy.deepcopy(base), config, schedule=schedule, **kwargs)
    composed.collect(0)                       # its rollout cache records the same rollout
    approx = schedule_gradient(composed.dit, half, composed.params, composed.stepwise)
    composed.close()
    return float(torch.nn.functional.cosine_similarity(approx.double(), exact.double(), 0))


def _trained_state(trainer: FewStepTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def run_seed(base, kwargs: dict, eval_fns: dict, options: FewStepsOptions, seed: int) -> dict:
    from tqdm.auto import tqdm

    schedules = [parse_schedule(n) for n in options.schedules]
    trainers = {s.name: FewStepTrainer(copy.deepcopy(base), options.config(seed), schedule=s, **kwargs)
                for s in schedules}
    names = list(trainers)
    cpu = dict.fromkeys(names, 0.0)
    snaps = {n: {} for n in names}
    bar = tqdm(desc=f"{options.base} seed {seed}", disable=None if options.progress else True)
    for i in itertools.count():
        active = [n for n in names if cpu[n] < options.budget or len(trainers[n].history) < options.iterations]
        if not active:
            break
        for name in active[i % len(active):] + active[:i % len(active)]:
            trainer = trainers[name]
            cpu[name] += trainer.step()["cpu_s"]
            done = len(trainer.history)
            if cpu[name] <= GOAL_FRACTION * options.budget:
                snaps[name]["goal"] = (done, cpu[name], _trained_state(trainer))
            if cpu[name] <= options.budget:
                snaps[name]["budget"] = (done, cpu[name], _trained_state(trainer))
            if done == options.iterations:
                snaps[name]["iterations"] = (done, cpu[name], _trained_state(trainer))
        bar.update()
        bar.set_postfix({n: f"{trainers[n].history[-1]['reward_mean']:.2f}" for n in names})
    bar.close()
    results = {}
    for name, trainer in trainers.items():
        trainer.close()
        history = trainer.history
        entry = dict(
            schedule=asdict(trainer.schedule), iterations_run=len(history),
            backward_work=statistics.fmean(h["backward_work"] for h in history),
            trained_steps=statistics.fmean(len(h["train_steps"]) for h in history),
            cpu_per_iteration=statistics.fmean(h["cpu_s"] for h in history),
            rollout_reward=[h["reward_mean"] for h in history],
            cpu_curve=list(itertools.accumulate(h["cpu_s"] for h in history)),
            rows=[[h["rows"]["rollout"], h["rows"]["forward"], h["rows"]["backward"]] for h in history])
        for key in SNAPSHOTS:
            if key not in snaps[name]:
                # the first iteration alone overran 0.8x (or 1x) the budget: no model to evaluate there
                warnings.warn(f"jaggc study fewsteps: {name} (seed {seed}): its first iteration took "
                              f"{history[0]['cpu_s']:.3f} CPU s, over the {key} snapshot's "
                              f"{_snapshot_limit(key, options):g} s: no {key} snapshot (raise --budget)", stacklevel=2)
                continue
            done, spent, state = snaps[name][key]
            with torch.no_grad():
                for p, value in zip(trainer.params, state):
                    p.copy_(value)
            entry[key] = dict(iteration=done, cpu_s=spent, **trainer.evaluate(eval_fns, per_class=options.eval_per_class))
        results[name] = entry
    return results


def modelled_bwd_fwd(dit, trainable: str) -> float:
    """The GPU model's backward/forward cost ratio of a trainable set: a backward computes every
    matmul's input gradient (one forward's FLOPs) plus the trained weights' gradients (their share of
    the forward's FLOPs, taken as their share of the blocks' parameters): 2 for full fine-tuning of the
    blocks, ~1 + (the trained share) for attention-only or LoRA."""
    from jaggc_studies.digits.trainer import trainable_parameters

    probe = copy.deepcopy(dit)
    trained = {id(p) for p in trainable_parameters(probe, trainable)}
    blocks = re.compile(r"\.(single_)?transformer_blocks\.")
    block = [p for n, p in probe.named_parameters() if blocks.search("." + n)]
    share = sum(p.numel() for p in block if id(p) in trained) / sum(p.numel() for p in block)
    return 1.0 + min(1.0, share)


def modelled_cost(rows: list, schedule: dict, bwd_fwd: float, cfg: float) -> list[float]:
    """Per iteration, the modelled GPU cost in sample-forwards: (rollout forwards + training forwards
    + bwd_fwd x backward rows), x ``cfg`` for the per-step GRPO schedules (Flow-GRPO, -Fast, MixGRPO and
    DanceGRPO sample and train with CFG on SD3/FLUX; DiffusionNFT and AWM are CFG-free)."""
    factor = 1.0 if schedule["kind"] in ("nft", "awm") else cfg
    return [factor * (r + f + bwd_fwd * b) for r, f, b in rows]


def cost_to_reach(costs: list[float], rewards: list[float], target: float) -> float:
    """The cumulative cost at which the running mean of the rollout reward first reaches ``target``
    (inf if never)."""
    from jaggc_studies.digits.demo_plots import running_mean

    spent = 0.0
    for cost, value in zip(costs, running_mean(rewards, SMOOTH)):
        spent += cost
        if value >= target:
            return spent
    return float("inf")


def reach_check(strategies: dict, options: dict, model_ratio: float) -> dict:
    """Curve-based goal on both axes: the best per-step GRPO peer's final running-mean rollout reward
    (at the last iteration of its budget, mean over seeds) as the target; per schedule the CPU time and
    the modelled GPU cost to first reach it, mean over seeds (a seed that never reaches it counts at
    its whole run, flagged), as ratios to that peer's."""
    from jaggc_studies.digits.demo_plots import running_mean

    def final(entry):
        vals = []
        for run in entry["per_seed"]:
            n = run["budget"]["iteration"] if "budget" in run else len(run["rollout_reward"])
            vals.append(running_mean(run["rollout_reward"], SMOOTH)[n - 1])
        return statistics.fmean(vals)

    peers = {n: e for n, e in strategies.items() if not e["schedule"]["jagg"] and e["schedule"]["kind"] not in ("nft", "awm")}
    if not peers:
        return {}
    best = max(peers, key=lambda n: final(peers[n]))
    target = final(peers[best])
    out = dict(best_peer=best, target=target, schedules={})
    for name, entry in strategies.items():
        cpu, gpu, missed = [], [], 0
        for run in entry["per_seed"]:
            cpu_steps = [b - a for a, b in zip([0.0] + run["cpu_curve"][:-1], run["cpu_curve"])]
            c = cost_to_reach(cpu_steps, run["rollout_reward"], target)
            g = cost_to_reach(run["gpu_cost"], run["rollout_reward"], target)
            if c == float("inf"):
                missed += 1
                c, g = run["cpu_curve"][-1], sum(run["gpu_cost"])
            cpu.append(c)
            gpu.append(g)
        out["schedules"][name] = dict(cpu_s=statistics.fmean(cpu), gpu_cost=statistics.fmean(gpu), missed=missed)
    ref = out["schedules"][best]
    for entry in out["schedules"].values():
        entry["cpu_ratio"] = entry["cpu_s"] / ref["cpu_s"]
        entry["gpu_ratio"] = entry["gpu_cost"] / ref["gpu_cost"]
    return out


def _snapshot_limit(key: str, options: FewStepsOptions) -> float:
    return {"goal": GOAL_FRACTION * options.budget, "budget": options.budget}.get(key, float("nan"))


def combine(per_seed: list[dict]) -> dict:
    """Per schedule: means, [min, max] and per-seed values of the headline numbers."""
    out = {}
    for name in per_seed[0]:
        runs = [r[name] for r in per_seed]
        entry = dict(schedule=runs[0]["schedule"], per_seed=runs)
        scalars = {"backward_work": [r["backward_work"] for r in runs],
                   "trained_steps": [r["trained_steps"] for r in runs],
                   "cpu_per_iteration": [r["cpu_per_iteration"] for r in runs],
                   "gpu_per_iteration": [statistics.fmean(r["gpu_cost"]) for r in runs],
                   "iterations_run": [r["iterations_run"] for r in runs]}
        for key in SNAPSHOTS:
            for metric in ("reward", "reward_ode", "cpu_s", "iteration"):
                values = [r[key][metric] for r in runs if key in r]
                if len(values) == len(runs):
                    scalars[f"{key}.{metric}"] = values
        for key, values in scalars.items():
            entry[key] = dict(mean=statistics.fmean(values), min=min(values), max=max(values))
        out[name] = entry
    return out


def pareto_front(strategies: dict, snapshot: str = "iterations") -> list[str]:
    """Schedules no other beats on both CPU time and evaluation reward at ``snapshot``."""
    points = {n: (e[f"{snapshot}.cpu_s"]["mean"], e[f"{snapshot}.reward"]["mean"])
              for n, e in strategies.items() if f"{snapshot}.cpu_s" in e}
    return sorted((n for n, (c, r) in points.items()
                   if not any(c2 <= c and r2 >= r and (c2, r2) != (c, r) for c2, r2 in points.values())),
                  key=lambda n: points[n][0])


def goal_check(strategies: dict) -> dict:
    """The issue's goal: the best JAGG composition's reward at 0.8x the budget against the best
    per-step GRPO peer's (exact, fast, mix, dance without JAGG; not the decoupled nft / awm) reward at
    the full budget (means over seeds)."""
    peers = {n: e for n, e in strategies.items()
             if not e["schedule"]["jagg"] and e["schedule"]["kind"] not in ("nft", "awm") and "budget.reward" in e}
    composed = {n: e for n, e in strategies.items() if e["schedule"]["jagg"] and "goal.reward" in e}
    if not peers or not composed:
        return {}
    best_peer = max(peers, key=lambda n: peers[n]["budget.reward"]["mean"])
    best_jagg = max(composed, key=lambda n: composed[n]["goal.reward"]["mean"])
    target = peers[best_peer]["budget.reward"]["mean"]
    reached = composed[best_jagg]["goal.reward"]["mean"]
    return dict(best_peer=best_peer, best_peer_reward_at_budget=target, best_composition=best_jagg,
                composition_reward_at_goal=reached, met=reached >= target)


def run_study(options: FewStepsOptions) -> dict:
    options.validate()
    base, kwargs, eval_fns = load_base(options.base, random_init=options.random_init)
    start = evaluate_rewards(base, eval_fns, options.config(options.seed), per_class=options.eval_per_class,
                             num_classes=kwargs.get("num_classes", 10),
                             **{k: kwargs[k] for k in ("image_shape", "conditioning") if k in kwargs})
    t0 = time.perf_counter()
    cosines = {s.name: gradient_cosine(base, kwargs, options, s, options.seed)
               for s in map(parse_schedule, options.schedules) if s.jagg}
    shape = {}
    if options.cost_shape:
        from jaggc_studies.fewsteps.cost_shape import measure_cost_shape

        shape = measure_cost_shape(base, kwargs, trainable=options.trainable, schedule="exact",
                                   iterations=2 if not options.random_init else 1, num_steps=options.num_steps,
                                   classes_per_iter=options.classes_per_iter, group_size=options.group_size)
    gpu_ratio = modelled_bwd_fwd(base, options.trainable)
    per_seed = [run_seed(base, kwargs, eval_fns, options, options.seed + k) for k in range(options.seeds)]
    for runs in per_seed:
        for entry in runs.values():
            entry["gpu_cost"] = modelled_cost(entry.pop("rows"), entry["schedule"], gpu_ratio, options.cfg)
    strategies = combine(per_seed)
    for name, cosine in cosines.items():
        strategies[name]["grad_cosine"] = cosine
    return dict(options=json.loads(json.dumps(asdict(options), default=list)), base_eval=start,
                seeds=[options.seed + k for k in range(options.seeds)], threads=torch.get_num_threads(),
                total_s=time.perf_counter() - t0, cost_shape=shape, gpu_bwd_fwd=gpu_ratio, strategies=strategies,
                pareto_iterations=pareto_front(strategies, "iterations"),
                pareto_gpu=pareto_front(_with_gpu_cost(strategies), "iterations"), goal=goal_check(strategies),
                reach=reach_check(strategies, asdict(options), gpu_ratio))


def _with_gpu_cost(strategies: dict) -> dict:
    """The strategies with ``iterations.cpu_s`` replaced by the modelled GPU cost to that iteration."""
    out = {}
    for name, e in strategies.items():
        if "iterations.iteration" not in e:
            continue
        cost = e["gpu_per_iteration"]["mean"] * e["iterations.iteration"]["mean"]
        out[name] = dict(e, **{"iterations.cpu_s": dict(mean=cost, min=cost, max=cost)})
    return out


def _fmt(stat: dict, digits: int = 3) -> str:
    return f"{stat['mean']:.{digits}f} [{stat['min']:.{digits}f}–{stat['max']:.{digits}f}]"


def format_table(result: dict) -> str:
    opts = result["options"]
    budget, iters = opts["budget"], opts["iterations"]
    reach = result.get("reach", {}).get("schedules", {})
    rows = [f"| schedule | trained steps | backward passes / iter | CPU s / iter | modelled GPU cost / iter (k) "
            f"| reward at {budget:g} CPU s (ODE) | reward at {GOAL_FRACTION * budget:g} CPU s "
            f"| reward at iteration {iters} (CPU s) | CPU / GPU cost to the best peer's reward (x its) "
            f"| grad cosine to own exact (held-out batch) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in result["strategies"].items():
        cos = f"{e['grad_cosine']:.3f}" if "grad_cosine" in e else "—"
        goal = _fmt(e["goal.reward"]) if "goal.reward" in e else "—"
        at_budget = (f"{_fmt(e['budget.reward'])} ({e['budget.reward_ode']['mean']:.3f})" if "budget.reward" in e
                     else "—")     # a seed's first iteration overran the budget (warned)
        r = reach.get(name)
        to_reach = (f"{r['cpu_ratio']:.2f} / {r['gpu_ratio']:.2f}" + (f" ({r['missed']} seed(s) never)" if r["missed"] else "")
                    if r else "—")
        rows.append(f"| {name} | {e['trained_steps']['mean']:.1f} | {e['backward_work']['mean']:.1f} | "
                    f"{e['cpu_per_iteration']['mean']:.3f} | {e['gpu_per_iteration']['mean'] / 1e3:.2f} | {at_budget} | "
                    f"{goal} | {_fmt(e['iterations.reward'])} ({e['iterations.cpu_s']['mean']:.1f}) | {to_reach} | {cos} |")
    base = result["base_eval"]
    lines = rows + ["", f"base: reward {base['reward']:.3f} (ODE {base['reward_ode']:.3f}); rewards: mean "
                        f"[min–max] over seeds {result['seeds']} of the SDE evaluation samples; —: no snapshot there (a seed's "
                        "first iteration overran it)"]
    shape = result.get("cost_shape")
    if shape:
        lines.append(f"cost shape ({opts['trainable']}, {shape['trained_params']} of {shape['params']} parameters trained; "
                     f"exact schedule): the DiT's passes {100 * shape['dit_share']:.1f}% of an iteration's CPU time, "
                     f"backward/forward {shape['bwd_fwd']:.2f} on this CPU; the GPU model's {result['gpu_bwd_fwd']:.2f}, "
                     f"CFG x{opts['cfg']:g} on the per-step GRPO schedules")
    lines.append("Pareto front (CPU s to iteration {}, reward there): {}".format(iters, ", ".join(result["pareto_iterations"])))
    lines.append("Pareto front (modelled GPU cost to iteration {}): {}".format(iters, ", ".join(result.get("pareto_gpu", []))))
    if result.get("reach"):
        lines.append(f"cost to reach: the best per-step GRPO peer {result['reach']['best_peer']}'s final running-mean "
                     f"rollout reward {result['reach']['target']:.3f} (mean over seeds)")
    goal = result["goal"]
    if goal:
        lines.append(f"goal (a composition at {GOAL_FRACTION:g}x the budget >= the best per-step GRPO peer at the budget): "
                     f"best peer {goal['best_peer']} {goal['best_peer_reward_at_budget']:.3f}; best composition "
                     f"{goal['best_composition']} {goal['composition_reward_at_goal']:.3f} at {GOAL_FRACTION:g}x: "
                     f"{'MET' if goal['met'] else 'NOT MET'}")
    return "\n".join(lines)


def main_fewsteps(options: FewStepsOptions, json_path: str | None = None, out: str | None = None) -> dict:
    result = run_study(options)
    print(f"\nfew-step schedules on the {options.base} base ({options.trainable}): {options.budget:g} CPU s and >= {options.iterations} "
          f"iterations per schedule, {options.seeds} seed(s), T={options.num_steps}, "
          f"{options.classes_per_iter}x{options.group_size} samples per rollout, lr {options.lr:g}; "
          f"{result['threads']} thread(s), {result['total_s']:.0f} s\n")
    print(format_table(result))
    written = []
    if out:
        from jaggc_studies.fewsteps.plots import write_pictures

        written = write_pictures(result, out)
        result["pictures"] = written
    if json_path:
        from jaggc_studies.digits.demo_plots import write_results_json

        write_results_json(result, json_path, digits=4)
        written.append(json_path)
    if written:
        print("\nwrote " + "\n      ".join(written))
    return result


__all__ = ["FewStepsOptions", "combine", "goal_check", "gradient_cosine", "main_fewsteps", "pareto_front",
           "run_seed", "run_study"]
