"""``jaggc bench --scaling``: how JAGG's step speedup and the backward/forward cost ratio move with
model width on this machine (a benchmark, not a test).

The cost model assumes backward = 2 forwards; on a toy width one backward costs about one forward
(overheads, not GEMMs, dominate), which flatters JAGG less than a real size would. Each row is one
``run_bench`` of exact vs ``jagg@4`` on the same loss (Flow-GRPO's SD3 loss, 4 trained steps = one
window, batch 2, fp32, one thread, process CPU time), with interleaved rounds; per round the
backward/forward ratio is the exact mode's backward time over its forward time, and the speedup
the exact step over the JAGG step of the same round. Reported: median [min-max] over rounds.

Sizes: the tiny and 10M SD3 configs (``jaggc.models``), and SD3.5-Medium cut to 1 layer (its real
width 1536, 24 heads, 90M parameters; ``model_configs``) at 32x32 latents (256 px) with its real
text length (333 tokens).
"""

from __future__ import annotations

import statistics

from jaggc_studies.bench.config import BenchConfig
from jaggc_studies.bench.runner import run_bench

SCALING_SIZES = (  # (label, size, layers, resolution, repeats)
    ("sd3 tiny (8x8 latents)", "tiny", None, None, 9),
    ("sd3 10m (32x32 latents)", "10m", None, None, 7),
    ("SD3.5-Medium, 1 layer (32x32 latents)", "sd35-medium", 1, 256, 3),
)


def run_scaling(*, num_steps: int = 4, batch: int = 2, repeats: int | None = None, sizes=SCALING_SIZES,
                progress=None) -> dict:
    rows = []
    for label, size, layers, resolution, default_repeats in sizes:
        config = BenchConfig(family="sd3", size=size, layers=layers, resolution=resolution, num_steps=num_steps,
                             batch=batch, modes=("exact", "jagg@4"), repeats=repeats or default_repeats,
                             clocks=("cpu", "wall"), compile_steps=(), recompile_iterations=0, threads=1,
                             activation_memory=False, progress=progress)
        results = run_bench(config)
        exact, clock = results["modes"]["exact"], results["clock"]
        bwd_fwd = [b / (w - b) for w, b in zip(exact["whole"][clock], exact["backward"][clock]) if w > b]
        jagg = results["speedups"]["jagg@4"]
        rows.append(dict(label=label, model=results["model"], params=results["model_params"],
                         step_speedup=jagg["step"], backward_speedup=jagg["backward"],
                         theory_step=jagg["theory_step"], theory_backward=jagg["theory_backward"],
                         backward_forward_ratio=_stats(bwd_fwd), rounds=config.repeats,
                         exact_step_s=exact["whole_stats"][clock]))
    return dict(num_steps=num_steps, batch=batch, window=4, clock="cpu", threads=1, dtype="float32",
                device_name=results["device_name"], torch_version=results["torch_version"], rows=rows)


def _stats(xs: list[float]) -> dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs)) if xs else {}


def _fmt(stat: dict) -> str:
    return f"{stat['median']:.2f} [{stat['min']:.2f}-{stat['max']:.2f}]" if stat else "-"


def format_scaling(results: dict) -> str:
    lines = [f"| model | params | backward/forward (exact) | W=4 step speedup (theory {results['rows'][0]['theory_step']:.2f}) "
             f"| W=4 backward speedup (theory {results['rows'][0]['theory_backward']:.2f}) | exact step s | rounds |",
             "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['label']} | {r['params'] / 1e6:.2f}M | {_fmt(r['backward_forward_ratio'])} | "
                     f"{_fmt(r['step_speedup'])} | {_fmt(r['backward_speedup'])} | {_fmt(r['exact_step_s'])} | {r['rounds']} |")
    lines.append(f"\n{results['device_name']}, torch {results['torch_version']}, {results['dtype']}, "
                 f"{results['threads']} thread, {results['num_steps']} trained steps (one W=4 window), batch "
                 f"{results['batch']}, process CPU time; median [min-max] over interleaved rounds")
    return "\n".join(lines)
