"""``jaggc trainers``: the trainers' own loss shapes through ``@jagg_compile``'s default capture.

For each shape of ``jaggc_studies.trainer_shapes`` (Flow-GRPO, DanceGRPO, MixGRPO, the JAGG author's
Qwen-Image loss, a loss on ``jaggc.grpo``'s helpers), compiled with ``capture="auto"``, in two forms:
``cpu`` (the code as it runs on this machine: the trainers' ``torch.autocast("cuda", ...)`` blocks
switch themselves off) and ``gpu`` (the same code with those blocks live, as on a GPU: bf16 CPU
autocast through ``jaggc.testing.cuda_autocast_on_cpu``, ``transformer.train()`` in the step):

  * the capture path taken and any fallback (a graph path is expected, never ``intercept``);
  * first-call overhead (trace + passes: first call minus second call, process CPU time) of a
    ``--first-call-steps``-step loss;
  * the loss value against the undecorated loss, the W=2 gradient against the undecorated one
    (under the same autocast) and the W=4 gradient against the hand-computed reference JAGG
    (``jaggc.verify.reference``, run under the same autocast);
  * DanceGRPO: ``--subsets`` fresh random 60% subsets through one compiled loss (traces taken);
  * MixGRPO: its moving window's 4, 3, 2, 1-step positions through one compiled loss, and the
    speed of its 4-step window against its own per-step loop (``loss.backward()`` per step), with
    the joint and the low-memory backward, interleaved rounds, CPU time (GPU form);
  * the author's shape: ``@jagg_compile(window=4, weights="t")`` (the same estimator) against the
    author's two-backward JAGG (``trainer_shapes.author_two_backward``), forward + backward,
    interleaved rounds, CPU time.

    jaggc trainers [--names a,b] [--forms cpu,gpu] [--steps 8] [--first-call-steps 50] [--subsets 50]
                   [--speed-size 10m] [--speed-steps 16] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
from typing import Callable

import torch

from jaggc_studies import loops, trainer_shapes
from jaggc_studies.loops import report as loop_report
from jaggc.api import DEFAULT_WEIGHTS, jagg_compile
from jaggc.runtime.module_state import module_state, set_state
from jaggc.testing import cuda_autocast_on_cpu
from jaggc.verify.reference import reference_jagg

WINDOW = 4
FORMS = ("cpu", "gpu")
# on a CPU the trainers' torch.autocast("cuda", ...) blocks warn that they switch themselves off
_CUDA_OFF_WARNING = ".*CUDA is not available.*"


@contextlib.contextmanager
def trainer_form(form: str):
    """The trainers' code as it runs here ("cpu": their CUDA autocast blocks off) or on a GPU
    ("gpu": those blocks live bf16 blocks)."""
    if form not in FORMS:
        raise ValueError(f"form={form!r}: use one of {FORMS}")
    with warnings.catch_warnings(), (cuda_autocast_on_cpu() if form == "gpu" else contextlib.nullcontext()):
        warnings.filterwarnings("ignore", message=_CUDA_OFF_WARNING)
        # diffusers' RMSNorm under bf16 autocast: torch notes it cannot use the fused kernel
        warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight.*")
        yield


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def _loss_and_grad(fn: Callable, args: tuple, model) -> tuple[float, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    loss = fn(*args)
    loss.backward()
    grad = _flat_grad(model).clone()
    for p in model.parameters():
        p.grad = None
    return float(loss.detach()), grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def first_call(name: str, steps: int, form: str = "cpu") -> dict:
    """Overhead of the first call of the default-compiled loss on a ``steps``-step trajectory."""
    with trainer_form(form):
        shape = trainer_shapes.SHAPES[name](num_steps=steps)
        compiled = jagg_compile(shape.loss_fn, dit=shape.model, window=WINDOW)
        entry = module_state(shape.model)       # the state a rollout leaves the module in, each call

        def call():
            set_state(shape.model, entry)
            start = time.process_time()
            compiled(*shape.args)
            return time.process_time() - start

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = call(), call()
    return dict(path=compiled.report.path, first_call_overhead_s=first - second, traces=compiled.traces,
                fallback_warnings=[str(w.message) for w in caught if "runs through capture path" in str(w.message)],
                dit_calls=len(compiled.report.windows) and sum(len(w.steps) for w in compiled.report.windows))


def gradient_check(name: str, steps: int, form: str = "cpu") -> dict:
    """Loss and W=2 gradient against the undecorated loss, W=4 against the reference JAGG, all in
    ``form`` (the GPU form: under the trainers' live bf16 autocast blocks)."""
    with trainer_form(form):
        shape = trainer_shapes.SHAPES[name](num_steps=steps)
        exact_loss, exact = _loss_and_grad(shape.loss_fn, shape.args, shape.model)
        out = dict(exact_loss=exact_loss)
        for window in (2, WINDOW):
            compiled = jagg_compile(shape.loss_fn, dit=shape.model, window=window)
            loss, grad = _loss_and_grad(compiled, shape.args, shape.model)
            out[f"w{window}_path"] = compiled.report.path
            out[f"w{window}_loss_abs_diff"] = abs(loss - exact_loss)
            if window == 2:
                out["w2_rel_err_vs_exact"] = _rel(grad, exact)
            else:
                # the default weights: plain JAGG with windows reaching σ < DEFAULT_WEIGHTS.exact_below exact
                _, ref = reference_jagg(shape.loss_fn, shape.args, shape.model, window,
                                        exact_below=DEFAULT_WEIGHTS.exact_below)
                out[f"w{window}_rel_err_vs_reference_jagg"] = _rel(grad, ref)
                out[f"w{window}_rel_err_vs_exact"] = _rel(grad, exact)
                out["autocast"] = sorted({w.autocast for w in compiled.report.windows})
    return out


def mix_windows(form: str = "gpu") -> dict:
    """MixGRPO's window at the positions where it has 4, 3, 2 and 1 trained steps, through ONE
    compiled loss (``window=4``): each call's loss against the undecorated one, its windows, and a
    no-grad call (a logged value) of the same compiled loss."""
    rows = []
    with trainer_form(form):
        shape = trainer_shapes.mix_grpo_flux()
        transformer, sample, _, sigmas, args = shape.args
        compiled = jagg_compile(shape.loss_fn, dit=transformer, window=WINDOW)
        for cur in (0, 20, 21, 22):
            steps = trainer_shapes.mix_train_timesteps(cur)
            call = (transformer, sample, steps, sigmas, args)
            loss, grad = _loss_and_grad(compiled, call, transformer)
            exact_loss, _ = _loss_and_grad(shape.loss_fn, call, transformer)
            rows.append(dict(cur=cur, trained=len(steps), windows=[w.steps for w in compiled.report.windows],
                             loss_abs_diff=abs(loss - exact_loss), grad_finite=bool(torch.isfinite(grad).all())))
        with torch.no_grad():
            logged = float(compiled(*call))
        expected = _loss_value(shape.loss_fn, call)
    return dict(positions=rows, traces=compiled.traces, path=compiled.report.path,
                no_grad_loss_abs_diff=abs(logged - expected))


def _loss_value(fn, args) -> float:
    with torch.no_grad():
        return float(fn(*args))


def mix_speed(size: str, rounds: int, form: str = "gpu") -> dict:
    """MixGRPO's 4-step window: its own per-step loop (``loss.backward()`` per step) against one
    compiled loss with the joint and with the low-memory backward, interleaved, one thread,
    process CPU time; ratios per round."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with trainer_form(form):
            shape = trainer_shapes.mix_grpo_flux(size=size)
            model = shape.model
            compiled = {mode: jagg_compile(shape.loss_fn, dit=model, window=WINDOW, backward=mode)
                        for mode in ("joint", "lowmem")}

            def per_step():
                shape.extra["per_step"](*shape.args)

            steps = {"per_step": per_step, **{mode: (lambda c=c: c(*shape.args).backward()) for mode, c in compiled.items()}}

            def timed(fn):
                for p in model.parameters():
                    p.grad = None
                start = time.process_time()
                fn()
                return time.process_time() - start

            for fn in steps.values():
                timed(fn)                      # warm-up: the trace, the allocator
            seconds = {k: [] for k in steps}
            for r in range(rounds):
                order = list(steps) if r % 2 == 0 else list(reversed(steps))
                for k in order:
                    seconds[k].append(timed(steps[k]))
        ratios = {mode: [a / b for a, b in zip(seconds["per_step"], seconds[mode])] for mode in compiled}
        return dict(model=f"flux-{size}", params=sum(p.numel() for p in model.parameters()), form=form,
                    window=WINDOW, rounds=rounds, paths={m: c.report.path for m, c in compiled.items()},
                    speedup_median={m: statistics.median(r) for m, r in ratios.items()},
                    speedup_min={m: min(r) for m, r in ratios.items()}, seconds=seconds,
                    cost_model=(3 * WINDOW) / (WINDOW + 4))
    finally:
        torch.set_num_threads(threads)


def dance_subsets(count: int) -> dict:
    """``count`` distinct random subsets of DanceGRPO's steps through one compiled loss."""
    shape = trainer_shapes.dance_grpo_flux()
    transformer, sample, _, sigmas, args = shape.args
    compiled = jagg_compile(shape.loss_fn, dit=transformer, window=3)
    g = torch.Generator().manual_seed(1)
    seen, worst_diff, times = set(), 0.0, []
    while len(seen) < count:
        perm = trainer_shapes.random_subset(shape.extra["num_steps"], shape.extra["fraction"], g)
        if tuple(perm.tolist()) in seen:
            continue
        seen.add(tuple(perm.tolist()))
        transformer.eval()                   # as after the rollout
        start = time.process_time()
        out = compiled(transformer, sample, perm, sigmas, args)
        times.append(time.process_time() - start)
        transformer.eval()
        worst_diff = max(worst_diff, abs(float(out.detach() - shape.loss_fn(transformer, sample, perm, sigmas, args).detach())))
    return dict(distinct_subsets=len(seen), traces=compiled.traces, path=compiled.report.path,
                max_loss_abs_diff=worst_diff, max_call_s=max(times), median_call_s=statistics.median(times))


def author_speed(size: str, steps: int, rounds: int, batch: int = 2) -> dict:
    """Forward + backward of the author's two-backward JAGG against
    ``@jagg_compile(window=4, weights="t")`` on the same loss, interleaved, one thread, process CPU
    time; ratios per round."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = trainer_shapes.jagg_author_qwen(num_steps=steps, batch=batch, size=size)
        model = shape.model
        # the author's algorithm is plain JAGG: compare the same estimator (weights="t")
        compiled = jagg_compile(shape.loss_fn, dit=model, window=WINDOW, weights="t")
        entry = module_state(model)

        def jaggc_step():
            set_state(model, entry)
            compiled(*shape.args).backward()

        def author_step():
            set_state(model, entry)
            trainer_shapes.author_two_backward(*shape.args, window=WINDOW)

        def timed(fn):
            for p in model.parameters():
                p.grad = None
            start = time.process_time()
            fn()
            return time.process_time() - start

        timed(jaggc_step), timed(author_step)       # warm-up: the trace, allocator
        ratios, author_s, jaggc_s = [], [], []
        for r in range(rounds):
            order = (author_step, jaggc_step) if r % 2 == 0 else (jaggc_step, author_step)
            t = {fn: timed(fn) for fn in order}
            author_s.append(t[author_step])
            jaggc_s.append(t[jaggc_step])
            ratios.append(t[author_step] / t[jaggc_step])
        return dict(model=f"qwen-image-{size}", params=sum(p.numel() for p in model.parameters()), steps=steps,
                    batch=batch, window=WINDOW, path=compiled.report.path, rounds=rounds,
                    speedup_median=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios),
                    author_s=author_s, jaggc_s=jaggc_s, cost_model=(WINDOW + 6) / (WINDOW + 4))
    finally:
        torch.set_num_threads(threads)


def run(names, *, steps: int, first_call_steps: int, subsets: int, speed_size: str, speed_steps: int,
        rounds: int, forms=FORMS, progress: Callable[[str], None] = print) -> dict:
    results: dict = dict(shapes={}, torch_version=torch.__version__, forms=list(forms))
    for form in forms:
        for name in names:
            progress(f"{name} ({form} form): gradient checks ({steps} steps) ...")
            row = gradient_check(name, steps, form)
            progress(f"{name} ({form} form): first call ({first_call_steps} steps) ...")
            row.update(first_call(name, first_call_steps, form), first_call_steps=first_call_steps, steps=steps,
                       form=form)
            results["shapes"][f"{name}/{form}"] = row
    if subsets and "dance_grpo_flux" in names:
        progress(f"dance_grpo_flux: {subsets} random subsets ...")
        results["dance_subsets"] = dance_subsets(subsets)
    if "mix_grpo_flux" in names:
        form = "gpu" if "gpu" in forms else forms[0]
        progress(f"mix_grpo_flux ({form} form): the moving window's 4, 3, 2, 1-step positions ...")
        results["mix_windows"] = mix_windows(form)
        if rounds:
            progress(f"mix_grpo_flux ({form} form): speed vs MixGRPO's own per-step loop ({speed_size}) ...")
            results["mix_speed"] = mix_speed(speed_size, rounds, form)
    if rounds and "jagg_author_qwen" in names:
        progress(f"jagg_author_qwen: speed vs the author's two-backward JAGG ({speed_size}, {speed_steps} steps) ...")
        results["author_speed"] = author_speed(speed_size, speed_steps, rounds)
    return results


def format_table(results: dict) -> str:
    head = ["shape", "form", "path", "first call (s)", "loss |diff|", "W=2 vs undecorated", "W=4 vs ref JAGG",
            "W=4 vs exact"]
    rows = [[key.split("/")[0], r["form"], r["path"], f"{r['first_call_overhead_s']:.2f} ({r['first_call_steps']} steps)",
             f"{r['w4_loss_abs_diff']:.1e}", f"{r['w2_rel_err_vs_exact']:.1e}",
             f"{r['w4_rel_err_vs_reference_jagg']:.1e}", f"{r['w4_rel_err_vs_exact']:.2f}"]
            for key, r in results["shapes"].items()]
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    if "dance_subsets" in results:
        d = results["dance_subsets"]
        lines.append(f"DanceGRPO: {d['distinct_subsets']} distinct random subsets, "
                     f"{d['traces']} traces, path {d['path']}, max |loss diff| {d['max_loss_abs_diff']:.1e}, "
                     f"slowest call {d['max_call_s']:.2f} s")
    if "mix_windows" in results:
        m = results["mix_windows"]
        lines.append("MixGRPO's moving window through one compiled loss (path " + m["path"] + f", {m['traces']} traces): "
                     + ", ".join(f"{p['trained']} step(s) at {p['cur']} -> windows {p['windows']} "
                                 f"(|loss diff| {p['loss_abs_diff']:.1e})" for p in m["positions"])
                     + f"; a no-grad call: |loss diff| {m['no_grad_loss_abs_diff']:.1e}")
    if "mix_speed" in results:
        m = results["mix_speed"]
        lines.append(f"MixGRPO's 4-step window vs its own per-step loop ({m['model']}, {m['params'] / 1e6:.1f}M params, "
                     f"{m['form']} form): " + ", ".join(
                         f"{mode} {m['speedup_median'][mode]:.2f}x (min {m['speedup_min'][mode]:.2f}x, path "
                         f"{m['paths'][mode]})" for mode in m["speedup_median"])
                     + f" over {m['rounds']} rounds (cost model {m['cost_model']:.2f}x)")
    if "author_speed" in results:
        a = results["author_speed"]
        lines.append(f"author's two-backward JAGG vs @jagg_compile(window={a['window']}) ({a['model']}, "
                     f"{a['params'] / 1e6:.1f}M params, {a['steps']} steps, batch {a['batch']}, path {a['path']}): "
                     f"{a['speedup_median']:.2f}x [{a['speedup_min']:.2f}-{a['speedup_max']:.2f}] over "
                     f"{a['rounds']} rounds (cost model {a['cost_model']:.2f}x)")
    return "\n".join(lines)


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def loop_place(args):
    """Where --loops run (trainers/sizes.Where), or SystemExit with one line naming the fix."""
    from jaggc_studies.bench.device import DeviceUnavailable, resolve_device, resolve_dtype
    from jaggc_studies.trainers.sizes import Where

    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(DTYPE_ALIASES.get(args.dtype, args.dtype))
    except (DeviceUnavailable, ValueError) as e:
        raise SystemExit(f"jaggc trainers: {e}") from None
    if args.speed_size != "published" and args.layers is not None:
        raise SystemExit("jaggc trainers: --layers cuts the published models' depth; add --speed-size published")
    return Where(args.speed_size, device=str(device), dtype=dtype, layers=args.layers, resolution=args.resolution)


def main(args) -> int:
    names = (list(trainer_shapes.SHAPES) if not args.names else []
             if args.names == "none" else [n for n in args.names.split(",") if n])
    unknown = [n for n in names if n not in trainer_shapes.SHAPES]
    if unknown:
        raise SystemExit(f"jaggc trainers: unknown shape(s) {unknown}; choose from {list(trainer_shapes.SHAPES)}")
    forms = [f for f in args.forms.split(",") if f]
    if not forms or any(f not in FORMS for f in forms):
        raise SystemExit(f"jaggc trainers: --forms {args.forms!r}: a comma-separated subset of {', '.join(FORMS)}")
    loop_names = [n for n in args.loops.split(",") if n]
    if any(n not in loops.LOOPS for n in loop_names):
        raise SystemExit(f"jaggc trainers: --loops {args.loops!r}: a comma-separated subset of {', '.join(loops.LOOPS)}")
    framework_names = [n for n in args.frameworks.split(",") if n]
    if any(n not in loops.FRAMEWORK_LOOPS for n in framework_names):
        raise SystemExit(f"jaggc trainers: --frameworks {args.frameworks!r}: a comma-separated subset of "
                         f"{', '.join(loops.FRAMEWORK_LOOPS)}")
    if framework_names and (args.speed_size == "published" or args.device != "cpu"):
        raise SystemExit("jaggc trainers: --frameworks runs the CPU forms (--speed-size tiny or 10m, --device cpu)")
    results = run(names, steps=args.steps, first_call_steps=args.first_call_steps, subsets=args.subsets,
                  speed_size=args.speed_size, speed_steps=args.speed_steps, rounds=args.rounds, forms=forms) \
        if names else dict(shapes={})
    where = loop_place(args) if loop_names else None
    if args.speed_size == "published" and names:
        raise SystemExit("jaggc trainers: --speed-size published applies to --loops only; add --names none")
    if loop_names:
        backwards = tuple(b for b in args.backwards.split(",") if b)
        if not backwards or any(b not in loop_report.FORMS for b in backwards):
            raise SystemExit(f"jaggc trainers: --backwards {args.backwards!r}: a comma-separated subset of "
                             f"{', '.join(loop_report.FORMS)}")
        results["loops"] = loop_report.run_loops(loop_names, where=where, rounds=args.rounds, forms=backwards)
    if framework_names:
        from jaggc_studies.loops import frameworks_speed

        timed = frameworks_speed.measure(args.speed_size, max(args.rounds, 1), loops=framework_names)
        results["frameworks"] = dict(lines_changed={n: loops.lines_changed(n) for n in framework_names}, speed=timed)
    if names:
        print(format_table(results))
    if loop_names:
        print(loop_report.format_loops(results["loops"]))
    if framework_names:
        print("  " + ", ".join(f"{n}: {k} lines changed" for n, k in results["frameworks"]["lines_changed"].items()))
        print(frameworks_speed.format_results(results["frameworks"]["speed"], args.speed_size, max(args.rounds, 1)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    graph = all(r["path"] != "intercept" for r in results["shapes"].values())
    fewer = all(c["reduce_scatters_per_trajectory"][f] < c["reduce_scatters_per_trajectory"]["unchanged"]
                for r in results.get("loops", {}).values() if (c := r.get("collectives")) for f in ("joint", "lowmem"))
    return 0 if graph and fewer else 1


def add_arguments(p) -> None:
    p.add_argument("--names", default="", help=f"comma-separated shapes (default all; 'none': only the loops): "
                                               f"{', '.join(trainer_shapes.SHAPES)}")
    p.add_argument("--forms", default=",".join(FORMS),
                   help="cpu: the trainers' CUDA autocast blocks off, as on this machine; gpu: live (bf16 CPU autocast)")
    p.add_argument("--steps", type=int, default=8, help="steps of the gradient-check trajectories")
    p.add_argument("--first-call-steps", type=int, default=50, help="steps of the first-call overhead probe")
    p.add_argument("--subsets", type=int, default=50, help="DanceGRPO random subsets through one compiled loss")
    p.add_argument("--speed-size", default="10m", choices=["tiny", "10m", "published"],
                   help="model size of the speed runs (Qwen-Image for the author's, Flux for MixGRPO's); 'published' "
                        "(--loops only): SD3.5-Medium with Flow-GRPO's LoRA, FLUX.1-dev for DanceGRPO and MixGRPO")
    p.add_argument("--device", default="cpu", help="where --loops run: cpu, cuda, cuda:N (the shapes' checks stay on the CPU)")
    p.add_argument("--dtype", default="float32",
                   help="--loops' weights dtype: float32, bf16 (bfloat16) or fp16 (float16); on the CPU a half dtype "
                        "runs the trainers' GPU form (their CUDA bf16 autocast blocks live)")
    p.add_argument("--layers", type=int, default=None,
                   help="--speed-size published: cut the depth to fit memory (Flux: N double + 2N single blocks)")
    p.add_argument("--resolution", type=int, default=512, help="--speed-size published: image size in px")
    p.add_argument("--speed-steps", type=int, default=16, help="trained steps of the author speed run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds of the speed runs (0: skip)")
    p.add_argument("--loops", default=",".join(loops.LOOPS),
                   help="the trainers' own per-step loops with jaggc.stepwise to measure (lines changed, CPU time, "
                        "peak activations, collectives); '' to skip")
    p.add_argument("--frameworks", default="",
                   help=f"the frameworks' per-step loops with jaggc.stepwise to time on the CPU (comma-separated: "
                        f"{', '.join(loops.FRAMEWORK_LOOPS)}; lines changed, CPU time against the unchanged loop at W=4 "
                        f"with 8 trained steps, cost model); default none")
    p.add_argument("--backwards", default="joint,lowmem,per_window",
                   help="--loops: the stepwise backward forms to measure (each with its CFG-slice, rollout-cache and "
                        "guard-probe variants); fewer forms, a shorter run")
    p.add_argument("--json", default=None, help="write the results as JSON")
