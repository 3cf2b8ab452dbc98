"""The differential fuzzer of per-step loops under ``jaggc.stepwise`` (tests/step_fuzz.py, issue 42).

Quick profile (always): ``QUICK_RUNS`` hypothesis runs with fixed seeds, ``QUICK_EXAMPLES`` programs
each; every case runs the program unchanged, with ``jaggc.stepwise`` and through the hand-written JAGG
reference, and any FAILED case (silently wrong, a torch error where jaggc promises a result or a
refusal, a refusal the docs do not make) fails ``test_step_fuzz_quick`` after all cases ran, listing
them; ``-s`` prints the outcome counts. Long profile (a campaign):

    JAGGC_STEP_FUZZ_MINUTES=5 JAGGC_STEP_FUZZ_REPORT=/tmp/step_fuzz.json JAGGC_STEP_FUZZ_SEED=1 \\
        .venv/bin/python -m pytest -q -s tests/steps/test_stepwise_fuzz.py -k campaign
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, seed, settings

import step_fuzz as fuzz
from step_fuzz_grammar import (BACKWARDS, DECLARES, DISRUPTIONS, DITS, ORDERS, PLACEMENTS, TERMS, WEIGHTS,
                               describe, programs)

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK_RUNS = 4
QUICK_EXAMPLES = 60
_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _explore(strategy, examples: int, run_seed: int, derandomize: bool, stats: Counter, failures: list,
             programs_seen: list, deadline: float | None = None) -> None:
    @seed(run_seed)
    @settings(max_examples=examples, derandomize=derandomize, **_SETTINGS)
    @given(program=strategy)
    def explore(program):
        if deadline is not None and time.monotonic() > deadline:
            return
        programs_seen.append(program)
        try:
            stats[fuzz.run_case(program)] += 1
        except fuzz.FuzzFailure as failure:        # counted and kept: no shrinking, the run goes on
            stats[f"FAILED {failure.kind}"] += 1
            failures.append(str(failure))

    explore()


@pytest.fixture(scope="module")
def quick(one_thread):
    stats, failures, seen = Counter(), [], []
    start = time.monotonic()
    for k in range(QUICK_RUNS):
        _explore(programs(salt=k), QUICK_EXAMPLES, 42_000 + k, True, stats, failures, seen)
    return dict(stats=stats, failures=failures, programs=seen, seconds=time.monotonic() - start)


def _summary(stats: Counter, failures: list, seconds: float) -> dict:
    kinds = Counter()
    for text in failures:
        kinds[text.split(":")[0]] += 1
    return {"cases": sum(stats.values()), "seconds": round(seconds), "outcomes": dict(sorted(stats.items())),
            "failures": len(failures), "failure_kinds": dict(kinds)}


def test_step_fuzz_quick(quick):
    summary = _summary(quick["stats"], quick["failures"], quick["seconds"])
    print(json.dumps(summary, indent=1))
    assert summary["cases"] >= 200
    assert quick["stats"]["right"] > 0 and quick["stats"]["refused"] > 0
    assert not quick["failures"], f"{len(quick['failures'])} FAILED cases:\n\n" + "\n\n".join(quick["failures"][:12])


def test_step_fuzz_quick_covers_the_grammar(quick):
    """The quick profile's programs reach every value of every grammar field."""
    seen: dict[str, set] = {}
    for program in quick["programs"]:
        for key, value in describe(program).items():
            seen.setdefault(key, set()).add(value)
    expected = dict(dit=set(DITS), order=set(ORDERS), weights=set(WEIGHTS), backward=set(BACKWARDS), term=set(TERMS),
                    declare=set(DECLARES), window=set(range(1, 7)), steps=set(range(4, 11)),
                    trajectories={1, 2, 3}, accumulate={1, 2, 3}, n_disruptions={0, 1, 2},
                    disruption=set(DISRUPTIONS) | {"none"}, placement=set(PLACEMENTS) | {"none"})
    for key in ("cfg", "kl", "cfg_slice", "rollout_cache", "clip_at_sync", "scaler"):
        expected[key] = {False, True}
    for key, values in expected.items():
        assert values <= seen[key], (key, values - seen[key])
    assert set(DISRUPTIONS) <= seen["disruption2"] | seen["disruption"]


@pytest.mark.skipif(not os.environ.get("JAGGC_STEP_FUZZ_MINUTES"), reason="the campaign: set JAGGC_STEP_FUZZ_MINUTES")
def test_step_fuzz_campaign():
    minutes = float(os.environ["JAGGC_STEP_FUZZ_MINUTES"])
    base_seed = int(os.environ.get("JAGGC_STEP_FUZZ_SEED", "0"))
    deadline = time.monotonic() + 60 * minutes
    stats, failures, seen = Counter(), [], []
    start, rounds = time.monotonic(), 0
    while time.monotonic() < deadline:
        _explore(programs(salt=1000 + base_seed * 7919 + rounds, long=True), 25, base_seed * 7919 + rounds, False,
                 stats, failures, seen, deadline)
        rounds += 1
    summary = _summary(stats, failures, time.monotonic() - start)
    summary["seed"] = base_seed
    print(json.dumps(summary, indent=1))
    if os.environ.get("JAGGC_STEP_FUZZ_REPORT"):
        with open(os.environ["JAGGC_STEP_FUZZ_REPORT"], "w") as f:
            json.dump(dict(summary, failure_texts=failures), f, indent=1)
    assert summary["cases"] > 0
    assert not failures, "\n\n".join(failures[:5])
