"""The default-choosing study (jaggc/fidelity/bias_study.py) end to end on a tiny budget.

Two rollouts of the digits base: every cell has each candidate's row and its matched subsampling
row, the rows of a second run merge into the first, and ``verdicts``/``choose`` apply the rule
(bias within 1.5x the floor in every cell, with a margin, and cosine above subsampling in every
cell; cheapest wins).
"""

from __future__ import annotations

import copy

import pytest

from jaggc_studies.fidelity import bias_study as B
from jaggc.fidelity import estimators as E

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


@pytest.fixture(scope="module")
def runs():
    first = B.run(["digits"], ["attention"], rollouts=2, draws=1, log=lambda m: None, candidates=["jagg"])
    second = B.run(["digits"], ["attention"], rollouts=2, draws=1, log=lambda m: None,
                   candidates=["control_step_w4"])
    return first, second


def test_every_cell_has_the_candidates_and_their_baselines(runs):
    first, second = runs
    assert list(first["cells"]) == [f"digits/attention/{c}" for c in B.CONDITIONS]
    for rows in first["cells"].values():
        assert set(rows) == {"jagg/W4/t", "subsample/W4/2of4"}
        jagg = rows["jagg/W4/t"]
        assert 0 < jagg["cos_mean"] <= 1 and jagg["bias"] > 0 and jagg["floor"] > 0
        assert jagg["backward_fraction"] == pytest.approx(rows["subsample/W4/2of4"]["backward_fraction"])
    assert list(B.measured(first)) == ["jagg"]
    merged = B.merge(second, first)
    assert list(B.measured(merged)) == ["jagg", "control_step_w4"]
    # the same rollouts: the exact gradient's statistics agree between the two runs
    for cell, rows in first["cells"].items():
        assert merged["cells"][cell]["jagg/W4/t"] == rows["jagg/W4/t"]


def test_choose_applies_the_rule(runs):
    first, second = runs
    results = copy.deepcopy(B.merge(second, first))
    v = B.verdicts(results)
    for name, verdict in v.items():
        assert verdict["meets_rule"] == (verdict["worst_bias_over_floor"] <= B.BIAS_LIMIT
                                         and not verdict["loses_to_subsampling"])
    # force the outcome: jagg meets the rule (cheaper), then it does not (bias), then neither does
    label = {n: B.CANDIDATES[n].label() for n in ("jagg", "control_step_w4")}
    sub = {n: E.matched_subsample_setting(B.CANDIDATES[n]).label() for n in label}
    for rows in results["cells"].values():
        for n in label:
            rows[label[n]].update(bias=1.0, floor=1.0, cos_mean=0.99)
            rows[sub[n]].update(cos_mean=0.5)
    assert B.choose(results) == "jagg"
    cell = next(iter(results["cells"].values()))
    cell[label["jagg"]]["bias"] = B.BIAS_LIMIT - B.MARGIN / 2      # meets the rule, not with the margin
    assert B.verdicts(results)["jagg"]["meets_rule"] and B.choose(results) == "control_step_w4"
    cell[label["jagg"]]["bias"] = 1.6
    assert B.choose(results) == "control_step_w4"
    next(iter(results["cells"].values()))[label["control_step_w4"]]["cos_mean"] = 0.4
    assert B.choose(results) is None
    assert f"Chosen (cheapest meeting the rule with {B.MARGIN} to spare): **none**" in B.to_markdown(results)
