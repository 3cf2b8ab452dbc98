"""jaggc on a module that lives on an accelerator, seen on the CPU through the stand-in device.

Each test runs a jaggc path on a DiT whose parameters and inputs are stand-ins
(tests/device_standin.py: tensors that claim another device and hold CPU data). An op of jaggc's that
meets a CPU tensor beside them raises CUDA's "Expected all tensors to be on the same device", so a
tensor jaggc makes on the CPU where the module's device was meant fails here as it would on a GPU.
Each path is also checked against the same run on plain CPU tensors: the same numbers.

Covered: the models' conditioning helpers (``sd3_conditioning``, ``flux_conditioning``), the fidelity
estimators and ``jaggc.calibrate`` (``vjp_sum``'s float64 accumulator), ``jaggc.stepwise`` (plain, the
rollout cache, the CFG slice, the guard) and ``@jagg_compile`` (joint, per_window; intercepted).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jaggc
from device_standin import StandIn, on_standin_device, standin, standin_module, to_cpu
from jaggc import models
from jaggc.fidelity.calibrate import calibrate
from jaggc.verify.fields import CurvedField
from jaggc_studies import example_losses as el
from test_fidelity import D, make_batch, toy_loss      # the fidelity tests' loss and batches

pytestmark = pytest.mark.usefixtures("one_thread")

T = 8


def _standin_tree(batch: dict) -> dict:
    return {k: standin(v) if torch.is_tensor(v) else v for k, v in batch.items()}


def _grads(model) -> torch.Tensor:
    return torch.cat([to_cpu(p.grad).reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("builder", ["sd3", "flux"])
def test_conditioning_is_made_on_the_models_device(builder):
    model = getattr(models, builder)("tiny")
    make = models.sd3_conditioning if builder == "sd3" else models.flux_conditioning
    plain = make(model, 2).kwargs
    with on_standin_device():
        cond = make(standin_module(copy.deepcopy(model)), 2).kwargs
    assert sorted(cond) == sorted(plain)
    for name, value in cond.items():
        assert isinstance(value, StandIn), name           # on the module's device, not the CPU
        assert torch.equal(to_cpu(value), plain[name]), name


# --- the fidelity estimators and calibrate ----------------------------------------------------
def test_calibrate_on_a_module_off_the_cpu():
    dit, batch = CurvedField(D, seed=0), make_batch(0)
    cands = [dict(variant="jagg", window=w, weights="t", jagg_frac=1.0) for w in (3, 4)]
    plain = calibrate(toy_loss, dit, batch, target_cosine=0.9, candidates=cands)
    with on_standin_device():
        moved = calibrate(toy_loss, standin_module(copy.deepcopy(dit)), _standin_tree(batch), target_cosine=0.9,
                          candidates=cands)
    by = {r["label"]: r for r in plain["settings"]}
    for row in moved["settings"]:
        # the same float64 computations on the same CPU kernels: equal up to summation order
        assert row["cosine_mean"] == pytest.approx(by[row["label"]]["cosine_mean"], rel=1e-12, abs=1e-12)


# --- the stepwise path ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def flow_grpo():
    ex = el.build_example("flow_grpo_sd3", num_steps=T, batch=2, seed=0)
    return ex.model, ex.batch


def _step_loss(dit, batch, j, cfg=False):
    latents = batch["latents"][:, j]
    kwargs = dict(encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"])
    t = batch["timesteps"][:, j]
    if cfg:
        # a CFG call: [uncond; cond] in one batch, the uncond half a zero prompt and detached (its
        # rows' gradient is zero: the CFG slice runs them without grad from the second trajectory)
        kwargs = {k: torch.cat([torch.zeros_like(v), v]) for k, v in kwargs.items()}
        out = dit(hidden_states=torch.cat([latents, latents]), timestep=torch.cat([t, t]), return_dict=False, **kwargs)[0]
        uncond, cond = out.chunk(2)
        uncond = uncond.detach()
        noise_pred = uncond + 4.5 * (cond - uncond)
    else:
        noise_pred = dit(hidden_states=latents, timestep=t, return_dict=False, **kwargs)[0]
    _, log_prob, _, _ = el.sde_step_with_logprob(noise_pred, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                                 batch["next_latents"][:, j], batch["sigma_max"])
    return el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])


def _stepwise_run(model, batch, settings: dict, *, cfg=False, trajectories=2, rollout=False):
    jagg = jaggc.stepwise(model, **settings)
    for _ in range(trajectories):
        model.zero_grad(set_to_none=True)
        if rollout:
            with torch.no_grad():
                for j in range(T):
                    _step_loss(model, batch, j, cfg)
        for j in jagg.steps(range(T), batch["timesteps"]):
            _step_loss(model, batch, j, cfg).backward()
    counts = vars(jagg.counts).copy()
    jagg.close()
    return counts


SETTINGS = {
    "plain": (dict(window=4, weights="t"), {}),
    "lowmem": (dict(window=4, weights="t", backward="lowmem"), {}),
    "cache": (dict(window=4, weights="t", rollout_cache=True), dict(rollout=True)),
    "slice": (dict(window=4, weights="t", cfg_slice=True), dict(cfg=True)),
    "guard": (dict(window=4, weights="t", guard=jaggc.Guard(every=1)), {}),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_stepwise_on_a_module_off_the_cpu(flow_grpo, name):
    settings, loop = SETTINGS[name]
    model, batch = flow_grpo
    plain = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts = _stepwise_run(plain, batch, copy.deepcopy(settings), **loop)
        moved = standin_module(copy.deepcopy(model))
        with on_standin_device():
            moved_counts = _stepwise_run(moved, _standin_tree(batch), copy.deepcopy(settings), **loop)
    assert moved_counts == counts
    # the same float32 CPU kernels; the stand-in's SDPA may take another CPU kernel than a plain CPU
    # tensor's (the math one): float32 roundoff of a few ops' accumulation, nothing more
    ref = torch.cat([p.grad.reshape(-1) for p in plain.parameters() if p.grad is not None])
    assert float((_grads(moved) - ref).norm() / ref.norm()) < 1e-5
    if name == "cache":
        assert counts["cached_forwards"] > 0
    if name == "slice":
        assert counts["sliced_steps"] > 0


@pytest.mark.parametrize("backward", ["joint", "per_window"])
def test_whole_loss_on_a_module_off_the_cpu(flow_grpo, backward):
    model, batch = flow_grpo

    def loss(dit, b):
        return sum(_step_loss(dit, b, j) for j in range(T))

    # the intercepting frontend: Dynamo does not trace under the stand-in's dispatch mode, and FX's fake
    # tensors do not take the stand-in subclass; the runtime that places jaggc's tensors is the same.
    # backward='lowmem' needs a captured graph: its device placement is held by the static rule
    # (tests/repository/test_device_placement.py)
    capture = "intercept"
    plain = copy.deepcopy(model)
    jaggc.jagg_compile(loss, window=4, weights="t", backward=backward, capture=capture)(plain, batch).backward()
    moved = standin_module(copy.deepcopy(model))
    with on_standin_device():
        compiled = jaggc.jagg_compile(loss, window=4, weights="t", backward=backward, capture=capture)
        compiled(moved, _standin_tree(batch)).backward()
    assert compiled.report.path == capture
    ref = torch.cat([p.grad.reshape(-1) for p in plain.parameters() if p.grad is not None])
    assert float((_grads(moved) - ref).norm() / ref.norm()) < 1e-5
