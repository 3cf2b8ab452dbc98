"""The ``jaggc`` command line: ``jaggc COMMAND --help`` for each command's options."""

from __future__ import annotations

import argparse
import sys


def _command_providers():
    """The ``jaggc.commands`` entry points (pyproject): each adds its subcommands to the parser.
    The studies' commands come this way, so this module imports nothing of them."""
    from importlib.metadata import entry_points

    return sorted(entry_points(group="jaggc.commands"), key=lambda ep: ep.name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaggc", description="JAGG (Jacobian-Aggregated Group Gradient) for GRPO on flow-matching DiTs, "
                                  "as an autograd-graph compiler pass. `jaggc COMMAND --help` for each command.")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    checks = []
    for provider in _command_providers():
        module = provider.load()
        module.add_commands(sub)
        checks.append(module.check_names)
    sub.add_parser("verify", help="symbolic proof + property checks (jaggc verify --help)")
    parser.set_defaults(checks=checks)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:  # the verifier owns its flags
        from jaggc.verify.cli import main_verify

        return main_verify(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    for check in args.checks:
        check(parser, args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
