"""The differential fuzzer of GRPO loss programs (tests/loss_fuzz.py, issue 28): quick in CI, long
by command.

Quick profile (always): every capture path x backward mode (fx, dynamo, intercept, auto x joint,
per_window, lowmem; intercept has no lowmem: it needs a captured graph) on 22 programs each (a
fixed seed per combination), 242 cases, about 75 s on two shared cores
(``test_fuzz_quick_ran_every_case`` prints the outcome counts with ``-s``). Each case checks value, gradient
(exact at window 2, the exactness theorem on affine fields with chord states, a hand-computed
JAGG otherwise), the writes into the inputs, a second call after a parameter step, and that
mutations are refused naming a step.

Long profile (a campaign, by command): random programs (up to 12 steps, the real SD3 more often)
for ``JAGGC_FUZZ_MINUTES`` minutes, cycling through the combinations; it prints the outcome counts,
and ``JAGGC_FUZZ_REPORT=file.json`` writes them:

    JAGGC_FUZZ_MINUTES=20 JAGGC_FUZZ_REPORT=/tmp/fuzz.json .venv/bin/python -m pytest -q -s tests/test_fuzz.py -k campaign

Every bug a campaign found is a regression test in tests/test_fuzz_regressions.py.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings

import loss_fuzz as fuzz

pytestmark = pytest.mark.usefixtures("one_thread")

COMBOS = [(c, b) for c in fuzz.CAPTURES for b in fuzz.BACKWARDS if not (c == "intercept" and b == "lowmem")]
QUICK_EXAMPLES = 22
# a fixed seed per combination: reproducible, and each combination explores other programs
_QUICK = settings(max_examples=QUICK_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
_RESET_EVERY = 40     # a fresh Dynamo cache now and then: every case compiles new code


_QUICK_STATS: Counter = Counter()


def _run(program, capture, backward, stats=None):
    if sum(fuzz.STATS.values()) % _RESET_EVERY == _RESET_EVERY - 1:
        torch.compiler.reset()
    outcome = fuzz.run_case(program, capture, backward)
    if stats is not None:
        stats[(capture, backward, outcome)] += 1


def _quick(capture, backward):
    @seed(28_000 + COMBOS.index((capture, backward)))
    @_QUICK
    @given(program=fuzz.programs(long=False, lowmem=backward == "lowmem"))
    def run(program):
        _run(program, capture, backward, _QUICK_STATS)
    return run


_QUICK_DONE: set = set()     # the combinations whose quick profile ran in this session


def _quick_profile(capture, backward):
    if (capture, backward) not in _QUICK_DONE:
        _quick(capture, backward)()
        _QUICK_DONE.add((capture, backward))


@pytest.mark.parametrize("capture,backward", COMBOS, ids=[f"{c}-{b}" for c, b in COMBOS])
def test_fuzz_quick(capture, backward):
    _quick_profile(capture, backward)


@pytest.fixture(scope="module")
def quick_stats(one_thread) -> Counter:
    """The quick profile's outcomes, every combination: those test_fuzz_quick ran already, the rest
    run here (so the summary holds in any test order and under -k)."""
    for combo in COMBOS:
        _quick_profile(*combo)
    return _QUICK_STATS


def test_fuzz_quick_ran_every_case(quick_stats):
    """The quick profile: at least 200 cases, on every combination, with right answers on every
    path and refusals of the mutations among them."""
    assert {(c, b) for c, b, _ in quick_stats} == set(COMBOS)
    summary = _summary(quick_stats, 0)
    print(json.dumps({k: summary[k] for k in ("cases", "outcomes", "per_combination")}, indent=1))
    assert summary["cases"] >= 200
    assert all(n >= QUICK_EXAMPLES for n in summary["per_combination"].values())
    right = {c for (c, _, o) in quick_stats if o.startswith("right")}
    assert right == set(fuzz.CAPTURES), right
    assert summary["outcomes"].get("refused", 0) > 0


def test_fuzz_quick_covers_the_grammar():
    """The quick profile's programs reach every value of every grammar field (not vacuous)."""
    seen: dict[str, set] = {}

    @settings(max_examples=QUICK_EXAMPLES * len(COMBOS), derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(program=fuzz.programs(long=False))
    def collect(program):
        for key, value in fuzz.describe(program).items():
            seen.setdefault(key, set()).add(value)

    collect()
    assert seen["dit"] == set(fuzz.DITS)
    assert seen["container"] == set(fuzz.CONTAINERS)
    assert seen["in_place"] == set(fuzz.IN_PLACE)
    assert seen["mutation"] == set(fuzz.MUTATIONS)
    for key in ("time", "schedule", "term", "cfg", "kl", "data_if", "extra", "accumulate", "chord", "weights"):
        assert len(seen[key]) > 1, key


@pytest.mark.skipif(not os.environ.get("JAGGC_FUZZ_MINUTES"), reason="the long campaign: set JAGGC_FUZZ_MINUTES")
def test_fuzz_campaign():
    deadline = time.monotonic() + 60 * float(os.environ["JAGGC_FUZZ_MINUTES"])
    before = Counter(fuzz.STATS)
    start = time.monotonic()
    rounds = 0
    while time.monotonic() < deadline:
        for capture, backward in COMBOS:
            if time.monotonic() >= deadline:
                break

            @settings(max_examples=4, derandomize=False, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(program=fuzz.programs(long=True, lowmem=backward == "lowmem"))
            def explore(program):
                _run(program, capture, backward)

            explore()
        rounds += 1
    stats = fuzz.STATS - before
    summary = _summary(stats, time.monotonic() - start)
    print(json.dumps(summary, indent=1))
    if os.environ.get("JAGGC_FUZZ_REPORT"):
        with open(os.environ["JAGGC_FUZZ_REPORT"], "w") as f:
            json.dump(summary, f, indent=1)
    assert summary["cases"] > 0


def _summary(stats: Counter, seconds: float) -> dict:
    per_outcome, per_path = Counter(), Counter()
    for (capture, backward, outcome), n in stats.items():
        per_outcome[outcome.split(" (")[0]] += n
        per_path[f"{capture}/{backward}"] += n
    return {"cases": sum(stats.values()), "seconds": round(seconds), "failures": 0,
            "outcomes": dict(sorted(per_outcome.items())), "per_combination": dict(sorted(per_path.items())),
            "detail": {f"{c}/{b}: {o}": n for (c, b, o), n in sorted(stats.items())}}
