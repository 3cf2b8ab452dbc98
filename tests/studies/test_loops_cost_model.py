"""The loops' cost model (studies/loops/speed.py) on made-up unit costs: what each variant runs,
and the same with the loop's own work beside the DiT passes (``with_shared_costs``)."""

from __future__ import annotations

import pytest

from jaggc_studies.loops.speed import cost_model, guard_overhead, with_shared_costs
from jaggc_studies.trainers.sizes import Where

UNITS = dict(F=1.0, B=2.0)


def test_mix_grpo_window_of_four_in_order():
    costs = cost_model("mix_grpo", Where("10m"), forms=("joint",), units=UNITS)
    s = costs["seconds"]
    assert s["unchanged"] == 4 * (1 + 2)                     # W (F + B)
    assert s["joint"] == 4 * 1 + 2 * 2                       # W F + 2 B: the knots held
    assert s["joint/probe"] == s["joint"] + 4 * 2            # + one backward of the window's W steps
    assert s["joint/cache"] == 2 * 1 + 2 * 2                 # on-policy: the cache serves the interior
    assert costs["ratio"]["joint"] == pytest.approx(1.5)
    assert guard_overhead(costs["ratio"]["joint/probe"]) == pytest.approx(1 / 8)


def test_dance_grpo_out_of_order_windows_and_its_exact_step():
    costs = cost_model("dance_grpo", Where("10m"), forms=("joint", "per_window"), units=UNITS)
    s = costs["seconds"]
    assert s["unchanged"] == 9 * 3                           # windows 4, 4 and one exact step
    assert s["joint"] == 2 * (4 + 4) + 3                     # held knots: W F + 2 B per window
    assert s["per_window"] == 2 * (6 + 4) + 3                # knots re-run: (W + 2) F + 2 B


def test_shared_costs_are_what_the_unchanged_loop_measured_beyond_its_passes():
    costs = with_shared_costs(cost_model("mix_grpo", Where("10m"), forms=("joint",), units=UNITS), unchanged_s=16.0)
    assert costs["shared_s"] == pytest.approx(4.0)
    assert costs["ratio_with_shared"]["joint"] == pytest.approx((12 + 4) / (8 + 4))
    assert costs["ratio_with_shared"]["joint/probe"] == pytest.approx((8 + 4) / (16 + 4))
    # a measurement below the model (noise) adds nothing rather than a negative cost
    assert with_shared_costs(costs, unchanged_s=10.0)["shared_s"] == 0.0

