"""The results of ``jaggc bench``: the JSON summary and the printed table.

Speedups are per-round ratios (the exact mode's time over the mode's time in the same
interleaved round), so two runs that were neighbours in time are compared; the summary keeps
their median and min/max, the cost model's prediction (``theory_*``) and the prediction from the
passes the run actually made (``counted_*``) next to every measured ratio.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict
from typing import Any

import torch

from jaggc_studies.bench.config import BenchConfig, ModeResult
from jaggc_studies.bench.device import SAVED_TENSORS_KIND, CudaPeakMemory, device_facts
from jaggc_studies.bench.strategies import theory_backward_speedup, theory_fast_backward_speedup, theory_fast_step_speedup, theory_lowmem_backward_speedup, theory_lowmem_step_speedup, theory_per_window_backward_speedup, theory_per_window_step_speedup, theory_step_speedup


# ---------------------------------------------------------------------------------------------
# results


def _stats(xs: list[float]) -> dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs)) if xs else {}


def _ratios(base: list[float], other: list[float]) -> list[float]:
    # per round: the two runs were neighbours in time
    return [b / o for b, o in zip(base, other) if o > 0]


def summarize(config: BenchConfig, runner, compile_info: dict, skipped: list[str]) -> dict:
    """The JSON results: run facts, per-window maps for the ``jagg`` strategy, every mode's
    speedups and raw times, the compile probes."""
    p, clock = runner.problem, config.clocks[0]
    # a runner made by hand (tests) may leave out where it ran: the CPU in float32, nothing failed
    device, dtype = getattr(runner, "device", torch.device("cpu")), getattr(runner, "dtype", torch.float32)
    exact = runner.results["exact"]
    out: dict[str, Any] = dict(
        model=p.name, model_params=p.num_params, family=p.family, size=p.size, cfg=p.cfg, num_steps=p.num_steps,
        batch=p.batch_size, clock=clock, clocks=list(config.clocks), repeats=config.repeats,
        threads=torch.get_num_threads(), diffusers_version=_diffusers_version(),
        **device_facts(device, dtype), cpu_count=_cpu_count(), skipped_modes=skipped,
        layers=config.layers, resolution=config.resolution, warmup_rounds=config.warmup,
        peak_memory_kind=CudaPeakMemory.kind if device.type == "cuda" else SAVED_TENSORS_KIND,
        failed_modes=dict(getattr(runner, "failed", {})),
        backward_passes=dict(exact=exact.passes["backwards"], jagg={}),
        backward_samples=dict(exact=exact.passes["backward_samples"], jagg={}),
        speedups={}, modes={},
    )
    for key in _WINDOW_KEYS:
        out[key] = {}
    for prefix in _VARIANTS.values():
        for key in _VARIANT_KEYS:
            out[key.format(prefix)] = {}
    for text, res in runner.results.items():
        summary = _mode_summary(exact, res, clock)
        out["speedups"][text] = summary
        out["modes"][text] = _mode_json(res)
        if res.strategy == "jagg":
            _add_window_entries(out, str(res.window), res, summary)
        elif res.strategy in _VARIANTS:
            _add_variant_entries(out, _VARIANTS[res.strategy], res, summary)
        if p.cfg and res.window is not None:
            # with CFG the per-window formulas do not hold: the cost model of the actual loss does
            prefix = "" if res.strategy == "jagg" else f"{_VARIANTS.get(res.strategy, res.strategy)}_"
            for kind in ("step", "backward"):
                key = f"theory_{prefix}{kind}_speedup"
                if key in out and str(res.window) in out[key]:
                    out[key][str(res.window)] = summary[f"theory_{kind}"]
    if "exact_per_step" in runner.results:
        out["vs_per_step_loop"] = _vs_per_step_loop(runner.results, clock)
    out.update(compile_info)
    traces = [r.traces for r in runner.results.values() if r.traces is not None]
    out["recompiles_main"] = max((t - 1 for t in traces), default=0)
    out["recompiles"] = max(out.get("recompiles", 0), out["recompiles_main"])
    out["elapsed_s"] = runner.elapsed()
    return out


# per-window maps (window size -> number) of the "jagg" strategy
_WINDOW_KEYS = ("step_speedup", "backward_speedup", "step_speedup_range", "backward_speedup_range",
                "theory_step_speedup", "theory_backward_speedup", "theory_step_speedup_trajectory",
                "theory_backward_speedup_trajectory", "counted_step_speedup", "counted_backward_speedup",
                "peak_mem_ratio", "compile_overhead_main_s")


# per-window maps of the JAGG variants, "<prefix>_step_speedup" etc.: strategy -> (prefix, theory)
_VARIANTS = {"jagg_fast": "fast", "jagg_per_window": "per_window", "jagg_lowmem": "lowmem"}
_VARIANT_THEORY = {"fast": (theory_fast_step_speedup, theory_fast_backward_speedup),
                   "per_window": (theory_per_window_step_speedup, theory_per_window_backward_speedup),
                   "lowmem": (theory_lowmem_step_speedup, theory_lowmem_backward_speedup)}
_VARIANT_KEYS = ("{}_step_speedup", "{}_backward_speedup", "{}_step_speedup_range", "{}_backward_speedup_range",
                 "theory_{}_step_speedup", "theory_{}_backward_speedup", "counted_{}_step_speedup")


def _add_variant_entries(out: dict, prefix: str, res: ModeResult, summary: dict) -> None:
    w, (theory_step, theory_backward) = str(res.window), _VARIANT_THEORY[prefix]
    step, back = summary["step_ratios"], summary["backward_ratios"]
    out[f"{prefix}_step_speedup"][w] = summary["step"].get("median")
    out[f"{prefix}_backward_speedup"][w] = summary["backward"].get("median")
    out[f"{prefix}_step_speedup_range"][w] = [min(step), max(step)] if step else None
    out[f"{prefix}_backward_speedup_range"][w] = [min(back), max(back)] if back else None
    out[f"theory_{prefix}_step_speedup"][w] = theory_step(res.window)
    out[f"theory_{prefix}_backward_speedup"][w] = theory_backward(res.window)
    out[f"counted_{prefix}_step_speedup"][w] = summary["counted_step"]


def _mode_summary(exact: ModeResult, res: ModeResult, clock: str) -> dict:
    step = _ratios(exact.whole.get(clock, []), res.whole.get(clock, []))
    back = _ratios(exact.backward.get(clock, []), res.backward.get(clock, []))
    mem = (res.activation_peak_bytes / exact.activation_peak_bytes
           if res.activation_peak_bytes and exact.activation_peak_bytes else None)
    whole = res.whole.get(clock, [])
    first = res.first_call.get(clock)
    return dict(step=_stats(step), backward=_stats(back),
                step_ratios=step, backward_ratios=back,
                theory_step=exact.cost["step"] / res.cost["step"],
                theory_backward=exact.cost["backward"] / res.cost["backward"],
                counted_step=_counted(exact) / _counted(res),
                counted_backward=exact.passes["backward_samples"] / max(res.passes["backward_samples"], 1),
                activation_mem_ratio=mem,
                # the first call's extra time over a steady step: trace + passes for a compiled mode
                first_call_overhead=first - statistics.median(whole) if first is not None and whole else None)


def _add_window_entries(out: dict, w: str, res: ModeResult, summary: dict) -> None:
    step, back = summary["step_ratios"], summary["backward_ratios"]
    out["step_speedup"][w] = summary["step"].get("median")
    out["backward_speedup"][w] = summary["backward"].get("median")
    out["step_speedup_range"][w] = [min(step), max(step)] if step else None
    out["backward_speedup_range"][w] = [min(back), max(back)] if back else None
    out["theory_step_speedup"][w] = theory_step_speedup(res.window)
    out["theory_backward_speedup"][w] = theory_backward_speedup(res.window)
    out["theory_step_speedup_trajectory"][w] = summary["theory_step"]
    out["theory_backward_speedup_trajectory"][w] = summary["theory_backward"]
    out["counted_step_speedup"][w] = summary["counted_step"]
    out["counted_backward_speedup"][w] = summary["counted_backward"]
    out["peak_mem_ratio"][w] = summary["activation_mem_ratio"]
    out["compile_overhead_main_s"][w] = summary["first_call_overhead"]
    out["backward_passes"]["jagg"][w] = res.passes["backwards"]
    out["backward_samples"]["jagg"][w] = res.passes["backward_samples"]


def _counted(res: ModeResult) -> float:
    return res.passes["forward_samples"] + 2 * res.passes["backward_samples"]


def _vs_per_step_loop(results: dict, clock: str) -> dict:
    """Each mode against Flow-GRPO's per-step backward loop, the memory baseline trainers run:
    whole-step speedup per round (median [min, max]) and activation-peak ratio."""
    loop = results["exact_per_step"]
    out = {}
    for text, res in results.items():
        ratios = _ratios(loop.whole.get(clock, []), res.whole.get(clock, []))
        mem = (res.activation_peak_bytes / loop.activation_peak_bytes
               if res.activation_peak_bytes and loop.activation_peak_bytes else None)
        peak = (res.peak_memory_bytes / loop.peak_memory_bytes
                if res.peak_memory_bytes and loop.peak_memory_bytes else None)
        out[text] = dict(step_speedup=_stats(ratios), activation_peak_ratio=mem, peak_memory_ratio=peak)
    return out


def _mode_json(res: ModeResult) -> dict:
    d = asdict(res)
    if d["peak_memory_bytes"] is None:     # the CPU: the autograd-saved tensors' peak (device.py)
        d["peak_memory_bytes"] = res.activation_peak_bytes
    d["whole_stats"] = {c: _stats(v) for c, v in res.whole.items()}
    d["backward_stats"] = {c: _stats(v) for c, v in res.backward.items()}
    return d


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def _cpu_count() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def write_json(results: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


# ---------------------------------------------------------------------------------------------
# the printed table


def _fmt_stat(stat: dict, digits: int = 2) -> str:
    if not stat:
        return "-"
    return f"{stat['median']:.{digits}f} [{stat['min']:.{digits}f}-{stat['max']:.{digits}f}]"


def format_table(results: dict) -> str:
    """A readable summary of ``run_bench``'s results."""
    clock = results["clock"]
    lines = [
        f"jaggc bench: {results['model']} ({results['model_params'] / 1e6:.2f}M params), {results['num_steps']} "
        f"steps, batch {results['batch']}, {results.get('device_name', results.get('device'))} "
        f"{results.get('dtype', 'float32')}, {results['threads']} thread(s), torch {results['torch_version']}, "
        f"{results['repeats']} interleaved repeats, clock '{clock}'",
        "times: median [min-max]; speedups: per-round ratio to exact in the same round, median [min-max]; "
        "theory: the cost model (per window of the actual partition)",
        "",
    ]
    rows = [("mode", "step s", "backward s", "step x", "theory", "backward x", "theory", "DiT bwd (samples)",
             "act. MB (x)", "peak MB", "RSS MB", "1st call s")]
    for text, mode in results["modes"].items():
        rows.append(_mode_row(text, mode, results["speedups"][text], clock, results.get("device") == "cuda"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("-" * len(lines[-1]))
    lines.append("")
    for text, why in results.get("failed_modes", {}).items():
        lines.append(f"{text}: {why}")
    if results.get("skipped_modes"):
        lines.append(f"skipped for the time budget: {', '.join(results['skipped_modes'])}")
    windows = sorted(results["theory_step_speedup"], key=int)
    if windows:
        lines.append("JAGG by window (theory: the cost model of this loss; CFG split: uncond halves without grad):"
                     if results.get("cfg") else "JAGG by window (theory: 3W/(W+4) and W/2):")
        lines += [f"  W={w}: step {_num(results['step_speedup'][w])}x (theory {results['theory_step_speedup'][w]:.2f}), "
                  f"backward {_num(results['backward_speedup'][w])}x (theory {results['theory_backward_speedup'][w]:.2f}), "
                  f"activation memory {_num(results['peak_mem_ratio'][w])}x exact" for w in windows]
    for prefix, label in (("fast", "fast path (theory 3W/6, W/2)"), ("per_window", "per-window (theory 3W/(W+6), W/3)"),
                          ("lowmem", "low-memory (theory 3W/(W+4); backward inside the forward)")):
        for w in sorted(results.get(f"theory_{prefix}_step_speedup", {}), key=int):
            theory_back = results[f"theory_{prefix}_backward_speedup"][w]
            if results.get("cfg"):
                label = label.split(" (theory")[0] + (" (backward inside the forward)" if prefix == "lowmem" else "")
            lines.append(f"  {label} W={w}: step {_num(results[f'{prefix}_step_speedup'][w])}x "
                         f"(theory {results[f'theory_{prefix}_step_speedup'][w]:.2f}), backward "
                         f"{_num(results[f'{prefix}_backward_speedup'][w])}x"
                         + (f" (theory {theory_back:.2f})" if theory_back is not None else ""))
    for text, vs in results.get("vs_per_step_loop", {}).items():
        if text != "exact_per_step":
            lines.append(f"  {text} vs the per-step loop (exact_per_step): step {_fmt_stat(vs['step_speedup'])}x, "
                         f"activation peak {_num(vs['activation_peak_ratio'])}x")
    clock = results.get("compile_overhead_clock")
    details = results.get("compile_details", {})
    for capture, key in (("auto", "compile_overhead_default_s"), ("dynamo", "compile_overhead_s"),
                         ("fx", "compile_overhead_fx_s")):
        overhead = results.get(key, {})
        if not overhead:
            continue

        def parts(n, capture=capture):
            d = details.get(n, {})
            text = f"passes {d[capture]['passes'][clock]:.1f} s" if capture in d else ""
            if capture == "dynamo" and "glue_trace" in d:
                text += f", Dynamo on the loss alone {d['glue_trace'][clock]:.1f} s"
            return f" ({text})" if text else ""

        took = f" -> {'/'.join(results.get('compile_default_path', []))}" if capture == "auto" else ""
        lines.append(f"first-call overhead, capture={capture}{took} (trace + passes, {results['compile_overhead_model']}, "
                     f"{clock} s): " + ", ".join(f"{n} steps {s:.1f} s{parts(n)}" for n, s in overhead.items()))
    main = {w: s for w, s in results.get("compile_overhead_main_s", {}).items() if s is not None}
    if main:
        lines.append(f"first-call overhead of the benchmarked loss ({results['model']}, {results['num_steps']} steps, "
                     f"{results['clock']} s): " + ", ".join(
                         f"W={w} {s:.1f} s" + (" (first call faster than the median step: within noise)" if s < 0 else "")
                         for w, s in main.items()))
    lines.append(f"recompiles over repeated fixed-shape calls: {results.get('recompiles')}"
                 + (f" ({results['recompile_detail']['iterations']} training iterations)"
                    if results.get("recompile_detail") else ""))
    lines.append(f"elapsed {results['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _mode_row(text: str, mode: dict, sp: dict, clock: str, cuda: bool) -> tuple[str, ...]:
    act, mem = mode["activation_peak_bytes"], sp["activation_mem_ratio"]
    rss = mode.get("rss") or {}
    first = mode["first_call"].get(clock)
    return (text, _fmt_stat(mode["whole_stats"].get(clock, {})), _fmt_stat(mode["backward_stats"].get(clock, {})),
            _fmt_stat(sp["step"]), f"{sp['theory_step']:.2f}", _fmt_stat(sp["backward"]), f"{sp['theory_backward']:.2f}",
            f"{mode['passes']['backwards']} ({mode['passes']['backward_samples']})",
            f"{act / 2**20:.1f} ({mem:.2f})" if act and mem else "-",
            f"{mode['peak_memory_bytes'] / 2**20:.0f}" if cuda and mode.get("peak_memory_bytes") else "-",
            f"{rss['step_peak_mb']:.0f}" if rss.get("step_peak_mb") is not None else "-",
            "-" if first is None else f"{first:.2f}")


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"
