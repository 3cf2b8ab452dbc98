"""``python -m jaggc_studies.bench.flat_vectors``: its result's structure (its timings are the bench's, not a test's)."""

from __future__ import annotations


def test_the_flat_vector_bench_reports_per_round_ratios():
    from jaggc_studies.bench.flat_vectors import measure

    out = measure(params=10_000, tensors=10, rounds=3)
    assert out["params"] == 10_000 and out["rounds"] == 3
    r = out["fresh_over_held"]
    assert 0 < r["min"] <= r["median"] <= r["max"]
