"""The guard inside ``jaggc.stepwise`` (``guard=jaggc.Guard(...)``, jaggc/steps/probe.py).

* The trainers' loops in float64 (Flow-GRPO under accelerate with LoRA, CFG and the KL reference,
  with and without the CFG slice and the rollout cache; DanceGRPO in its random order, every backward
  form): each probe's cosine and relative error equal an independent computation (the trajectory's
  exact per-step gradient from the unchanged loop at the same parameters against the unguarded
  stepwise run's) to 1e-12 (Flux, whose norms compute in float32: 1e-9), and ``.grad`` at every
  optimizer step is bit-identical with and without the guard.
* A field that bends below σ = 0.5 more with every trajectory (tests/guard_fields.py): the guard
  flags σ∈[0,0.25) within one block of probes, ``adapt`` makes those windows exact (visible in the
  report), the gradient's cosine to the exact one recovers to 1; ``exact`` turns JAGG off.
* Resume: the guard's state saved after an adaptation, loaded in a fresh process, continues its block
  and keeps the adapted range exact.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import jaggc
from guard_fields import DriftingField, loop, trajectory
from helpers import grads
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, rollouts

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]


def _cos(a, b):
    return float(a @ b / (a.norm() * b.norm()))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def flow_model(run):
    return run.accelerator.unwrap_model(run.transformer)


FLOW_OPTIONS = {"plain": ({}, False), "slice and cache": (dict(cfg_slice=True, rollout_cache=True), True)}


@pytest.mark.parametrize("options", sorted(FLOW_OPTIONS))
def test_flow_grpo_probes_are_the_independent_figures_and_grad_is_unchanged(options):
    extra, on_policy = FLOW_OPTIONS[options]
    config = fg.TrainConfig(max_grad_norm=1e12)
    kw = dict(num_steps=6, batch=2, trajectories=3, dtype=torch.float64, config=config)
    results = []
    guard = jaggc.Guard(every=1, on_probe=results.append)
    guarded = fg.setup(**kw, stepwise=dict(window=4, weights="t", guard=guard, **extra))
    plain = fg.setup(**kw, stepwise=dict(window=4, weights="t", **extra))
    seen = {"guarded": [], "plain": [], "exact": []}

    def record(name, run):
        def hook(opt, args, kwargs):
            seen[name].append(grads(flow_model(run)).clone())
            if name == "plain":       # the trajectory's exact gradient at the same parameters
                sample = run.samples_batched[len(seen["exact"])]
                m = copy.deepcopy(flow_model(run))
                fg.reference_loss(run, sample, m).backward()
                seen["exact"].append(grads(m).clone())
        run.optimizer.optimizer.register_step_pre_hook(hook)

    record("guarded", guarded)
    record("plain", plain)
    for run in (guarded, plain):
        if on_policy:
            rollouts.flow_grpo_epoch(run, seed=1)
        fg.train_jaggc(run)
    assert len(results) == len(seen["plain"]) == 3
    for r, g_run, j, x in zip(results, seen["guarded"], seen["plain"], seen["exact"]):
        assert torch.equal(g_run, j)                         # .grad bit-identical
        assert abs(r.cosine - _cos(j, x)) <= 1e-12 and abs(r.rel_error - _rel(j, x)) <= 1e-12
        assert r.rel_error > 1e-6                            # JAGG is not exact here
    c = jaggc.stepwise(guarded.transformer).counts
    assert c.probe_backwards == 3 and guard.probed == 3
    for run in (guarded, plain):
        jaggc.stepwise(run.transformer).close()


@pytest.mark.parametrize("backward", ["joint", "lowmem", "per_window"])
def test_dance_grpo_random_order_probes(backward):
    kw = dict(num_steps=10, samples=2, dtype=torch.float64)
    results = []
    guard = jaggc.Guard(every=1, on_probe=results.append)
    guarded = dg.setup(**kw, stepwise=dict(window=4, weights="t", backward=backward, guard=guard))
    plain = dg.setup(**kw, stepwise=dict(window=4, weights="t", backward=backward))
    seen = {"guarded": [], "plain": [], "exact": []}
    guarded.optimizer.register_step_pre_hook(lambda o, a, k: seen["guarded"].append(grads(guarded.transformer).clone()))

    def at_plain_step(opt, args, kwargs):
        seen["plain"].append(grads(plain.transformer).clone())
        m = copy.deepcopy(plain.transformer)      # the sample's exact gradient at the same parameters
        dg.reference_loss(plain, len(seen["exact"]), m).backward()
        seen["exact"].append(grads(m).clone())
    plain.optimizer.register_step_pre_hook(at_plain_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # lowmem out of order announces its re-runs
        dg.train_jaggc(guarded)
        dg.train_jaggc(plain)
    assert len(results) == 2
    # the model does not allow float64 throughout: diffusers' Flux computes its RMS norms in float32,
    # so its backward is linear in the upstream gradient only to float32 precision, and the probe's
    # error (one backward of a difference of upstream gradients) is the difference of the two
    # backwards to ~1e-8 of itself (measured; SD3 above: 1e-16)
    for r, g_run, j, x in zip(results, seen["guarded"], seen["plain"], seen["exact"]):
        assert torch.equal(g_run, j)
        assert abs(r.cosine - _cos(j, x)) <= 1e-9 and abs(r.rel_error - _rel(j, x)) <= 1e-7 * _rel(j, x)
    for run in (guarded, plain):
        jaggc.stepwise(run.transformer).close()


def drifting_run(guard, trajectories: int, *, ramp=3.0, start: int = 0):
    """The drifting field's loop with ``guard``; per trajectory the cosine of the stepwise gradient
    to the exact one."""
    model = DriftingField()
    exact = copy.deepcopy(model)
    jagg = jaggc.stepwise(model, window=4, weights="t", guard=guard)
    cosines = []
    for i in range(start, start + trajectories):
        for m in (model, exact):
            m.strength.fill_(max(0, i - 3) * ramp)
        traj = trajectory(i)
        cosines.append(_cos(loop(model, traj, jagg), loop(exact, traj)))
    return jagg, cosines


def test_adapt_makes_the_drifting_range_exact():
    guard = jaggc.Guard(every=1, probes=4, on_drift="adapt")
    with pytest.warns(UserWarning, match=r"adapt: windows whose lowest σ lies in σ∈\[0,0.25\) run exactly"):
        jagg, cosines = drifting_run(guard, 12)
    assert all(c >= 1 - 1e-12 for c in cosines[:4])          # strength 0: JAGG exact on the chord
    assert min(cosines[4:8]) < 0.95                            # the drift, within the second block
    assert guard.exact_ranges == {0} and guard.history[1]["drifted"] and not guard.history[0]["drifted"]
    assert all(c >= 1 - 1e-12 for c in cosines[8:])           # recovered: the bent window runs exactly
    windows = jagg.report.windows
    assert windows[1]["mode"] == "exact" and "guard" in windows[1]["reason"] and windows[0]["mode"] == "jagg"
    assert "exact σ ranges (adapted): σ∈[0,0.25)" in str(jagg.report)
    jagg.close()


def test_exact_turns_jagg_off():
    guard = jaggc.Guard(every=1, probes=4, on_drift="exact")
    with pytest.warns(UserWarning, match="JAGG is off"):
        jagg, cosines = drifting_run(guard, 10)
    assert guard.jagg_off and all(w["mode"] == "exact" for w in jagg.report.windows)
    assert all(c >= 1 - 1e-12 for c in cosines[8:])
    assert guard.calls == 10 and guard.probed == 8              # no JAGG window left to probe
    jagg.close()


def test_one_trajectory_in_every_is_probed():
    guard = jaggc.Guard(every=3)
    jagg, _ = drifting_run(guard, 7, ramp=0.0)
    assert (guard.calls, guard.probed) == (7, 3) and jagg.counts.probe_backwards == 3 * 2
    jagg.close()


def test_resume_in_a_fresh_process(tmp_path):
    guard = jaggc.Guard(every=1, probes=4, on_drift="adapt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jagg, _ = drifting_run(guard, 10)
    jagg.close()
    assert guard.exact_ranges == {0} and guard.block.n == 2 and len(guard.history) == 2
    torch.save(guard.state_dict(), tmp_path / "guard.pt")
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(f"""
        import sys, warnings
        sys.path[:0] = [{str(Path(__file__).resolve().parents[1])!r}, {str(Path(__file__).resolve().parent)!r}]
        import torch, jaggc
        from test_stepwise_guard import drifting_run
        guard = jaggc.Guard(every=1, probes=4, on_drift="adapt")
        guard.load_state_dict(torch.load(sys.argv[1], weights_only=False))
        jagg, cosines = drifting_run(guard, 2, start=10)
        print(guard.calls, guard.probed, len(guard.history), guard.history[-1]["probes"], sorted(guard.exact_ranges),
              jagg.report.windows[1]["mode"], min(cosines) >= 1 - 1e-12)
    """))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "guard.pt")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    # the saved block held 2 probes: the resumed run's 2 more fill it (a third decided block, at probe 12)
    assert out.stdout.split() == ["12", "12", "3", "12", "[0]", "exact", "True"]


def test_load_refuses_other_sigma_ranges():
    state = jaggc.Guard(every=1).state_dict()
    with pytest.raises(jaggc.JaggInputError, match="sigma_edges"):
        jaggc.Guard(every=1, sigma_edges=(0.5,)).load_state_dict(state)


def test_accelerate_checkpoints_the_guard(tmp_path):
    """``accelerator.register_for_checkpointing(guard)``: ``save_state`` / ``load_state`` carry it."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    guard = jaggc.Guard(every=1, probes=4, on_drift="adapt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drifting_run(guard, 10)[0].close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.register_for_checkpointing(guard)
    accelerator.save_state(str(tmp_path / "ckpt"))
    fresh = jaggc.Guard(every=1, probes=4, on_drift="adapt")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.register_for_checkpointing(fresh)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert (fresh.calls, fresh.probed, fresh.exact_ranges, fresh.block.n) == (10, 10, {0}, 2)
    assert torch.equal(fresh.block.whole.sum, guard.block.whole.sum)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jagg, cosines = drifting_run(fresh, 2, start=10)
    assert len(fresh.history) == 3 and jagg.report.windows[1]["mode"] == "exact"
    jagg.close()
