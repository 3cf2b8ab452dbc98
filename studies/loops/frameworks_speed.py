"""The frameworks' loops (Flow-Factory, verl-omni) with ``jaggc.stepwise``, timed against the unchanged loop.

``python -m jaggc_studies.loops.frameworks_speed [--size 10m] [--rounds 5]``: W=4, ``weights="t"``,
8 trained steps per trajectory (two JAGG windows), one process, one thread. One epoch (Flow-Factory:
two batches of 2 samples, one optimizer step) or one batch (verl-omni: two micro-batches of 2 rows,
the old-log-prob pass included) per round, the unchanged loop and jaggc's in a rotated order,
process CPU time; ratios unchanged / jaggc, median and range.

Cost model, from this machine's measured F (the loop's DiT call with grad: the CFG batch for
Flow-Factory), B (its backward) and N (the same call without grad: the KL reference and the
old-log-prob pass), per JAGG window of W steps (in one process the knots' graphs are held):

| loop | unchanged | jaggc |
|---|---|---|
| Flow-Factory (KL on the velocity, CFG) | W (F + B + N) | 2 F + (W - 2) N + 2 B + W N |
| verl-omni FlowGRPO (+ old-log-prob pass) | W (F + B) + W N | 2 F + (W - 2) N + 2 B + W N |

(Flow-Factory computes its KL under ``torch.no_grad()``, so the reference forward costs N and adds
no backward: loops/flow_factory.py.)
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from jaggc_studies.loops import flow_factory as ff, verl_omni as vo

W = 4
STEPS = 8


def _flow_factory(lora: bool, size: str, stepwise):
    run = ff.setup(size=size, lora=lora, num_sde_steps=STEPS, sde_steps=tuple(range(1, 9)), stepwise=stepwise)
    loop = ff.train_unchanged if stepwise is None else ff.train_jaggc
    return lambda: loop(run), run


def _verl_omni(size: str, stepwise):
    engine, data = vo.setup(size=size, num_timesteps=STEPS, num_inference_steps=10, stepwise=stepwise)
    loop = vo.train_unchanged if stepwise is None else vo.train_jaggc
    return lambda: vo.train_batch(engine, data, loop), engine


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _units(model, kwargs: dict, repeats: int = 3) -> dict:
    """F, B, N of one call (median of ``repeats``), process CPU time."""
    f, b, n = [], [], []
    for _ in range(repeats):
        start = time.process_time()
        out = model(**kwargs, return_dict=False)[0]
        f.append(time.process_time() - start)
        start = time.process_time()
        out.float().square().mean().backward()
        b.append(time.process_time() - start)
        with torch.no_grad():
            n.append(_cpu(lambda: model(**kwargs, return_dict=False)))
    model.zero_grad(set_to_none=True)
    return dict(F=statistics.median(f), B=statistics.median(b), N=statistics.median(n))


def _call_kwargs(model, batch: int, cfg: bool) -> dict:
    from jaggc import models

    cond = models.sd3_conditioning(model, batch * (2 if cfg else 1), seed=1).kwargs
    latents = torch.randn(models.sd3_latent_shape(model, batch * (2 if cfg else 1)))
    kwargs = dict(hidden_states=latents, timestep=torch.full((latents.shape[0],), 500.0), **cond)
    kwargs.pop("return_dict", None)
    return kwargs


#: the loops' timed cases, by loop (loops.FRAMEWORK_LOOPS)
CASES = {"flow_factory": ("flow_factory_lora", "flow_factory_full"), "verl_omni": ("verl_omni",)}


def measure(size: str = "10m", rounds: int = 5, loops=tuple(CASES)) -> dict:
    """The ``loops``' cases (``CASES``) timed against their unchanged loops (module docstring)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cases = {"flow_factory_lora": lambda sw: _flow_factory(True, size, sw),
             "flow_factory_full": lambda sw: _flow_factory(False, size, sw),
             "verl_omni": lambda sw: _verl_omni(size, sw)}
    wanted = {case for loop in loops for case in CASES[loop]}
    cases = {name: build for name, build in cases.items() if name in wanted}
    results = {}
    for name, build in cases.items():
        unchanged, run = build(None)
        jagg, _ = build(dict(window=W, weights="t"))
        unchanged(), jagg()                               # warm up
        times = {"unchanged": [], "jaggc": []}
        for r in range(rounds):
            order = [("unchanged", unchanged), ("jaggc", jagg)][:: 1 if r % 2 == 0 else -1]
            for label, fn in order:
                times[label].append(_cpu(fn))
        ratios = [u / j for u, j in zip(times["unchanged"], times["jaggc"])]
        flow = name.startswith("flow_factory")
        if flow:
            model = run.accelerator.unwrap_model(run.transformer)
            with run.autocast():
                u = _units(model, _call_kwargs(model, 2, True))
            units = W * (u["F"] + u["B"] + u["N"]), 2 * u["F"] + (W - 2) * u["N"] + 2 * u["B"] + W * u["N"]
        else:
            model = run.module
            u = _units(model, _call_kwargs(model, 2, False))
            units = W * (u["F"] + u["B"]) + W * u["N"], 2 * u["F"] + (W - 2) * u["N"] + 2 * u["B"] + W * u["N"]
        results[name] = dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios),
                             unchanged_s=statistics.median(times["unchanged"]), units=u,
                             cost_model=units[0] / units[1])
    return results


def format_results(results: dict, size: str, rounds: int) -> str:
    lines = [f"frameworks' loops, W={W} weights='t', {STEPS} trained steps, {size}, {rounds} rounds, process CPU "
             f"time (ratios unchanged / jaggc, median [range]):"]
    for name, r in results.items():
        u = r["units"]
        lines.append(f"  {name:18s} {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]  cost model {r['cost_model']:.2f}x"
                     f"  (F {u['F'] * 1e3:.1f} ms, B {u['B'] * 1e3:.1f} ms, N {u['N'] * 1e3:.1f} ms; unchanged "
                     f"{r['unchanged_s']:.2f} s per round)")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="10m")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    print(format_results(measure(args.size, args.rounds), args.size, args.rounds))


if __name__ == "__main__":
    main()
