"""The few-step schedules against their definitions (Flow-GRPO-Fast, MixGRPO, DanceGRPO): which
steps the rollout samples by the SDE, which it trains and in which order, the on-policy ratio of 1,
and their JAGG compositions through ``jaggc.stepwise``; ``jaggc study fewsteps --quick``.

Tiny sizes: an untrained digits DiT, 2 classes x 4 samples, T = 6 or 10."""

from __future__ import annotations

import json

import pytest
import torch

from jaggc.cli import main as cli_main
from jaggc.errors import JaggInputError
from jaggc_studies.digits import build_dit
from jaggc_studies.digits.trainer import TrainerConfig, rollout
from jaggc_studies.fewsteps.schedules import DANCE_FRACTION, MIX_SHIFT_INTERVAL, Schedule, early_range, parse_schedule
from jaggc_studies.fewsteps.trainer import FewStepTrainer, schedule_gradient, step_loss

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(classes_per_iter=2, group_size=4, minibatches=1, reward="jpeg")


def _trainer(name: str, num_steps: int = 10, seed: int = 0, **kw) -> FewStepTrainer:
    config = TrainerConfig(num_steps=num_steps, seed=seed, **{**TINY, **kw})
    return FewStepTrainer(build_dit(seed=0), config, schedule=parse_schedule(name))


# ---------------------------------------------------------------------------------------------
# the schedules' definitions


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fast_is_one_window_of_k_sde_steps_in_the_early_range_and_trains_exactly_those(k):
    T = 10
    schedule = Schedule("fast", k)
    starts = set()
    for it in range(60):
        sde = schedule.sde_steps(T, it, seed=3)
        assert sde == schedule.train_steps(T, it, seed=3)                 # only the SDE steps are trained, in order
        assert sde == tuple(range(sde[0], sde[0] + k))                    # consecutive (Flow-GRPO-Fast's window)
        assert 0 <= sde[0] and sde[-1] < early_range(T) == T // 2         # inside the early range
        starts.add(sde[0])
    assert starts == set(range(early_range(T) - k + 1))                  # every start of [lo, hi - k] is drawn
    assert schedule.sde_steps(T, 7, seed=3) == schedule.sde_steps(T, 7, seed=3)   # reproducible


def test_mix_window_slides_one_step_every_shift_interval_and_shrinks_at_the_end():
    T, w = 10, 4
    schedule = Schedule("mix", w)
    for it in range(12 * MIX_SHIFT_INTERVAL):
        cur = min(it // MIX_SHIFT_INTERVAL, T - 2)
        expected = tuple(range(cur, min(cur + w, T - 1)))               # MixGRPO: range(cur, min(cur + w, last))
        assert schedule.sde_steps(T, it, 0) == expected == schedule.train_steps(T, it, 0)
    assert schedule.train_steps(T, 0, 0) == (0, 1, 2, 3)
    assert schedule.train_steps(T, MIX_SHIFT_INTERVAL, 0) == (1, 2, 3, 4)
    assert schedule.train_steps(T, 7 * MIX_SHIFT_INTERVAL, 0) == (7, 8)   # shrunk: the sigma -> 0 step is never trained


def test_dance_samples_every_step_by_the_sde_and_trains_a_random_60_percent_in_random_order():
    T = 10
    schedule = Schedule("dance")
    orders = set()
    for it in range(40):
        assert schedule.sde_steps(T, it, 0) == tuple(range(T))
        steps = schedule.train_steps(T, it, 0)
        assert len(steps) == int((T - 1) * DANCE_FRACTION) == len(set(steps))
        assert all(0 <= j < T - 1 for j in steps)
        orders.add(steps == tuple(sorted(steps)))
    assert orders == {True, False} or orders == {False}                   # DanceGRPO's permuted order


def test_schedule_names_parse_and_bad_ones_are_refused():
    assert parse_schedule("fast4+jagg4") == Schedule("fast", 4, 4)
    assert parse_schedule("mix4").name == "mix4" and parse_schedule("dance+jagg4").name == "dance+jagg4"
    assert parse_schedule("mix4+jagg4fo") == Schedule("mix", 4, 4, first_order=True)
    assert parse_schedule("mix4+jagg4fo").name == "mix4+jagg4fo"
    for bad in ("fast", "slow2", "fast2+jag4", "exact+jagg", "exact+jaggfo", "mix4+jagg4of"):
        with pytest.raises(JaggInputError):
            parse_schedule(bad)
    with pytest.raises(JaggInputError, match="early range"):
        Schedule("fast", 6).validate(10)


# ---------------------------------------------------------------------------------------------
# the sampler: SDE on the schedule's steps, the Euler ODE step elsewhere, log-probs of SDE steps only


def test_rollout_takes_the_euler_step_outside_the_sde_steps_and_stores_their_log_probs_only():
    torch.manual_seed(0)
    dit = build_dit(seed=0)
    config = TrainerConfig(num_steps=6, **TINY)
    labels = torch.tensor([0, 0, 1, 1])
    sde = (1, 2)
    batch = rollout(dit, labels, config, torch.Generator().manual_seed(5), sde_steps=sde)
    from jaggc_studies.digits.model import class_conditioning

    cond = class_conditioning(labels)
    with torch.no_grad():
        for j in range(6):
            z = batch["latents"][:, j]
            if j in sde:
                assert torch.isfinite(batch["log_probs"][:, j]).all()
                continue
            assert torch.isnan(batch["log_probs"][:, j]).all()
            v = dit(hidden_states=z, timestep=batch["timesteps"][:, j], **cond, return_dict=False)[0]
            euler = z + (batch["sigmas_next"][0, j] - batch["sigmas"][0, j]) * v
            torch.testing.assert_close(batch["next_latents"][:, j], euler, atol=1e-6, rtol=1e-6)
    # the ODE steps draw no noise: the trajectory up to the first SDE step is the same from any generator
    other = rollout(dit, labels, config, torch.Generator().manual_seed(5), sde_steps=sde)
    torch.testing.assert_close(other["latents"], batch["latents"], atol=0, rtol=0)
    # and an SDE step does draw it: its next state is not the Euler step
    with torch.no_grad():
        z = batch["latents"][:, 1]
        v = dit(hidden_states=z, timestep=batch["timesteps"][:, 1], **cond, return_dict=False)[0]
        assert not torch.allclose(batch["next_latents"][:, 1], z + (batch["sigmas_next"][0, 1] - batch["sigmas"][0, 1]) * v)


@pytest.mark.parametrize("name", ["fast2", "mix3", "dance", "exact"])
def test_on_policy_ratio_is_one_on_the_trained_steps(name):
    trainer = _trainer(name, num_steps=8)
    for it in (0, 1):
        batch = trainer.collect(it)
        batch["train_steps"] = trainer.train_steps(it)
        sde = trainer.sde_steps(it)
        assert set(batch["train_steps"]) <= set(sde)
        with torch.no_grad():
            new = torch.stack([step_loss(trainer.dit, batch, j)[1] for j in batch["train_steps"]], 1)
        old = batch["log_probs"][:, list(batch["train_steps"])]
        ratio = torch.exp(new - old)
        # same parameters, same inputs, the same expression as the rollout's: fp32 roundoff of one step
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)


def test_trainer_trains_the_schedules_steps_with_one_backward_each():
    trainer = _trainer("fast2", num_steps=8)
    for _ in range(3):
        log = trainer.step()
        assert log["train_steps"] == list(trainer.schedule.train_steps(8, log["iteration"], 0))
        assert log["backward_passes"] == log["backward_work"] == 2 * trainer.config.minibatches
        assert torch.isfinite(torch.tensor(log["loss"]))


# ---------------------------------------------------------------------------------------------
# the JAGG compositions


def test_a_two_step_window_is_all_knots_so_the_composition_is_the_peers_gradient():
    plain, composed = _trainer("fast2"), _trainer("fast2+jagg2")
    batch = plain.collect(0)
    batch["train_steps"] = plain.train_steps(0)
    composed.collect(0)
    exact = schedule_gradient(plain.dit, batch, plain.params)
    approx = schedule_gradient(composed.dit, batch, composed.params, composed.stepwise)
    # a W=2 window has no interior step: the same per-step graphs, the same fp32 sums
    torch.testing.assert_close(approx, exact, atol=1e-6, rtol=1e-5)
    composed.close()


def test_fast4_with_jagg4_runs_one_jagg_window_served_by_the_rollout_cache():
    trainer = _trainer("fast4+jagg4", num_steps=10)
    log = trainer.step()
    assert log["backward_work"] == 2                                      # one joint pass over the two knots' rows
    report = str(trainer.stepwise.report)
    assert "1 trajectories, 1 JAGG windows, 0 exact steps" in report      # minibatches=1: one trajectory
    assert "(0 hits" not in report and "hits" in report                   # the on-policy interior came from the rollout
    trainer.close()
    assert "forward" not in trainer.dit.__dict__                     # the module's own forward is back


def test_the_first_order_composition_serves_the_later_minibatch():
    """fast4+jagg4fo, 2 minibatches: the first on-policy from the rollout, the second (after the optimizer
    step) served first-order: its window's 2 interior steps run no forward."""
    counts = {}
    for name in ("fast4+jagg4", "fast4+jagg4fo"):
        trainer = _trainer(name, num_steps=10, minibatches=2)
        trainer.step()
        counts[name] = trainer.stepwise.report.counts
        trainer.close()
    plain, served = counts["fast4+jagg4"], counts["fast4+jagg4fo"]
    assert plain.first_order_served == 0 and plain.nograd_forwards == 2
    assert served.first_order_served == 2 and served.nograd_forwards == 0


# ---------------------------------------------------------------------------------------------
# the study command


def test_study_fewsteps_quick_runs_and_reports_each_schedule(tmp_path, capsys):
    path = tmp_path / "fs.json"
    assert cli_main(["study", "fewsteps", "--quick", "--no-progress", "--no-pictures", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    names = list(result["strategies"])
    assert names == ["exact", "fast1", "fast2+jagg2", "mix3+jagg3", "dance+jagg3"]
    budget = result["options"]["budget"]
    for name, entry in result["strategies"].items():
        assert f"| {name} |" in out
        assert entry["iterations_run"]["min"] >= 2
        # the budget is CPU seconds: on a slow CPU a first iteration may overrun it, and then that
        # snapshot is absent (and warned about), never one taken past the budget
        if max(run["cpu_curve"][0] for run in entry["per_seed"]) <= budget:
            assert entry["budget.cpu_s"]["max"] <= budget
        else:
            assert "budget.reward" not in entry
    assert result["strategies"]["fast1"]["trained_steps"]["mean"] == 1
    assert result["strategies"]["fast2+jagg2"]["grad_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert set(result["pareto_iterations"]) <= set(names) and result["pareto_iterations"]
    assert "goal" in out


def test_a_first_iteration_over_the_budget_leaves_no_snapshot_and_says_so(capsys):
    from jaggc_studies.fewsteps.cli import QUICK
    from jaggc_studies.fewsteps.study import FewStepsOptions, main_fewsteps

    options = FewStepsOptions(**{**QUICK, "budget": 1e-6, "seeds": 1, "schedules": ("fast1",), "progress": False})
    with pytest.warns(UserWarning, match=r"fast1 \(seed 0\): its first iteration took .* no budget snapshot"):
        result = main_fewsteps(options)
    entry = result["strategies"]["fast1"]
    assert "budget.reward" not in entry and "goal.reward" not in entry and "iterations.reward" in entry
    assert "| fast1 | 1.0 |" in capsys.readouterr().out and result["goal"] == {}


def test_pareto_front_and_goal_check_on_made_up_results():
    from jaggc_studies.fewsteps.study import goal_check, pareto_front

    def entry(kind, k, jagg, cpu, reward, goal_reward, budget_reward):
        stat = lambda v: dict(mean=v, min=v, max=v)     # noqa: E731
        return {"schedule": dict(kind=kind, k=k, jagg=jagg), "iterations.cpu_s": stat(cpu),
                "iterations.reward": stat(reward), "goal.reward": stat(goal_reward), "budget.reward": stat(budget_reward)}

    strategies = {"exact": entry("exact", 0, None, 10.0, 0.5, 0.3, 0.4),
                  "fast2": entry("fast", 2, None, 4.0, 0.3, 0.35, 0.45),
                  "fast4": entry("fast", 4, None, 6.0, 0.3, 0.3, 0.4),        # dominated by fast2
                  "fast4+jagg4": entry("fast", 4, 4, 5.0, 0.4, 0.44, 0.5)}
    assert pareto_front(strategies) == ["fast2", "fast4+jagg4", "exact"]
    goal = goal_check(strategies)
    assert goal["best_peer"] == "fast2" and goal["best_composition"] == "fast4+jagg4" and not goal["met"]
    strategies["fast4+jagg4"]["goal.reward"]["mean"] = 0.45
    assert goal_check(strategies)["met"]
