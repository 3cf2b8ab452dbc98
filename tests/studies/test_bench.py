"""``jaggc bench``: structure of the results, DiT pass counts, the cost model, speedups computed
from the measured times (a deterministic clock is injected: the cost-model ``passes`` clock, and
hand-made round times), no recompiles over repeated calls, and the RSS child.

No timing assertion: every number checked here is a count, a formula, or a ratio of injected
times. The bench runs once, through the CLI, on the tiny SD3 model (16 steps, 1 repeat) plus a
3-step compile probe; its JSON file is shared by the tests.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from helpers import grads, rel_err
from jaggc import cli
from jaggc_studies.bench import BenchConfig, Cost, ModeResult, PassClock, build_problem, exact_cost, fast_cost, format_table, jagg_cost, parse_mode, per_window_cost, run_bench, summarize, theory_backward_speedup, theory_fast_backward_speedup, theory_fast_step_speedup, theory_per_window_backward_speedup, theory_per_window_step_speedup, theory_step_speedup
from jaggc.runtime import count_dit_passes

NUM_STEPS, BATCH = 16, 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One CLI run (exact vs jagg@4, 1 round, the cost-model clock first) read back from its JSON."""
    torch._dynamo.reset()
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    rc = cli.main(["bench", "--size", "tiny", "--steps", str(NUM_STEPS), "--batch", str(BATCH),
                   "--modes", "exact,jagg@4", "--repeats", "1", "--clock", "passes", "--compile-steps", "3",
                   "--no-progress", "--json", str(path)])
    assert rc == 0
    yield json.loads(path.read_text())
    torch._dynamo.reset()


def test_json_structure(results):
    for key in ("step_speedup", "backward_speedup", "theory_step_speedup", "theory_backward_speedup",
                "backward_passes", "peak_mem_ratio", "compile_overhead_s", "recompiles", "model", "torch_version",
                "device", "modes", "speedups", "step_speedup_range", "counted_step_speedup"):
        assert key in results, key
    assert results["model"] == "sd3-tiny" and results["device"] == "cpu"
    assert results["torch_version"] == torch.__version__
    assert set(results["modes"]) == {"exact", "jagg@4"}
    assert set(results["step_speedup"]) == {"4"}
    for mode in results["modes"].values():
        assert len(mode["whole"]["passes"]) == 1 and len(mode["backward"]["cpu"]) == 1
        assert len(mode["whole"]["wall"]) == 1
    assert "jagg@4" in format_table(results)


def test_pass_counts(results):
    assert results["backward_passes"] == {"exact": NUM_STEPS, "jagg": {"4": NUM_STEPS // 4}}
    # one joint backward per window is of twice the batch
    assert results["backward_samples"] == {"exact": NUM_STEPS * BATCH, "jagg": {"4": NUM_STEPS // 4 * 2 * BATCH}}
    jagg = results["modes"]["jagg@4"]["passes"]
    assert jagg["grad_forwards"] == NUM_STEPS // 4 and jagg["nograd_forwards"] == NUM_STEPS // 4
    assert 0 < results["peak_mem_ratio"]["4"] < 1   # one joint backward keeps 2 of 4 steps per window


@pytest.mark.parametrize("window", [2, 3, 4, 6, 8])
def test_theory_follows_the_cost_model(window):
    assert theory_step_speedup(window) == pytest.approx(3 * window / (window + 4))
    assert theory_backward_speedup(window) == pytest.approx(window / 2)
    if NUM_STEPS % window == 0:   # no tail window: the trajectory's ratio is the formula's
        exact, jagg = exact_cost(NUM_STEPS), jagg_cost(NUM_STEPS, window)
        assert exact.step / jagg.step == pytest.approx(theory_step_speedup(window))
        assert exact.backward / jagg.backward == pytest.approx(theory_backward_speedup(window))


def test_tail_window_cost():
    # 16 steps at W=6: windows of 6, 6 and 4 steps
    assert jagg_cost(16, 6).forward == 16 and jagg_cost(16, 6).backward == 12
    # a 1-step tail runs exactly
    assert jagg_cost(9, 4).backward == 4 + 4 + 2


def test_theory_in_results(results):
    assert results["theory_step_speedup"]["4"] == pytest.approx(1.5)
    assert results["theory_backward_speedup"]["4"] == pytest.approx(2.0)


def test_speedups_come_from_the_injected_clock(results):
    # with the cost-model clock, every measured time is the DiT work the step really ran
    exact, jagg = results["modes"]["exact"], results["modes"]["jagg@4"]
    assert exact["whole"]["passes"] == [3 * NUM_STEPS]
    assert jagg["whole"]["passes"] == [NUM_STEPS + 4 * NUM_STEPS // 4]
    ratio = exact["whole"]["passes"][0] / jagg["whole"]["passes"][0]
    assert results["step_speedup"]["4"] == pytest.approx(ratio)
    assert results["backward_speedup"]["4"] == pytest.approx(exact["backward"]["passes"][0] / jagg["backward"]["passes"][0])
    assert results["step_speedup"]["4"] == pytest.approx(results["counted_step_speedup"]["4"])


class ForwardCallClock:
    """An injected fake clock: the number of DiT forward calls made so far."""

    def __init__(self, problem):
        self.calls = 0
        self.handle = problem.model.register_forward_hook(self._tick)

    def _tick(self, module, args, output):
        self.calls += 1

    def __call__(self) -> float:
        return float(self.calls)

    def close(self):
        self.handle.remove()


def test_run_bench_uses_an_injected_clock():
    # the runtime strategy (no trace) keeps this cheap: 16 exact calls vs 4 windows x (1 interior
    # + 1 knot) batched calls per step
    config = BenchConfig(size="tiny", num_steps=NUM_STEPS, batch=BATCH, modes=("exact", "runtime@4"), repeats=2,
                         clocks=("fake",), compile_steps=(), recompile_iterations=0, activation_memory=False)
    out = run_bench(config, clock_factories={"fake": ForwardCallClock})
    assert out["modes"]["exact"]["whole"]["fake"] == [16.0, 16.0]
    assert out["modes"]["runtime@4"]["whole"]["fake"] == [8.0, 8.0]
    assert out["speedups"]["runtime@4"]["step"] == dict(median=2.0, min=2.0, max=2.0)


def test_speedups_are_per_round_ratios():
    """Hand-made round times: the summary is the median/min/max of exact_r / mode_r."""
    def mode(name, window, whole, backward):
        res = ModeResult(name, name.split("@")[0], window, "", dict(forward=1, backward=1, step=2))
        res.whole, res.backward = {"fake": whole}, {"fake": backward}
        res.passes = dict(backwards=1, backward_samples=1, forward_samples=1, grad_forwards=1, nograd_forwards=0)
        res.first_call = {"fake": 0.0}
        return res

    runner = types.SimpleNamespace(
        problem=types.SimpleNamespace(name="x", num_params=1, family="sd3", size="tiny", cfg=False, num_steps=16, batch_size=4),
        results={"exact": mode("exact", None, [10.0, 12.0, 30.0], [6.0, 6.0, 6.0]),
                 "jagg@4": mode("jagg@4", 4, [5.0, 8.0, 10.0], [2.0, 3.0, 6.0])},
        elapsed=lambda: 0.0)
    config = BenchConfig(clocks=("fake",))
    out = summarize(config, runner, {}, [])
    assert out["step_speedup"]["4"] == pytest.approx(2.0)           # ratios 2, 1.5, 3
    assert out["step_speedup_range"]["4"] == pytest.approx([1.5, 3.0])
    assert out["backward_speedup"]["4"] == pytest.approx(2.0)       # ratios 3, 2, 1
    assert out["backward_speedup_range"]["4"] == pytest.approx([1.0, 3.0])


def test_no_recompiles_over_repeated_calls(results):
    # first call + counted call + a timed round of the same compiled loss: one trace
    assert results["modes"]["jagg@4"]["traces"] == 1
    assert results["recompiles"] == 0


def test_compile_probe_counts_recompiles_over_training_iterations(results):
    assert (set(results["compile_overhead_s"]) == set(results["compile_overhead_fx_s"])
            == set(results["compile_overhead_default_s"]) == {"3"})
    assert results["compile_default_path"] == ["fx"]      # capture="auto" takes FX first
    for capture in ("auto", "dynamo", "fx"):
        detail = results["compile_details"]["3"][capture]
        assert detail["passes"]["cpu"] > 0 and detail["first_call"]["cpu"] > 0
    # the loss traced with a stand-in DiT is part of, and cheaper than, the whole first call
    glue = results["compile_details"]["3"]["glue_trace"]["cpu"]
    assert 0 < glue < results["compile_details"]["3"]["dynamo"]["first_call"]["cpu"]
    assert results["recompile_detail"] == dict(iterations=20, traces=0, dynamo_unique_graphs=0)


def test_modes_parse_and_refuse():
    assert parse_mode("jagg_split_knots@4").window == 4 and parse_mode("exact").window is None
    with pytest.raises(ValueError):
        parse_mode("jagg")
    with pytest.raises(ValueError):
        parse_mode("exact@4")
    with pytest.raises(ValueError):
        parse_mode("nope@4")


def test_rss_child_reports_a_step_peak():
    from jaggc_studies.bench import measure_rss

    rss = measure_rss(BenchConfig(size="tiny", num_steps=4, batch=2), "exact")
    assert rss.get("error") is None, rss
    assert rss["peak_mb"] >= rss["before_mb"] > rss["setup_mb"] * 0 + 1    # a process with torch is > 1 MB
    assert rss["step_peak_mb"] == pytest.approx(rss["peak_mb"] - rss["before_mb"])   # the step's own peak


# ---------------------------------------------------------------------------------------------
# the JAGG variants: per-window backward and the on-policy fast path


@pytest.mark.parametrize("window", [2, 3, 4, 6, 8])
def test_variant_costs_follow_their_cost_models(window):
    exact = exact_cost(NUM_STEPS)
    if NUM_STEPS % window == 0 and window > 2:
        fast, per_window = fast_cost(NUM_STEPS, window), per_window_cost(NUM_STEPS, window)
        # fast: 2F knot forward + 4F backward per window; per-window: W no-grad + (2F + 4F) in backward
        assert fast == Cost(2 * NUM_STEPS // window, 4 * NUM_STEPS // window)
        assert per_window == Cost(NUM_STEPS, 6 * NUM_STEPS // window)
        assert exact.step / fast.step == pytest.approx(theory_fast_step_speedup(window))
        assert exact.backward / fast.backward == pytest.approx(theory_fast_backward_speedup(window))
        assert exact.step / per_window.step == pytest.approx(theory_per_window_step_speedup(window))
        assert exact.backward / per_window.backward == pytest.approx(theory_per_window_backward_speedup(window))
    assert theory_fast_step_speedup(window) == pytest.approx(window / 2)
    assert theory_per_window_step_speedup(window) == pytest.approx(3 * window / (window + 6))
    # windows of <= 2 steps run exactly in every variant
    assert fast_cost(NUM_STEPS, 2) == per_window_cost(NUM_STEPS, 2) == exact_cost(NUM_STEPS)


def test_variant_tail_windows():
    # 9 steps at W=4: windows of 4, 4 and a 1-step tail that runs exactly (3F)
    assert fast_cost(9, 4) == Cost(2 + 2 + 1, 4 + 4 + 2)
    assert per_window_cost(9, 4) == Cost(9, 6 + 6 + 2)
    assert theory_fast_step_speedup(4) == pytest.approx(2.0)


TINY_STEPS, TINY_BATCH = 4, 2   # one window of 4 steps: 2 knots, 2 interior steps


@pytest.fixture(scope="module")
def tiny():
    """A 4-step tiny SD3 problem and the jagg@4 reference gradient."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    problem = build_problem("sd3", "tiny", num_steps=TINY_STEPS, batch=TINY_BATCH)
    _, _, reference = _counted_step(problem, "jagg@4")
    yield problem, reference
    torch._dynamo.reset()


def _counted_step(problem, text, step=None):
    """Build (or reuse) the mode's step, run it twice (the first call traces), count the second one's
    DiT passes and cost-model units; return the step, the counts and the (forward, backward, step)
    units, and the gradient."""
    if step is None:
        mode = parse_mode(text)
        step = mode.strategy.build(problem, mode.window)
    for _ in range(2):
        problem.model.zero_grad(set_to_none=True)
        clock = PassClock(problem)
        try:
            with count_dit_passes(problem.model) as counts:
                start, mid, end = step.run(lambda: {"passes": clock()})
        finally:
            clock.close()
    units = (mid["passes"] - start["passes"], end["passes"] - mid["passes"])
    return step, (counts, units), grads(problem.model).clone()


def test_fast_path_runs_no_interior_forward_and_matches_jagg(tiny):
    problem, reference = tiny
    step, (counts, units), grad = _counted_step(problem, "jagg_fast@4")
    assert counts.nograd_forwards == 0                          # no interior forward at all
    assert counts.grad_forwards == 1 and counts.backwards == 1   # one 2B knot forward, one joint backward
    cost = fast_cost(TINY_STEPS, 4)
    assert units == (cost.forward, cost.backward) == (2, 4)
    assert step.cache.stats.misses == 0 and step.cache.stats.hits == 2 * 2   # 2 interior calls per step, 2 steps
    assert rel_err(grad, reference) < 1e-5
    # a parameter written in place drops the cache: the step must refuse to time a fallback
    with torch.no_grad():
        next(problem.model.parameters()).mul_(1.0)
    with pytest.raises(RuntimeError, match="fell back"):
        step.run(lambda: {})


def test_per_window_backward_reruns_the_knots_in_backward_and_matches_jagg(tiny):
    problem, reference = tiny
    _, (counts, units), grad = _counted_step(problem, "jagg_per_window@4")
    # values: one no-grad forward of all 4 steps; backward: the knot forward again, with grad, and its backward
    assert counts.nograd_forwards == 1 and counts.grad_forwards == 1 and counts.backwards == 1
    cost = per_window_cost(TINY_STEPS, 4)
    assert units == (cost.forward, cost.backward) == (4, 6)
    assert rel_err(grad, reference) < 1e-5


def test_variant_maps_in_results():
    """Hand-made round times: each variant gets its own per-window maps next to its theory."""
    def mode(name, window, whole, backward, cost):
        res = ModeResult(name, name.split("@")[0], window, "", dict(forward=cost.forward, backward=cost.backward,
                                                                    step=cost.step))
        res.whole, res.backward = {"fake": whole}, {"fake": backward}
        res.passes = dict(backwards=1, backward_samples=1, forward_samples=1, grad_forwards=1, nograd_forwards=0)
        res.first_call = {"fake": 0.0}
        return res

    runner = types.SimpleNamespace(
        problem=types.SimpleNamespace(name="x", num_params=1, family="sd3", size="tiny", cfg=False, num_steps=16, batch_size=4),
        results={"exact": mode("exact", None, [12.0, 12.0, 12.0], [8.0, 8.0, 8.0], exact_cost(16)),
                 "jagg_fast@4": mode("jagg_fast@4", 4, [6.0, 4.0, 8.0], [4.0, 4.0, 4.0], fast_cost(16, 4)),
                 "jagg_per_window@8": mode("jagg_per_window@8", 8, [10.0, 10.0, 10.0], [5.0, 5.0, 5.0],
                                           per_window_cost(16, 8))},
        elapsed=lambda: 0.0)
    out = summarize(BenchConfig(clocks=("fake",)), runner, {}, [])
    assert out["fast_step_speedup"] == {"4": pytest.approx(2.0)}             # ratios 2, 3, 1.5
    assert out["fast_step_speedup_range"]["4"] == pytest.approx([1.5, 3.0])
    assert out["theory_fast_step_speedup"] == {"4": pytest.approx(2.0)}
    assert out["per_window_step_speedup"] == {"8": pytest.approx(1.2)}
    assert out["theory_per_window_step_speedup"] == {"8": pytest.approx(24 / 14)}
    assert out["speedups"]["jagg_fast@4"]["theory_step"] == pytest.approx(2.0)
    assert out["step_speedup"] == {} and out["theory_step_speedup"] == {}   # the jagg maps stay jagg's
    table = format_table(out | dict(compile_overhead_s={}, recompiles=0, clock="fake", threads=1,
                                    torch_version="x", model_params=1, batch=4, repeats=3))
    assert "fast path" in table and "per-window" in table


def test_default_weights_mode_counts_what_its_cost_model_says():
    """jagg_default@W: the library default (σ-aware); the windows of the problem's schedule that reach
    σ < 0.5 run all their steps as knots: counted backward samples and the cost model agree."""
    from jaggc_studies.bench.strategies import STRATEGIES, default_cost, sigma_exact_windows

    problem = build_problem("sd3", "tiny", num_steps=NUM_STEPS, batch=BATCH)
    exact_windows = sigma_exact_windows(problem, 4)
    assert any(exact_windows) and not all(exact_windows)      # the schedule has both kinds
    step = STRATEGIES["jagg_default"].build(problem, 4)
    with count_dit_passes(problem.model) as counts:
        step.run(lambda: 0.0)
    samples = sum(4 * BATCH if exact else 2 * BATCH for exact in exact_windows)
    assert counts.backwards == len(exact_windows) and counts.backward_samples == samples
    cost = default_cost(problem, 4)
    assert cost.backward == sum(8 if exact else 4 for exact in exact_windows)
    assert STRATEGIES["jagg_default"].cost_for(problem, 4) == cost


def test_profile_ranges_record_every_runtime_piece():
    """``jaggc bench --profile``'s named ranges sit where the runtime calls each function, so every
    range records on a compiled step and on jagg_calls (they once patched a module that only
    imported concat_calls, and the range stayed empty)."""
    from jaggc_studies.bench.profile import _RANGES, _profiled_step
    from jaggc_studies.bench.strategies import compiled_loss, runtime_loss

    problem = build_problem("sd3", "tiny", num_steps=8, batch=2)
    for loss in (compiled_loss(problem, 4), runtime_loss(problem, 4)):
        loss(problem.model, problem.batch).backward()          # trace first: the profile is of a step
        ranges = _profiled_step(problem, loss)["ranges"]
        expected = {name for _, _, name in _RANGES}
        assert expected <= set(ranges), sorted(expected - set(ranges))
        assert {"dit::forward_grad", "dit::forward_nograd"} <= set(ranges)
