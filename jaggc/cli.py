"""The ``jaggc`` command line.

  jaggc example   the built-in example: one GRPO loss, exact vs JAGG, backward passes and agreement
  jaggc inspect   compile the built-in example losses and print/write what was rewritten
  jaggc verify    the symbolic proof and the property checks of JAGG's exactness
"""

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
    from jaggc.example_losses import build_example
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
    from jaggc.example_losses import EXAMPLES, build_example

    names = args.examples or list(EXAMPLES)
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        ex = build_example(name, num_steps=args.steps, batch=args.batch, seed=args.seed)
        report = jaggc.explain(ex.loss_fn, ex.model, ex.batch, window=args.window, weights=args.weights)
        print(f"== {name}: {ex.description}")
        print(report)
        path = report.render(os.path.join(args.out, f"{name}.svg"))
        with open(os.path.join(args.out, f"{name}.diff"), "w") as f:
            f.write(report.diff())
        print(f"   graph: {path}   diff: {os.path.join(args.out, name + '.diff')}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaggc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("example", help="run the built-in example: exact vs JAGG on one GRPO loss")
    p.add_argument("--name", default="flow_grpo_sd3")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--weights", default="t", choices=["t", "index"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the numbers to this JSON file")
    p.set_defaults(func=cmd_example)

    p = sub.add_parser("inspect", help="compile the built-in example losses and show the rewritten graphs")
    p.add_argument("examples", nargs="*", help="example names (default: all)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--weights", default="t", choices=["t", "index"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="jaggc-inspect", help="folder for the DOT/SVG graphs and diffs")
    p.set_defaults(func=cmd_inspect)

    sub.add_parser("verify", help="symbolic proof + property checks (jaggc verify --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:  # the verifier owns its flags
        from jaggc.verify.cli import main_verify

        return main_verify(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
