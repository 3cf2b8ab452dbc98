"""The study commands of the ``jaggc`` command line: example, inspect, demo, bench, calibrate,
trainers. ``jaggc.cli`` finds them through the ``jaggc.commands`` entry point (pyproject), so the
compiler's own command line imports nothing of the studies."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _grads(model):
    import torch

    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cmd_example(args) -> int:
    import torch

    import jaggc
    from jaggc_studies.example_losses import build_example
    from jaggc.runtime import count_dit_passes

    torch.manual_seed(args.seed)
    ex = build_example(args.name, num_steps=args.steps, batch=args.batch, seed=args.seed)
    print(f"example {ex.name}: {ex.description}")
    print(f"  {args.steps} trained steps, batch {args.batch}, window {args.window}, weights {args.weights}")

    def run(loss_fn):
        ex.model.zero_grad(set_to_none=True)
        with count_dit_passes(ex.model) as counts:
            loss = loss_fn(ex.model, ex.batch)
            loss.backward()
        return loss.detach(), _grads(ex.model).clone(), counts

    loss_exact, g_exact, c_exact = run(ex.loss_fn)
    compiled = jaggc.jagg_compile(ex.loss_fn, window=args.window, weights=args.weights)
    run(compiled)  # first call traces and rewrites
    loss_jagg, g_jagg, c_jagg = run(compiled)
    cos = torch.nn.functional.cosine_similarity(g_jagg.double(), g_exact.double(), 0).item()
    rel = ((g_jagg - g_exact).norm() / g_exact.norm()).item()
    print(compiled.report)
    print()
    print(f"  DiT backward passes:   exact {c_exact.backwards} (samples {c_exact.backward_samples})"
          f"  ->  jagg {c_jagg.backwards} (samples {c_jagg.backward_samples})")
    print(f"  loss value:            exact {loss_exact.item():.6g}  jagg {loss_jagg.item():.6g}")
    print(f"  gradient agreement:    cosine {cos:.4f}, relative error {rel:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"example": ex.name, "window": args.window, "backward_passes": {
                "exact": c_exact.backwards, "jagg": c_jagg.backwards}, "grad_cosine": cos, "grad_rel_err": rel}, f,
                indent=2)
    return 0


def cmd_inspect(args) -> int:
    import jaggc
    from jaggc import report_drawing
    from jaggc_studies.example_losses import EXAMPLES, build_example

    names = args.examples or list(EXAMPLES)
    os.makedirs(args.out, exist_ok=True)
    no_matplotlib = report_drawing.matplotlib_missing() if args.view != "full" else None
    if no_matplotlib:
        print(f"matplotlib is not importable ({no_matplotlib}): writing the condensed view as text "
              f"(pip install 'jaggc[examples]' for PNG/SVG)\n")
    for name in names:
        ex = build_example(name, num_steps=args.steps, batch=args.batch, seed=args.seed)
        report = jaggc.explain(ex.loss_fn, ex.model, ex.batch, window=args.window, weights=args.weights)
        print(f"== {name}: {ex.description}")
        print(report)
        stem = os.path.join(args.out, name)
        paths = []
        if args.view in ("condensed", "both"):
            paths += report.render_condensed(stem, name=name)
        if args.view in ("full", "both"):
            # every fx node; .full keeps it apart from the condensed SVG (DOT text without Graphviz)
            paths.append(report.render(stem + ".full.svg"))
        with open(stem + ".diff", "w") as f:
            f.write(report.diff())
        print(f"   picture: {'  '.join(paths)}   diff: {stem}.diff\n")
    return 0


def cmd_demo(args) -> int:
    import torch

    from jaggc_studies.digits.demo import DemoOptions, main_demo

    torch.set_num_threads(args.threads)
    options = DemoOptions(iterations=args.iterations, seed=args.seed, seeds=args.seeds, reward=args.reward,
                          window=args.window, weights=args.weights, jagg_frac=args.jagg_frac,
                          rollout_cache=not args.no_rollout_cache, num_steps=args.num_steps,
                          strategies=tuple(args.strategies), base=args.base,
                          eval_per_class=args.eval_per_class, classes_per_iter=args.classes_per_iter,
                          group_size=args.group_size, lr=args.lr, progress=not args.no_progress,
                          out=None if args.no_pictures else args.out, guard=args.guard)
    main_demo(options, json_path=args.json)
    return 0


def cmd_bench(args) -> int:
    from jaggc_studies.bench import (BenchConfig, format_profile, format_table, profile_window_step, quick_config, run_bench,
                             write_json)
    from jaggc_studies.bench.device import DeviceUnavailable, resolve_device

    try:
        resolve_device(args.device)
    except DeviceUnavailable as e:
        print(f"jaggc bench: error: {e}", file=sys.stderr)
        return 2
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.no_progress else None
    if args.suite:
        return _bench_suite(args, progress)
    if args.scaling:
        from jaggc_studies.bench.scaling import format_scaling, run_scaling

        results = run_scaling(progress=progress, repeats=args.repeats)
        print(format_scaling(results))
        if args.json:
            write_json(results, args.json)
        return 0
    overrides = {k: v for k, v in dict(
        family=args.family, size=args.size, num_steps=args.steps, batch=args.batch, repeats=args.repeats,
        device=args.device, dtype=args.dtype or None, layers=args.layers, resolution=args.resolution,
        warmup=args.warmup,
        threads=args.threads, rss=args.rss or None, budget_s=args.budget, cfg=args.cfg or None,
        modes=tuple(args.modes.split(",")) if args.modes else None,
        clocks=(args.clock,) + tuple(c for c in ("cpu", "wall") if c != args.clock) if args.clock else None,
        compile_steps=tuple(int(n) for n in args.compile_steps.split(",") if n) if args.compile_steps is not None
        else None,
    ).items() if v is not None}
    if args.quick:
        config = quick_config(**overrides)
    else:
        config = BenchConfig()
        for k, v in overrides.items():
            setattr(config, k, v)
    config.progress = progress
    results = run_bench(config)
    print(format_table(results))
    if args.profile:
        results["profile"] = profile_window_step(config, window=args.profile)
        print()
        print(format_profile(results["profile"]))
    if args.json:
        write_json(results, args.json)
    return 0


def _bench_suite(args, progress) -> int:
    from jaggc_studies.bench import write_json
    from jaggc_studies.bench.suite import format_markdown, format_suite, run_suite

    results = run_suite(device=args.device, dtype=args.dtype or "bfloat16", size=args.size or "full",
                        num_steps=args.steps, batch=args.batch, repeats=args.repeats, progress=progress)
    print(format_suite(results))
    if args.json:
        write_json(results, args.json)
    markdown = args.markdown or (os.path.splitext(args.json)[0] + ".md" if args.json else None)
    if markdown:
        with open(markdown, "w") as f:
            f.write(format_markdown(results) + "\n")
    return 0


def cmd_calibrate(args) -> int:
    import torch

    from jaggc.fidelity.calibrate import format_table, write_json
    from jaggc_studies.fidelity.flow_grpo import calibrate_digits

    torch.set_num_threads(args.threads)
    if args.example != "digits":
        print(f"jaggc calibrate: unknown example {args.example!r} (available: digits)", file=sys.stderr)
        return 2
    result = calibrate_digits(target_cosine=args.target, num_batches=args.batches, seed=args.seed)
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
    return 0


def _example_arguments(p: argparse.ArgumentParser, *, steps: int, batch: int) -> None:
    """The options ``example`` and ``inspect`` share (the built-in example losses' sizes)."""
    p.add_argument("--steps", type=int, default=steps, help="trained steps of each example's stored trajectory")
    p.add_argument("--batch", type=int, default=batch, help="samples per step")
    p.add_argument("--window", type=int, default=4, help="JAGG window W (steps per joint backward)")
    p.add_argument("--weights", default="t", choices=["t", "index"],
                   help="interpolation weights: t (the paper's plain JAGG) or index (by step position)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-init DiTs and trajectories")


def add_commands(sub) -> None:
    """Add the study commands to ``jaggc``'s subcommand parsers ``sub``."""
    from jaggc_studies.example_losses import EXAMPLES

    example_names = ", ".join(EXAMPLES)

    p = sub.add_parser("example", help="run the built-in example: exact vs JAGG on one GRPO loss")
    p.add_argument("--name", default="flow_grpo_sd3", choices=list(EXAMPLES), metavar="NAME",
                   help=f"which built-in example loss (tiny random-init DiT + stored trajectory): {example_names}")
    _example_arguments(p, steps=16, batch=4)
    p.add_argument("--json", default=None, help="write the numbers to this JSON file")
    p.set_defaults(func=cmd_example)

    p = sub.add_parser("inspect", help="compile the built-in example losses and show the rewritten graphs")
    p.add_argument("examples", nargs="*", metavar="NAME", help=f"built-in example losses (default: all): {example_names}")
    _example_arguments(p, steps=8, batch=2)
    p.add_argument("--out", default="jaggc-inspect", help="folder for the pictures and diffs")
    p.add_argument("--view", default="condensed", choices=["condensed", "full", "both"],
                   help="condensed: one column per DiT call, windows as boxes, NAME.png and NAME.svg (text "
                        "NAME.txt without matplotlib); full: every fx node, NAME.full.svg with Graphviz's "
                        "dot, else NAME.full.dot")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="GRPO on the pretrained digits DiT: exact vs dance vs mix vs jagg")
    p.add_argument("--iterations", type=int, default=40, help="GRPO iterations per strategy")
    p.add_argument("--seed", type=int, default=0, help="first rollout seed")
    p.add_argument("--seeds", type=int, default=1, help="runs with seeds seed, seed+1, ...: means and spread")
    p.add_argument("--reward", default="bold", choices=["bold", "classifier", "jpeg"],
                   help="bold: p(target digit) x sigmoid of the ink above the data's (default; the base "
                        "scores ~0.02); classifier: p(target digit) (the base scores ~0.90); jpeg: Flow-GRPO's "
                        "JPEG compressibility")
    p.add_argument("--window", type=int, default=4, help="JAGG window W")
    p.add_argument("--weights", default="t", choices=["t", "index"],
                   help="jagg's weights: t (plain JAGG; unbiased on the digits base, docs/default.md) or index")
    p.add_argument("--jagg-frac", type=float, default=1.0,
                   help="jagg: the fraction of windows routed to JAGG by score (the rest exact; 1: all)")
    p.add_argument("--no-rollout-cache", action="store_true",
                   help="jagg: run the first minibatch's interior forwards instead of taking them from the rollout")
    p.add_argument("--num-steps", type=int, default=10, help="SDE sampling steps T (T-1 are trained)")
    p.add_argument("--strategies", nargs="+", default=["exact", "dance", "mix", "jagg"], metavar="NAME",
                   help="strategies to train, space- or comma-separated, from exact, dance, mix, jagg (exact is "
                        "needed: the gradient cosine is measured against it)")
    p.add_argument("--base", default="pretrained",
                   help="'pretrained' (the shipped base DiT), 'random' (untrained; smoke runs only) or a "
                        "checkpoint path written by python -m jaggc_studies.digits.train_base --out PATH")
    p.add_argument("--classes-per-iter", type=int, default=2, help="digit classes (prompts) per rollout")
    p.add_argument("--group-size", type=int, default=16, help="samples per class (the GRPO group)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--eval-per-class", type=int, default=16, help="evaluation samples per digit")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: the DiT is tiny, so intra-op threads gain little, "
                        "and on a shared machine 2 threads were 7x slower than 1)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars (also off when not a TTY)")
    p.add_argument("--out", default="jaggc-demo", help="folder for the sample grids and reward curves (PNG)")
    p.add_argument("--no-pictures", action="store_true", help="write no PNG files")
    p.add_argument("--json", default=None, help="write the numbers to this JSON file")
    p.add_argument("--guard", type=int, nargs="?", const=8, default=0, metavar="EVERY",
                   help="jagg: train with jaggc.Guard(every=EVERY, default 8, on_drift='warn') and plot its running "
                        "cosine and bias/floor next to the reward curves")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="time a GRPO training step: exact vs JAGG (speedups, passes, memory)")
    p.add_argument("--quick", action="store_true",
                   help="10M SD3, 8 trained steps: exact vs jagg@4 and jagg_fast@4 (jagg@8 if the budget "
                        "allows), 3 repeats, under 3 min on 2 cores")
    p.add_argument("--suite", default=None, choices=["gpu"],
                   help="gpu: seconds per GRPO step and peak memory of the per-step loop, exact and JAGG's modes, "
                        "CFG on/off, SD3.5-Medium and a depth-cut FLUX.1-dev at 512 px, bf16, plus the on-policy "
                        "ratio check; with --size small the same suite on the tiny configs (CPU, < 3 min)")
    p.add_argument("--scaling", action="store_true",
                   help="the W=4 step speedup and backward/forward cost ratio against model width on this machine "
                        "(sd3 tiny, 10m, SD3.5-Medium cut to 1 layer at 32x32 latents)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the DiT's parameters and stored states (default float32; the gpu suite: bfloat16)")
    p.add_argument("--layers", type=int, default=None,
                   help="published sizes: cut the depth to N layers (Flux: N double + 2N single blocks)")
    p.add_argument("--resolution", type=int, default=None,
                   help="published sizes: image size in px (512: 64x64 latents, default; 1024: 128x128)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds before the timed ones (default: 1 on CUDA, 0 on CPU)")
    p.add_argument("--markdown", default=None, help="--suite: write the markdown table here (default: the JSON path with .md)")
    p.add_argument("--family", default=None, choices=["sd3", "flux"], help="DiT family (default: the size's, sd3 for tiny/10m)")
    p.add_argument("--cfg", action="store_true",
                   help="Flow-GRPO's train_sd3 CFG loss (one call on [uncond; cond], guidance 4.5, uncond detached)")
    p.add_argument("--size", default=None,
                   help="model size: tiny, 10m (jaggc.models), or a published architecture: sd35-medium, flux-dev "
                        "(random init, studies/bench/model_configs.py; default 10m); with --suite: full or small")
    p.add_argument("--steps", type=int, default=None, help="trained steps of the trajectory (default 16)")
    p.add_argument("--batch", type=int, default=None, help="batch (default 4)")
    p.add_argument("--modes", default=None,
                   help="comma-separated modes, e.g. exact,jagg@4,jagg_split_knots@4,runtime@4,exact_per_step")
    p.add_argument("--repeats", type=int, default=None, help="interleaved timed rounds (default 3)")
    p.add_argument("--clock", default=None, choices=["cpu", "wall", "passes"],
                   help="clock the speedups are computed in (default cpu: process CPU time)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1: stable on shared CPUs)")
    p.add_argument("--compile-steps", default=None, help="step counts of the first-call overhead probes, e.g. 10,50,100")
    p.add_argument("--rss", action="store_true", help="also measure each mode's peak RSS in a fresh process")
    p.add_argument("--budget", type=float, default=None, help="wall-clock seconds for optional modes (quick: 170)")
    p.add_argument("--profile", type=int, default=None, metavar="W",
                   help="also profile one JAGG step at window W with torch.profiler and print where time goes")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("calibrate", help="measure JAGG settings' gradient fidelity and backward cost; recommend one")
    p.add_argument("--example", default="digits", help="the batches to calibrate on (digits: the pretrained digits DiT)")
    p.add_argument("--target", type=float, default=0.95, help="mean cosine to the exact gradient to reach")
    p.add_argument("--batches", type=int, default=2, help="rollouts (each gives an on-policy and an off-policy batch)")
    p.add_argument("--seed", type=int, default=0, help="first rollout seed")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: stable on shared CPUs)")
    p.add_argument("--json", default=None, help="write the settings, subsample baselines and recommendation here")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("study", help="research studies; fewsteps: JAGG vs training fewer steps (Flow-GRPO-Fast, "
                                     "MixGRPO, DanceGRPO) at equal CPU budgets")
    studies = p.add_subparsers(dest="study", required=True, metavar="STUDY", help="the study to run: fewsteps")
    from jaggc_studies.fewsteps import cli as fewsteps_cli
    q = studies.add_parser("fewsteps", help="the few-step schedules and their JAGG compositions, side by side "
                                            "(docs/fewsteps.md)")
    fewsteps_cli.add_arguments(q)
    q.set_defaults(func=fewsteps_cli.main)

    p = sub.add_parser("trainers", help="the trainers' own loss shapes (Flow-GRPO, DanceGRPO, the JAGG author) "
                                        "through @jagg_compile: capture path, first call, gradients, speed")
    from jaggc_studies import trainer_check
    trainer_check.add_arguments(p)
    p.set_defaults(func=trainer_check.main)



def check_names(parser: argparse.ArgumentParser, args) -> None:
    """Usage errors (exit status 2, no traceback) for names argparse cannot check itself."""
    if args.command == "inspect":
        from jaggc_studies.example_losses import EXAMPLES

        unknown = [n for n in args.examples if n not in EXAMPLES]
        if unknown:
            parser.error(f"inspect: unknown example {', '.join(unknown)}; choose from {', '.join(EXAMPLES)}")
    if args.command == "bench":
        _check_bench(parser, args)
    if args.command == "demo":
        from jaggc_studies.digits.trainer import STRATEGIES

        args.strategies = [n for text in args.strategies for n in text.split(",") if n]
        unknown = [n for n in args.strategies if n not in STRATEGIES]
        if unknown:
            parser.error(f"demo --strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")


def _check_bench(parser: argparse.ArgumentParser, args) -> None:
    from jaggc_studies.bench.problems import ALL_SIZES, PUBLISHED_SIZES
    from jaggc_studies.bench.suite import SUITE_SIZES

    if args.suite:
        if args.size is not None and args.size not in SUITE_SIZES:
            parser.error(f"bench --suite {args.suite} --size {args.size}: choose from {', '.join(SUITE_SIZES)}")
        given = [f"--{n}" for n in ("modes", "family", "layers", "resolution", "profile") if getattr(args, n)]
        given += ["--cfg"] * args.cfg + ["--quick"] * args.quick + ["--scaling"] * args.scaling
        if given:
            parser.error(f"bench --suite fixes its own cases and modes; drop {', '.join(given)}")
        return
    if args.size is not None and args.size not in ALL_SIZES:
        parser.error(f"bench --size {args.size}: choose from {', '.join(ALL_SIZES)} (or --suite gpu --size full|small)")
    if (args.layers is not None or args.resolution is not None) and args.size not in PUBLISHED_SIZES:
        parser.error(f"bench --layers/--resolution apply to the published sizes ({', '.join(PUBLISHED_SIZES)})")
    on_cuda = args.device.startswith("cuda")
    if on_cuda and args.rss:
        parser.error("bench --rss measures host RSS (CPU runs); on CUDA every mode's peak allocation is reported")
    if on_cuda and args.clock == "cpu":
        parser.error("bench --clock cpu measures the host only; on CUDA use --clock cuda or wall")
