"""Shared pytest configuration for the jaggc test suite.

Hypothesis profiles
-------------------
* ``ci`` (default): 15 derandomized examples per property, no deadline. Fast and reproducible:
  every run explores the same examples, so a failure in CI reproduces locally.
* ``thorough``: 300 random examples per property, no deadline. Select it with the environment
  variable ``JAGGC_HYPOTHESIS_PROFILE=thorough``, e.g.

      JAGGC_HYPOTHESIS_PROFILE=thorough pytest -q tests/runtime/test_runtime_exact.py

Every compile in the suite runs each graph pass's ``ensures`` (``JAGGC_CHECK_PASSES=1``).

Reusable numeric helpers (flattened gradients, relative error, cosine) live in ``tests/helpers.py``;
the tests themselves in one folder per part of the source tree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# tests/ holds one folder per part of the source tree (compiler, runtime, passes, steps, fidelity,
# verify, studies, repository); the shared test modules sit in tests/ itself (helpers, ranks, the
# fuzzer), and a few test modules share inputs with a neighbour in another folder (test_sharded's
# gathered gradients, test_backward_modes' scan of the mode table): every folder is importable
# whichever file pytest is given
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith(("_", ".")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

settings.register_profile(
    "ci", max_examples=15, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("JAGGC_HYPOTHESIS_PROFILE", "ci"))

# every graph pass's executable invariant (its ``ensures``) runs after it in every test that
# compiles a loss (passes/pipeline.py); set JAGGC_CHECK_PASSES=0 to time compiles without them
os.environ.setdefault("JAGGC_CHECK_PASSES", "1")

# README's test command runs the suite on pytest-xdist workers, one per core: each worker takes one
# intra-op thread, else two workers' threads spin-wait on each other's cores (the tiny DiTs'
# ops are far too small to gain from a second thread anyway; see ``one_thread``)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (restored after it): the tiny DiTs are fastest on one, and
    on a shared machine several threads spin-waiting on each op are 10-30x slower; the digits and
    shapes tests also rely on it for reproducible float reductions. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo cache before and after the test (compile tests: no graphs or recompile counts
    leak between tests). Use with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
