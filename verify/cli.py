"""``jaggc verify``: the symbolic proofs and every property check, as one report.

    jaggc verify [--examples N] [--profile ci|thorough] [--seed S] [--json PATH] [--no-symbolic]
                 [--suite all|runtime|losses]
    jaggc verify --loss MODULE:FACTORY [--windows 2,3,4] [--examples N] [--json PATH]
    python -m jaggc.verify.cli ...

Two suites of properties: ``runtime`` (``jaggc.verify.properties``: velocity fields with known
Jacobian structure through the window runtime, and one fx-compiled linear loss) and ``losses``
(``jaggc.verify.loss_properties``: Flow-GRPO / DanceGRPO / CPS losses through ``@jagg_compile``
with both frontends and through the runtime). ``--suite all`` (the default) runs both.

Exit status 1 if a symbolic identity fails, an exact property is violated, or a counterexample
property finds no counterexample; 0 otherwise. ``--json`` writes a list of entries
``{"name", "kind", "passed", "examples", "max_rel_err", "counterexample", "detail"}``: one per
property, plus one entry of kind "symbolic" for the sympy proofs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Sequence

PROFILES = {"ci": 15, "thorough": 300}
SUITES = ("all", "runtime", "losses")


def build_parser(prog: str = "jaggc verify") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Prove the JAGG identities symbolically and check "
                                "the runtime's exactness properties and known counterexamples with hypothesis.")
    p.add_argument("--examples", type=int, default=None,
                   help="hypothesis examples per property (default: the profile's: ci=15, thorough=300)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="ci",
                   help="hypothesis profile when --examples is not given: ci (15 examples) or thorough (300)")
    p.add_argument("--seed", type=int, default=0, help="mixed into every example's random data")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    p.add_argument("--no-symbolic", action="store_true", help="skip the sympy proofs")
    p.add_argument("--suite", choices=SUITES, default="all",
                   help="which properties: runtime (velocity fields through the window runtime), losses "
                        "(GRPO losses through @jagg_compile), or all (default)")
    p.add_argument("--loss", metavar="MODULE:FACTORY", default=None,
                   help="check your own loss instead (jaggc.verify.check_loss): FACTORY() returns (loss_fn, "
                        "dit, batch) or (loss_fn, dit, batch, compile_options); batch may be the tuple of all "
                        "the loss's arguments")
    p.add_argument("--windows", default="2,3,4", help="with --loss: the window sizes to check")
    return p


def verify_loss(spec: str, examples: int, seed: int, windows: tuple, json_path: str | None) -> int:
    """``jaggc verify --loss module:factory``: check_loss on the loss the factory builds."""
    import importlib

    from .loss_check import check_loss

    from ..errors import JaggError

    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        print(f"jaggc verify: --loss wants MODULE:FACTORY, got {spec!r}", file=sys.stderr)
        return 2
    if os.getcwd() not in sys.path and "" not in sys.path:
        # as `python -m` does: a module in the current directory is found without PYTHONPATH=.
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as e:
        print(f"jaggc verify: cannot load {spec!r}: {e}", file=sys.stderr)
        return 2
    built = factory()
    loss_fn, dit, batch, options = (*built, {}) if len(built) == 3 else built
    try:
        check = check_loss(loss_fn, dit, batch, windows=windows, examples=examples, seed=seed, **options)
    except JaggError as e:
        print(f"jaggc verify: {spec}: {e}", file=sys.stderr)
        return 2
    print(check.table())
    if json_path:
        with open(json_path, "w") as f:
            json.dump([dict(name=f"check_loss {spec}", kind="loss", passed=check.passed, examples=check.examples,
                            max_rel_err=check.max_rel_err, counterexample=check.counterexample,
                            detail=f"capture path {check.capture_path}; real DiT {check.real_dit}")], f, indent=2)
    return 0 if check.passed else 1


def registry(suite: str = "all") -> dict[str, Callable]:
    """name -> property function of the selected suite(s), in report order (read at call time, so
    a test can substitute a module's PROPERTIES)."""
    from . import cfg_properties, loss_properties, properties, serving_properties

    chosen = {}
    if suite in ("all", "runtime"):
        chosen.update(properties.PROPERTIES)
        chosen.update(serving_properties.PROPERTIES)
    if suite in ("all", "losses"):
        chosen.update(loss_properties.PROPERTIES)
        chosen.update(cfg_properties.PROPERTIES)
    return chosen


def _fmt_err(x: float) -> str:
    return f"{x:.2e}"


def main_verify(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    examples = args.examples if args.examples is not None else PROFILES[args.profile]
    if examples < 1:
        print("jaggc verify: --examples must be >= 1", file=sys.stderr)
        return 2
    if args.loss:
        windows = tuple(int(w) for w in args.windows.split(",") if w)
        return verify_loss(args.loss, examples, args.seed, windows, args.json)
    from . import properties, symbolic

    entries: list[dict] = []
    ok = True
    if not args.no_symbolic:
        t0 = time.perf_counter()
        lines = symbolic.prove_all()
        print(symbolic.transcript(lines))
        print(f"({time.perf_counter() - t0:.1f} s)\n")
        sym_ok = all(line.ok for line in lines)
        ok &= sym_ok
        failed = [line.claim for line in lines if not line.ok]
        entries.append(dict(name="symbolic", kind="symbolic", passed=sym_ok, examples=len(lines),
                            max_rel_err=0.0, counterexample="; ".join(failed) or None, detail=""))

    print(f"properties: {examples} examples each, seed {args.seed}, counterexample threshold rel_err > "
          f"{properties.TOL:g}")
    header = f"  {'property':<26} {'kind':<15} {'result':<7} {'examples':>8} {'max rel err':>12}  {'time':>6}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    results = []
    for name, fn in registry(args.suite).items():
        t0 = time.perf_counter()
        r = fn(examples, args.seed)
        dt = time.perf_counter() - t0
        results.append(r)
        ok &= r.passed
        status = "ok" if r.passed else "FAIL"
        print(f"  {r.name:<26} {r.kind:<15} {status:<7} {r.examples:>8} {_fmt_err(r.max_rel_err):>12}  {dt:5.1f}s")
        if r.counterexample is not None:
            label = "shrunk counterexample" if r.kind == "counterexample" else "VIOLATION (shrunk)"
            print(f"      {label}: {r.counterexample}")
        if r.detail:
            print(f"      {r.detail}")
        entries.append(r.to_json())

    exact = [r for r in results if r.kind == "exact"]
    worst = max(exact, key=lambda r: r.max_rel_err, default=None)
    found = [r for r in results if r.kind == "counterexample" and r.passed]
    print()
    if worst is not None:
        print(f"worst error over exact properties: {_fmt_err(worst.max_rel_err)} ({worst.name})")
    print(f"counterexamples found and shrunk: {len(found)}/{sum(r.kind == 'counterexample' for r in results)}")
    print("verify: " + ("all checks passed" if ok else "FAILED"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(entries, f, indent=2)
    return 0 if ok else 1


def main() -> None:  # pragma: no cover
    sys.exit(main_verify(sys.argv[1:]))


if __name__ == "__main__":  # pragma: no cover
    main()
