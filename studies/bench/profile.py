"""Where the time of one JAGG training step goes, against the cost model (``jaggc bench --profile W``).

Three measurements on the benchmarked problem:
  1. the cost model's ingredients, timed on their own (CPU clock, medians): one no-grad DiT forward
     of the (W-2)·B interior batch, one grad forward and one backward of the 2B knot batch; their
     sum per window times the number of windows is what a JAGG step should cost in DiT work;
  2. one compiled step under ``torch.profiler`` with named ranges: the DiT's forwards (with and
     without grad, from module hooks) and the runtime's pieces (input checks, batching the calls,
     splitting outputs, assembling the aggregation node), each reported exclusive of the ranges
     nested in it; the backward's ``KnotAggregateBackward``; and per range the ops that would be
     host syncs on a GPU (``aten::_local_scalar_dense``) and the copies/casts/concatenations;
  3. the graph glue: the compiled loss's forward against the same loss calling ``jagg_calls``
     directly (and the exact loss), interleaved, medians.
The ranges are installed by patching the runtime's module-level functions for the duration of the
profile only; nothing is changed outside it.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from typing import Any

import torch
from torch.autograd.profiler import record_function

from jaggc.runtime import partition
from jaggc.runtime.calls import concat_calls
from jaggc_studies.bench.device import DTYPES
from jaggc_studies.bench.problems import build_problem
from jaggc_studies.bench.strategies import compiled_loss, runtime_loss

# runtime functions wrapped in a named range while profiling: (module, attribute, range name). A
# function is patched where it is CALLED: the module whose global name the caller looks up.
_RANGES = (
    ("jaggc.graph_ops", "run_window", "jagg::run_window"),        # the compiled graph's node
    ("jaggc.runtime.trajectory", "run_window", "jagg::run_window"),   # jagg_calls
    ("jaggc.runtime.window", "nograd_outputs", "jagg::interior_outputs"),
    ("jaggc.runtime.window", "check_calls", "jagg::check_calls"),
    ("jaggc.runtime.window", "check_compatible", "jagg::check_compatible"),
    ("jaggc.runtime.window", "check_times", "jagg::check_times"),
    ("jaggc.runtime.forwards", "concat_calls", "jagg::concat_calls"),
    ("jaggc.runtime.forwards", "split_output", "jagg::split_output"),
    ("jaggc.runtime.window", "split_output", "jagg::split_output"),
    ("jaggc.runtime.window", "_assemble", "jagg::assemble"),
)
_COPY_OPS = ("aten::cat", "aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")
_SYNC_OPS = ("aten::_local_scalar_dense",)


def profile_window_step(config, window: int = 4, repeats: int = 3) -> dict:
    """Profile one step of ``@jagg_compile(window=W)`` on ``config``'s problem (module docstring)."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    problem = build_problem(config.family, config.size, num_steps=config.num_steps, batch=config.batch,
                            seed=config.seed, device=config.device, dtype=DTYPES[config.dtype], layers=config.layers,
                            resolution=config.resolution)
    compiled = compiled_loss(problem, window)
    losses = {"compiled": compiled, "runtime": runtime_loss(problem, window), "exact": problem.loss_fn}
    for loss in losses.values():   # trace, and warm every path once
        _step(problem, loss)
    out: dict[str, Any] = dict(model=problem.name, window=window, num_steps=problem.num_steps,
                               batch=problem.batch_size, threads=torch.get_num_threads(), clock="cpu")
    out["cost_model"] = _cost_model_parts(problem, window, repeats)
    out["glue"] = _glue(problem, losses, repeats)
    out["profile"] = _profiled_step(problem, compiled)
    out["profile_runtime"] = _profiled_step(problem, losses["runtime"])
    out["glue_ops"] = _outside_diff(out["profile"]["outside_ops"], out["profile_runtime"]["outside_ops"])
    return out


def _outside_diff(compiled: dict, runtime: dict) -> dict:
    """Top-level forward ops outside the runtime's ranges: compiled minus runtime (calls, ms)."""
    diff = {}
    for name in set(compiled) | set(runtime):
        c, r = compiled.get(name, {}), runtime.get(name, {})
        diff[name] = dict(calls=c.get("calls", 0) - r.get("calls", 0), ms=c.get("total_ms", 0.0) - r.get("total_ms", 0.0))
    return dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]["ms"]))[:15])


def _step(problem, loss_fn) -> tuple[float, float]:
    """(forward, backward) CPU seconds of one training step."""
    problem.model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    loss = loss_fn(problem.model, problem.batch)
    t1 = time.process_time()
    loss.backward()
    return t1 - t0, time.process_time() - t1


def _median_cpu(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def _cost_model_parts(problem, window: int, repeats: int) -> dict:
    """The DiT work of one step, from its parts timed alone."""
    calls = problem.dit_calls(problem.batch)
    model, batch = problem.model, problem.batch_size
    interior = concat_calls(calls[1:window - 1], "timestep") if window > 3 else calls[1]
    knots = concat_calls([calls[0], calls[window - 1]], "timestep")
    with torch.no_grad():
        f_b = _median_cpu(lambda: calls[0](model), repeats)
        f_interior = _median_cpu(lambda: interior(model), repeats) if window > 2 else 0.0

    def knot_pass():
        out = knots(model)
        leaf = out[0] if isinstance(out, tuple) else out.sample
        t0 = time.process_time()
        leaf.backward(torch.ones_like(leaf))
        return time.process_time() - t0

    grad_times, backward_times = [], []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.process_time()
        backward = knot_pass()
        grad_times.append(time.process_time() - t0 - backward)
        backward_times.append(backward)
    f_knots, b_knots = statistics.median(grad_times), statistics.median(backward_times)
    windows = partition(problem.num_steps, window)
    full = [w for w in windows if len(w) == window]
    per_window = f_interior + f_knots + b_knots
    return dict(
        forward_B_nograd_s=f_b, interior_forward_nograd_s=f_interior, knot_forward_grad_s=f_knots,
        knot_backward_s=b_knots, per_window_s=per_window,
        per_window_in_F=per_window / f_b, cost_model_per_window_in_F=window + 4,
        predicted_step_s=per_window * len(full) + sum(3 * f_b * len(w) for w in windows if len(w) != window),
        full_windows=len(full), batch=batch)


def _glue(problem, losses: dict, repeats: int) -> dict:
    """Forward and backward of the same step through the compiled graph, the runtime called
    directly, and the exact loss: interleaved rounds, medians."""
    rounds: dict[str, list] = {name: [] for name in losses}
    for _ in range(repeats):
        for name, loss in losses.items():
            rounds[name].append(_step(problem, loss))
    med = {name: dict(forward_s=statistics.median(f for f, _ in r), backward_s=statistics.median(b for _, b in r))
           for name, r in rounds.items()}
    med["compiled_minus_runtime_forward_s"] = med["compiled"]["forward_s"] - med["runtime"]["forward_s"]
    return med


@contextlib.contextmanager
def _named_ranges(model):
    """Wrap the runtime's functions and the DiT's forward in profiler ranges (restored on exit)."""
    import importlib

    patched = []
    for module_name, attr, name in _RANGES:
        module = importlib.import_module(module_name)
        fn = getattr(module, attr)   # a name that moved must fail here, not leave a range empty
        setattr(module, attr, _ranged(fn, name))
        patched.append((module, attr, fn))
    stack: list = []

    def enter(module, args):
        rf = record_function("dit::forward_grad" if torch.is_grad_enabled() else "dit::forward_nograd")
        rf.__enter__()
        stack.append(rf)

    def leave(module, args, output):
        stack.pop().__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module, attr, fn in patched:
            setattr(module, attr, fn)


def _ranged(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def _profiled_step(problem, compiled) -> dict:
    from torch.profiler import ProfilerActivity, profile

    problem.model.zero_grad(set_to_none=True)
    with _named_ranges(problem.model), profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step::forward"):
            loss = compiled(problem.model, problem.batch)
        with record_function("step::backward"):
            loss.backward()
    return _attribute(prof.events())


def _attribute(events) -> dict:
    """Exclusive time per named range, and syncs/copies per enclosing range (module docstring)."""
    named = [e for e in events if e.name.startswith(("jagg::", "dit::", "step::"))]
    exclusive = {id(e): e.cpu_time_total for e in named}
    for e in named:
        parent = _named_parent(e)
        if parent is not None:
            exclusive[id(parent)] -= e.cpu_time_total
    ranges: dict[str, dict] = {}
    for e in named:
        r = ranges.setdefault(e.name, dict(calls=0, total_ms=0.0, exclusive_ms=0.0))
        r["calls"] += 1
        r["total_ms"] += e.cpu_time_total / 1e3
        r["exclusive_ms"] += exclusive[id(e)] / 1e3
    ops: dict[str, dict] = {}
    for e in events:
        if e.name in _COPY_OPS + _SYNC_OPS + ("autograd::engine::evaluate_function: KnotAggregateBackward",):
            parent = _named_parent(e)
            where = parent.name if parent is not None else "(outside)"
            o = ops.setdefault(f"{e.name} in {where}", dict(calls=0, total_ms=0.0))
            o["calls"] += 1
            o["total_ms"] += e.cpu_time_total / 1e3
    outside: dict[str, dict] = {}   # the forward's own top-level ops: loss head + graph glue
    for e in events:
        parent = _visible_parent(e)
        if _is_glue_frame(e) or parent is None or parent.name != "step::forward" or e.name.startswith(("jagg::", "dit::")):
            continue
        o = outside.setdefault(e.name, dict(calls=0, total_ms=0.0))
        o["calls"] += 1
        o["total_ms"] += e.cpu_time_total / 1e3
    for e in events:   # Dynamo's frame itself: guard checks and the generated code's Python
        if _is_glue_frame(e):
            o = outside.setdefault(f"{e.name} (own time)", dict(calls=0, total_ms=0.0))
            o["calls"] += 1
            o["total_ms"] += (e.cpu_time_total - sum(c.cpu_time_total for c in e.cpu_children)) / 1e3
    return dict(ranges=ranges, ops=dict(sorted(ops.items(), key=lambda kv: -kv[1]["total_ms"])),
                outside_ops=dict(sorted(outside.items(), key=lambda kv: -kv[1]["total_ms"])))


def _is_glue_frame(event) -> bool:
    return event.name.startswith(("Torch-Compiled Region", "TorchDynamo"))


def _visible_parent(event):
    """The parent, looking through Dynamo's frame events (the compiled loss runs inside one)."""
    p = event.cpu_parent
    while p is not None and _is_glue_frame(p):
        p = p.cpu_parent
    return p


def _named_parent(event):
    p = event.cpu_parent
    while p is not None and not p.name.startswith(("jagg::", "dit::", "step::")):
        p = p.cpu_parent
    return p


def format_profile(profile: dict) -> str:
    """The profile as text: cost model vs measured, ranges, copies and syncs, glue."""
    cm, glue, prof = profile["cost_model"], profile["glue"], profile["profile"]
    lines = [f"profile: {profile['model']}, W={profile['window']}, {profile['num_steps']} steps, batch "
             f"{profile['batch']}, {profile['threads']} thread(s), CPU seconds",
             f"  cost model parts: F(B, no grad) {cm['forward_B_nograd_s']:.3f} s; interior no-grad forward "
             f"{cm['interior_forward_nograd_s']:.3f} s; knot forward (2B, grad) {cm['knot_forward_grad_s']:.3f} s; "
             f"knot backward {cm['knot_backward_s']:.3f} s",
             f"  per window {cm['per_window_s']:.3f} s = {cm['per_window_in_F']:.2f} F (cost model {cm['cost_model_per_window_in_F']} F);"
             f" predicted step {cm['predicted_step_s']:.3f} s",
             "  step through: " + ", ".join(
                 f"{name} forward {glue[name]['forward_s']:.3f} s + backward {glue[name]['backward_s']:.3f} s"
                 for name in ("compiled", "runtime", "exact")),
             f"  graph glue (compiled - runtime forward): {glue['compiled_minus_runtime_forward_s'] * 1e3:+.1f} ms",
             "  ranges (ms, exclusive of nested ranges):"]
    for name, r in sorted(prof["ranges"].items(), key=lambda kv: -kv[1]["exclusive_ms"]):
        lines.append(f"    {name:<28} calls {r['calls']:>3}  total {r['total_ms']:>9.1f}  exclusive {r['exclusive_ms']:>9.1f}")
    lines.append("  copies / casts / host syncs by enclosing range (ms):")
    for name, o in list(prof["ops"].items())[:16]:
        lines.append(f"    {name:<60} calls {o['calls']:>4}  {o['total_ms']:>8.1f}")
    lines.append("  forward ops outside the runtime, compiled minus runtime (calls, ms):")
    for name, d in profile.get("glue_ops", {}).items():
        lines.append(f"    {name:<60} {d['calls']:>+5}  {d['ms']:>+8.1f}")
    return "\n".join(lines)
