"""The CFG slice (``cfg_slice=True``) of ``jaggc.stepwise`` on a DeepSpeed engine, 2 gloo ranks.

The loop is the per-step shape of tests/steps/test_stepwise_deepspeed.py with Flow-GRPO's CFG call:
the engine called on ``[neg; pos]``, the guided velocity built with the uncond half detached, so the
slice learns in the first trajectory that the uncond rows' cotangent is zero and from the second on
runs them without grad. ``gradient_accumulation_steps`` = the steps of one trajectory (the boundary
at each trajectory's last step), two trajectories. Checked on ZeRO-1 and ZeRO-2:

* W=2: the parameters after both boundaries equal the unchanged loop's within the split batch's
  roundoff (a half-size call's rows may round differently: 1e-6 relative, as tests/steps/
  test_stepwise_slice.py bounds it in one process; measured 1.6e-9 and 1.8e-9), with the second
  trajectory's steps sliced (``pytest -s`` prints the measured figures);
* W=4: ZeRO's reduced gradient at each boundary equals the same W=4 loop's without the slice (1e-5:
  the split batch's roundoff and, after the first step, parameters that differ by it; measured 0 at
  the first boundary, 1.7e-7 at the second), and the second trajectory's steps are sliced.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

import jaggc  # noqa: E402
from jaggc import models  # noqa: E402
from ranks import run_ranks  # noqa: E402

WORLD, B, T, TRAJECTORIES = 2, 2, 6, 2
SCALE = 4.5                 # the guidance scale
LR = 1e-2

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _engine(dit, stage: int):
    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": T,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=dit, optimizer=torch.optim.SGD(dit.parameters(), lr=LR), config=config)
    return engine


def run_loop(base, stage: int, rank: int, window: int | None, cfg_slice: bool) -> dict:
    """Two trajectories of the CFG loop on a fresh engine: the reduced gradient before each
    boundary's step, the parameters at the end, jaggc's counts."""
    from deepspeed.utils import safe_get_full_grad

    engine = _engine(copy.deepcopy(base), stage)
    cond = models.sd3_conditioning(base, 2 * B, seed=1).kwargs           # [neg; pos] rows
    shape = models.sd3_latent_shape(base, B)
    g = torch.Generator().manual_seed(300 + rank)
    if window is not None:
        jaggc.stepwise(engine, window=window, weights="t", cfg_slice=cfg_slice)
    grads = []
    for _ in range(TRAJECTORIES):
        ts = 1000 * (torch.linspace(1.0, 0.55, T)[None, :] - 0.02 * torch.rand(B, 1, generator=g))
        zs = [torch.randn(shape, generator=g) for _ in range(T)]
        gs = [torch.randn(shape, generator=g) for _ in range(T)]
        steps = range(T) if window is None else jaggc.stepwise(engine).steps(range(T), ts)
        for j in steps:
            out = engine(hidden_states=torch.cat([zs[j], zs[j]]), timestep=torch.cat([ts[:, j], ts[:, j]]),
                         return_dict=False, **cond)[0]
            uncond, guided = out.chunk(2)
            v = uncond.detach() + SCALE * (guided - uncond.detach())
            engine.backward((v.float() * gs[j]).sum() / B)
            if j == T - 1:
                grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()})
            engine.step()
    result = dict(grads=grads, params={n: p.detach().clone() for n, p in engine.module.named_parameters()})
    if window is not None:
        result["counts"] = vars(jaggc.stepwise(engine).counts).copy()
        jaggc.stepwise(engine).close()
    return result


def rank_body(rank: int, world: int) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    base = models.sd3("tiny")
    out = {"base": {n: p.detach().clone() for n, p in base.named_parameters()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stage in (1, 2):
            out[("w2", stage)] = (run_loop(base, stage, rank, None, False), run_loop(base, stage, rank, 2, True))
            out[("w4", stage)] = (run_loop(base, stage, rank, 4, False), run_loop(base, stage, rank, 4, True))
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="stepwise_deepspeed_cfg", timeout_s=600)


def _rel(a: dict, b: dict) -> float:
    fa = torch.cat([a[k].double().reshape(-1) for k in sorted(b)])
    fb = torch.cat([b[k].double().reshape(-1) for k in sorted(b)])
    return float((fa - fb).norm() / fb.norm())


@pytest.mark.parametrize("stage", [1, 2])
def test_w2_with_the_slice_is_the_unchanged_loop(rank_results, stage):
    for res in rank_results:
        unchanged, sliced = res[("w2", stage)]
        assert _rel(unchanged["params"], res["base"]) > 1e-6                 # the steps moved them
        assert _rel(sliced["params"], unchanged["params"]) <= 1e-6, _rel(sliced["params"], unchanged["params"])
        print(f"ZeRO-{stage} W=2 sliced vs unchanged parameters: {_rel(sliced['params'], unchanged['params']):.2g}")
        # the first trajectory learns the uncond rows' zero cotangent, the second runs its 6 steps sliced
        assert sliced["counts"]["sliced_steps"] == T and sliced["counts"]["recoveries"] == 0, sliced["counts"]
        assert sliced["counts"]["fallbacks"] == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_w4_with_the_slice_is_w4_without(rank_results, stage):
    for res in rank_results:
        plain, sliced = res[("w4", stage)]
        assert plain["counts"]["jagg_windows"] == sliced["counts"]["jagg_windows"] == TRAJECTORIES
        assert sliced["counts"]["sliced_steps"] > 0 and sliced["counts"]["recoveries"] == 0, sliced["counts"]
        for got, want in zip(sliced["grads"], plain["grads"]):
            assert _rel(got, want) < 1e-5, _rel(got, want)
            print(f"ZeRO-{stage} W=4 sliced vs unsliced reduced gradient: {_rel(got, want):.2g}")
