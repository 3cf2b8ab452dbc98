"""``jaggc bench`` (the former top-level modules ``jaggc/bench*.py``, moved into one package).

This module only re-exports the names the CLI, the tests and the README use.
"""

from __future__ import annotations

from .memory import measure_rss
from .problems import Problem, build_problem
from .profile import format_profile, profile_window_step
from .report import format_table, summarize, write_json
from .runner import *  # noqa: F401,F403 - the former jaggc.bench module's public names
from .runner import __all__ as _runner_names

__all__ = sorted({*_runner_names, "Problem", "build_problem", "format_profile", "format_table", "measure_rss",
                  "profile_window_step", "summarize", "write_json"})
