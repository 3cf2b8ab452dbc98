"""`jaggc COMMAND --help` explains every option (issue 30): no argparse action without help text,
in every subcommand, the verifier's own parser included."""

from __future__ import annotations

import argparse

import pytest

from jaggc.cli import build_parser
from jaggc.verify.cli import build_parser as verify_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


COMMANDS = {**_subparsers(build_parser()), "verify": verify_parser()}


def test_every_command_of_the_readme_is_there():
    assert {"demo", "bench", "trainers", "verify", "calibrate", "example", "inspect"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_text(name):
    parser = COMMANDS[name]
    missing = [a.option_strings or [a.dest] for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())]
    assert not missing, f"jaggc {name}: options without help text: {missing}"
