"""``jaggc bench --suite gpu``: the three questions a user on a GPU asks, in one command.

How many seconds does one GRPO step take, how much memory does it need, and does the speedup
survive at a real size? For each case (a model at a latent size, CFG on or off) one ``run_bench``
times ``SUITE_MODES`` side by side (interleaved rounds after a warm-up, CUDA events and the CUDA
peak allocation per step on a GPU), then the on-policy ratio check (``onpolicy.py``) runs once per
model family. The result is one JSON (every row: device, dtype, peak memory) and a markdown table.

``--size full`` (the GPU run, bf16, about 8 minutes on one H200 by the cost model; never run in CI):
SD3.5-Medium at 512 px (64x64 latents) with CFG off and on, and FLUX.1-dev at 512 px cut to 4 double
+ 8 single blocks (2.6B parameters; FLUX.1-dev is guidance-distilled and trained without CFG);
8 trained steps (two W=4 windows), batch 2. ``--size small``: the same suite on the tiny SD3 and
Flux configs, which runs on a CPU in well under 3 minutes (tests/studies/test_bench_suite.py).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from jaggc_studies.bench.config import BenchConfig
from jaggc_studies.bench.device import device_facts, resolve_device, resolve_dtype
from jaggc_studies.bench.onpolicy import format_ratio_check, ratio_check
from jaggc_studies.bench.runner import run_bench

WINDOW = 4
SUITE_MODES = ("exact_per_step", "exact", f"jagg@{WINDOW}", f"jagg_default@{WINDOW}", f"jagg_lowmem@{WINDOW}",
               f"jagg_fast@{WINDOW}")


@dataclass(frozen=True)
class Case:
    family: str
    size: str
    cfg: bool = False
    layers: int | None = None
    resolution: int | None = None


@dataclass(frozen=True)
class SuitePlan:
    cases: tuple[Case, ...]
    num_steps: int
    batch: int
    repeats: int


SUITE_SIZES = {
    "full": SuitePlan((Case("sd3", "sd35-medium", False, None, 512), Case("sd3", "sd35-medium", True, None, 512),
                       Case("flux", "flux-dev", False, 4, 512)), num_steps=8, batch=2, repeats=3),
    "small": SuitePlan((Case("sd3", "tiny"), Case("sd3", "tiny", True), Case("flux", "tiny")),
                       num_steps=8, batch=2, repeats=2),
}


def run_suite(*, device: str = "cuda", dtype: str = "bfloat16", size: str = "full", modes=SUITE_MODES,
              num_steps: int | None = None, batch: int | None = None, repeats: int | None = None,
              families: tuple[str, ...] | None = None, progress=None) -> dict:
    """Run the suite; returns the JSON-ready results (``rows``: one per case and mode)."""
    log = progress or (lambda msg: None)
    plan = SUITE_SIZES[size]
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    num_steps, batch, repeats = num_steps or plan.num_steps, batch or plan.batch, repeats or plan.repeats
    cases = [c for c in plan.cases if families is None or c.family in families]
    start = time.perf_counter()
    out = dict(suite="gpu", size=size, window=WINDOW, num_steps=num_steps, batch=batch, repeats=repeats,
               modes=list(modes), **device_facts(dev, dt), rows=[], cases={}, ratio_checks={}, errors={})
    for case in cases:
        label = f"{case.family}-{case.size}{f'-L{case.layers}' if case.layers else ''}{'-cfg' if case.cfg else ''}"
        log(f"suite case {label} ...")
        config = BenchConfig(family=case.family, size=case.size, cfg=case.cfg, layers=case.layers,
                             resolution=case.resolution, device=device, dtype=dtype, num_steps=num_steps,
                             batch=batch, modes=tuple(modes), repeats=repeats, compile_steps=(),
                             recompile_iterations=0, threads=1 if dev.type == "cpu" else None,
                             progress=progress)
        try:
            results = run_bench(config)
        except RuntimeError as e:       # the exact mode did not fit: the case is reported, the suite goes on
            out["errors"][label] = str(e).splitlines()[0]
            log(f"  {label}: {out['errors'][label]}")
            continue
        finally:
            _free(dev)
        label = results["model"]       # e.g. sd35-medium-512px-cfg, flux-tiny
        out["cases"][label] = {k: results[k] for k in ("model", "model_params", "cfg", "clock", "peak_memory_kind",
                                                       "failed_modes", "elapsed_s")}
        out["rows"] += _rows(label, results)
    for case in cases:
        if case.cfg or case.family in out["ratio_checks"]:
            continue
        log(f"on-policy ratio check, {case.family} ...")
        out["ratio_checks"][case.family] = ratio_check(case.family, case.size, window=WINDOW, num_steps=num_steps,
                                                       batch=batch, device=dev, dtype=dt, layers=case.layers,
                                                       resolution=case.resolution)
        _free(dev)
    out["elapsed_s"] = time.perf_counter() - start
    return out


def _free(device: torch.device) -> None:
    torch.compiler.reset()      # the compiled losses of a case are not reused by the next one
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _rows(label: str, results: dict) -> list[dict]:
    clock = results["clock"]
    rows = []
    for text in list(results["modes"]) + list(results["failed_modes"]):
        row = dict(case=label, model=results["model"], params=results["model_params"], cfg=results["cfg"], mode=text,
                   device=results["device"], device_name=results["device_name"], dtype=results["dtype"], clock=clock,
                   peak_memory_kind=results["peak_memory_kind"], peak_memory_bytes=None, step_memory_bytes=None,
                   step_s=None, backward_s=None, vs_per_step_loop=None, vs_exact=None, theory_vs_exact=None,
                   dit_backwards=None, error=results["failed_modes"].get(text))
        if text in results["modes"]:
            mode, sp = results["modes"][text], results["speedups"][text]
            row.update(peak_memory_bytes=mode["peak_memory_bytes"], step_memory_bytes=mode["step_memory_bytes"],
                       step_s=mode["whole_stats"].get(clock), backward_s=mode["backward_stats"].get(clock),
                       vs_exact=sp["step"], theory_vs_exact=sp["theory_step"], dit_backwards=mode["passes"]["backwards"],
                       vs_per_step_loop=results.get("vs_per_step_loop", {}).get(text, {}).get("step_speedup"))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# the markdown table


def _stat(stat: dict | None, digits: int = 2, suffix: str = "") -> str:
    if not stat:
        return "-"
    return f"{stat['median']:.{digits}f}{suffix} [{stat['min']:.{digits}f}-{stat['max']:.{digits}f}]"


def _memory(row: dict) -> str:
    if row["peak_memory_bytes"] is None:
        return "-"
    gib = row["peak_memory_bytes"] / 2**30
    return f"{gib:.2f}" if gib >= 0.1 else f"{row['peak_memory_bytes'] / 2**20:.1f} MiB"


def format_markdown(results: dict) -> str:
    cuda = results["device"] == "cuda"
    memory = "peak GiB (max_memory_allocated)" if cuda else "peak (autograd-saved tensors)"
    lines = [f"`jaggc bench --suite gpu --size {results['size']}`: {results['device_name']}, {results['dtype']}, "
             f"torch {results['torch_version']}" + (f", CUDA {results['cuda_version']}" if cuda else "") +
             f"; {results['num_steps']} trained steps, batch {results['batch']}, W={results['window']}, "
             f"{results['repeats']} interleaved rounds; times median [min-max]", "",
             f"| model | mode | step s | vs per-step loop | vs exact (theory) | {memory} | DiT backwards |",
             "|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if row["error"]:
            lines.append(f"| {row['case']} | {row['mode']} | {row['error']} | | | | |")
            continue
        lines.append(f"| {row['case']} | {row['mode']} | {_stat(row['step_s'], 3)} | {_stat(row['vs_per_step_loop'])} | "
                     f"{_stat(row['vs_exact'])} ({row['theory_vs_exact']:.2f}) | {_memory(row)} | {row['dit_backwards']} |")
    for label, error in results["errors"].items():
        lines.append(f"| {label} | (all) | {error} | | | | |")
    lines += ["", "On-policy ratio check (largest |ratio - 1|; Flow-GRPO clips at 1e-4):", "",
              "| model | " + " | ".join(next(iter(results["ratio_checks"].values()))["variants"]) + " |"
              if results["ratio_checks"] else "(no ratio check ran)"]
    if results["ratio_checks"]:
        names = list(next(iter(results["ratio_checks"].values()))["variants"])
        lines.append("|---|" + "---|" * len(names))
        for check in results["ratio_checks"].values():
            lines.append(f"| {check['model']} | " + " | ".join(
                f"{v['max_abs_ratio_minus_1']:.2g}" for v in check["variants"].values()) + " |")
    lines += ["", f"elapsed {results['elapsed_s']:.0f} s"]
    return "\n".join(lines)


def format_suite(results: dict) -> str:
    return "\n\n".join([format_markdown(results)] + [format_ratio_check(c) for c in results["ratio_checks"].values()])
