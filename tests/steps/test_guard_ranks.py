"""The guard agrees across ranks whatever steps each rank trained (issue 48, item 1).

DanceGRPO's loop draws each rank's trained steps at random, so a JAGG window's lowest σ, hence its σ
range, differs between ranks: here 12 of 16 steps per trajectory (three windows of W = 4), and the
case is picked (checked below, not assumed) so that the ranks' σ ranges differ in number and in kind.
On FSDP1 and FSDP2, 2 gloo ranks, ``Guard(every=1)``:

* no hang (the harness kills the ranks after ``TIMEOUT_S``; gloo's own timeout is 120 s);
* every rank's ``guard.log()`` after every probe, and the decided blocks, identical (bit for bit:
  the ranks reduce the same scalars in the same order);
* each probe's cosine equal to the one computed from the all-rank gradients (the ranks' average of
  each rank's JAGG against the ranks' average of each rank's exact gradient, on unwrapped copies at
  the gathered parameters) to 1e-6: fp32 gradients of the same sums in a different order (FSDP's
  reduce-scatter against a single-process backward) differ by a few ulps per element, ~1e-7
  relative, and the guard's dot products accumulate in float64, so the cosine inherits ~1e-7.

A mismatch between ranks (one rank probes a trajectory another does not) is a JaggError naming it,
not a hang: ``test_a_rank_that_probes_alone_is_an_error``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import jaggc
from jaggc.runtime.guard_stats import range_of
from jaggc.runtime.weights import noise_levels
from jaggc_studies.loops import dance_grpo as dg
from ranks import run_ranks
from test_stepwise_distributed import _avg, _wrap, full_params, reference_grad

WORLD = 2
TIMEOUT_S = 420
NUM_STEPS, FRACTION, SAMPLES, WINDOW, SEED = 16, 0.75, 2, 4, 0
WRAPPERS = ("fsdp1", "fsdp2")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _figures(jagg: dict, exact: dict) -> tuple[float, float]:
    """(cosine, relative error) of two named gradients, in float64."""
    j = torch.cat([jagg[k].double().reshape(-1) for k in sorted(jagg)])
    x = torch.cat([exact[k].double().reshape(-1) for k in sorted(exact)])
    return float(j @ x / (j.norm() * x.norm())), float((j - x).norm() / x.norm())


def local_ranges(run, guard) -> list[list[int]]:
    """Per trajectory, this rank's σ ranges of its JAGG windows (as one process would file them)."""
    out = []
    for sample in run.samples_batched_list:
        t = sample["timesteps"][0, :int(NUM_STEPS * FRACTION)].double()
        sigmas = noise_levels(t[None, :]).reshape(-1).sort(descending=True).values
        windows = [sigmas[k:k + WINDOW] for k in range(0, len(sigmas), WINDOW)]
        out.append([range_of(float(w.min()), guard.sigma_edges) for w in windows if len(w) > 2])
    return out


def dance_case(rank: int, world: int, wrapper: str) -> dict:
    kwargs = dict(samples=SAMPLES, shard=(rank, world), num_steps=NUM_STEPS, fraction=FRACTION, seed=SEED)
    results, logs = [], []
    guard = jaggc.Guard(every=1, probes=2, on_probe=results.append)
    run = dg.setup(**kwargs, wrap=_wrap(wrapper), stepwise=dict(window=WINDOW, weights="t", guard=guard))
    plain = dg.setup(**kwargs)
    expected = []

    def loss_jagg(i):
        def loss(m):
            return jaggc.jagg_compile(lambda dit, r: dg.reference_loss(r, i, dit), dit=m, window=WINDOW, weights="t",
                                      options=jaggc.Options(batch_knots=False))(m, plain)
        return loss

    def check(opt, args, kwargs_):
        i = len(expected)
        logs.append(guard.log())
        params = full_params(run.transformer, wrapper)
        jagg = _avg(reference_grad(plain.transformer, params, loss_jagg(i)))
        exact = _avg(reference_grad(plain.transformer, params, lambda m: dg.reference_loss(plain, i, m)))
        expected.append(_figures(jagg, exact))

    run.optimizer.register_step_pre_hook(check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dg.train_jaggc(run)
        jaggc.stepwise(run.transformer).close()
    return dict(expected=expected, cosines=[r.cosine for r in results], logs=logs,
                history=[h["figures"] for h in guard.history], ranges=local_ranges(run, guard))


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN (a block of one probe has no floor yet: its bias/floor is NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def rank_body(rank: int, world: int) -> dict:
    return {w: dance_case(rank, world, w) for w in WRAPPERS}


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    dg.setup(num_steps=4, samples=1)      # warm the lazy imports before forking
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="guard_ranks", timeout_s=TIMEOUT_S)


def test_the_ranks_sigma_ranges_differ_in_number_and_kind(rank_results):
    a, b = (res["fsdp1"]["ranges"] for res in rank_results)
    assert any(set(x) != set(y) for x, y in zip(a, b)), (a, b)             # in kind
    assert any(len(set(x)) != len(set(y)) for x, y in zip(a, b)), (a, b)   # in number


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_rank_logs_the_same_figures(rank_results, wrapper):
    a, b = (res[wrapper] for res in rank_results)
    assert len(a["logs"]) == SAMPLES and _same(a["logs"], b["logs"])
    assert _same(a["history"], b["history"]) and len(a["history"]) == 1
    assert any(k.startswith("guard/bias_over_floor/") for k in a["logs"][-1])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_each_cosine_is_the_all_rank_gradients_cosine(rank_results, wrapper):
    for res in rank_results:
        r = res[wrapper]
        assert len(r["cosines"]) == len(r["expected"]) == SAMPLES
        for cos, (cos_ref, rel_ref) in zip(r["cosines"], r["expected"]):
            assert rel_ref > 1e-4, rel_ref           # JAGG differs from exact here: the figure can fail
            assert abs(cos - cos_ref) <= 1e-6, (cos, cos_ref)


def lone_probe_body(rank: int, world: int) -> dict:
    """Rank 0 probes every trajectory, rank 1 every other one: at trajectory 1 rank 0 would probe alone."""
    guard = jaggc.Guard(every=1 if rank == 0 else 2, probes=2)
    run = dg.setup(samples=2, shard=(rank, world), num_steps=8, wrap=_wrap("fsdp2"),
                   stepwise=dict(window=WINDOW, weights="t", guard=guard))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dg.train_jaggc(run)
    except jaggc.JaggError as e:
        return dict(error=type(e).__name__, message=str(e), probed=guard.probed)
    return dict(error=None, probed=guard.probed)


def test_a_rank_that_probes_alone_is_an_error(tmp_path_factory):
    results = run_ranks(lone_probe_body, WORLD, tmp_path_factory, name="guard_lone", timeout_s=TIMEOUT_S)
    for rank, res in enumerate(results):
        assert res["error"] == "JaggInputError", res
        assert "disagree" in res["message"] and "every=" in res["message"], res["message"]
        assert res["probed"] == 1, res          # trajectory 0 was probed on both ranks, alike
