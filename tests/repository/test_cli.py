"""The command line's usage errors and help: what a newcomer meets first.

  * ``jaggc --help`` lists each command once;
  * an unknown example name is a usage error (exit 2, the names listed), not a traceback;
  * ``--help`` of ``example`` / ``inspect`` lists the example names;
  * ``demo --strategies`` takes the comma form the README writes as well as spaces.
"""

from __future__ import annotations

import pytest

from jaggc.cli import build_parser, main
from jaggc_studies.example_losses import EXAMPLES


def test_top_level_help_lists_each_command_once(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("example", "inspect", "demo", "bench", "calibrate", "trainers", "verify"):
        assert sum(line.split()[:1] == [command] for line in out.splitlines()) == 1, command


@pytest.mark.parametrize("argv", [["inspect", "nope"], ["example", "--name", "nope"]])
def test_unknown_example_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err and all(name in err for name in EXAMPLES) and "Traceback" not in err


@pytest.mark.parametrize("command", ["example", "inspect"])
def test_help_names_the_examples(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(name in out for name in EXAMPLES)


@pytest.mark.parametrize("given", [["exact,jagg"], ["exact", "jagg"], ["exact,", "jagg"]])
def test_demo_strategies_comma_or_space(given):
    parser = build_parser()
    args = parser.parse_args(["demo", "--strategies", *given])
    for check in args.checks:
        check(parser, args)
    assert args.strategies == ["exact", "jagg"]


def test_demo_unknown_strategy_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--strategies", "exact,dancegrpo", "--no-pictures"])
    assert exit_info.value.code == 2
    assert "unknown dancegrpo" in capsys.readouterr().err
