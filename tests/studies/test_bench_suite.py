"""``jaggc bench --suite gpu`` on the CPU (``--size small``): the same suite the GPU runs, on the
tiny configs in bf16. Checked: every row carries device, dtype and peak memory; the modes and
cases are the suite's; the DiT backward counts are the cost model's; the markdown table is written;
and the on-policy ratio check's claims: the per-step loop and every-forward-at-batch-B variants
give ratios of exactly 1, the rollout cache served every interior step.

The whole suite (3 cases, 2 ratio checks) takes about a minute on 2 cores: marked slow; the Flux
case alone runs in the default suite. No timing assertion.
"""

from __future__ import annotations

import json

import pytest

from jaggc import cli
from jaggc_studies.bench.suite import SUITE_MODES, format_markdown, run_suite

ROW_FIELDS = ("device", "device_name", "dtype", "peak_memory_bytes", "peak_memory_kind", "step_s", "mode", "case")


def _check_rows(results, cases):
    assert {row["case"] for row in results["rows"]} == set(cases)
    for case in cases:
        assert [r["mode"] for r in results["rows"] if r["case"] == case] == list(SUITE_MODES)
    for row in results["rows"]:
        assert all(row.get(k) is not None for k in ROW_FIELDS), row
        assert row["device"] == "cpu" and row["dtype"] == "bfloat16" and row["error"] is None
        assert row["peak_memory_bytes"] > 0
        # 8 steps at W=4: the per-step loop and exact run 8 DiT backwards, every JAGG mode one per window
        assert row["dit_backwards"] == (8 if row["mode"].startswith("exact") else 2)


def _check_ratio(check, interior_steps):
    variants = check["variants"]
    assert variants["per_step_loop"]["exactly_one"]
    assert variants["jagg_unbatched"]["exactly_one"] and variants["jagg_fast_unbatched"]["exactly_one"]
    assert variants["jagg_fast"]["cache_hits"] == variants["jagg_fast_unbatched"]["cache_hits"] == interior_steps
    for v in variants.values():    # whatever moved, moved by far less than a ratio a PPO clip would notice
        assert 0 <= v["max_abs_ratio_minus_1"] < 1e-2


def test_flux_case_of_the_small_suite():
    results = run_suite(device="cpu", dtype="bfloat16", size="small", families=("flux",), repeats=1)
    _check_rows(results, ["flux-tiny"])
    assert set(results["ratio_checks"]) == {"flux"}
    _check_ratio(results["ratio_checks"]["flux"], interior_steps=4)
    table = format_markdown(results)
    assert "| flux-tiny | jagg_fast@4 |" in table and "On-policy ratio check" in table


@pytest.mark.slow
def test_small_suite_through_the_cli(tmp_path):
    path = tmp_path / "s.json"
    rc = cli.main(["bench", "--suite", "gpu", "--device", "cpu", "--size", "small", "--json", str(path),
                   "--no-progress"])
    assert rc == 0
    results = json.loads(path.read_text())
    _check_rows(results, ["sd3-tiny", "sd3-tiny-cfg", "flux-tiny"])
    assert set(results["ratio_checks"]) == {"sd3", "flux"}
    for check in results["ratio_checks"].values():
        _check_ratio(check, interior_steps=4)
    assert results["torch_version"] and results["errors"] == {}
    assert "| sd3-tiny-cfg | exact_per_step |" in (tmp_path / "s.md").read_text()
