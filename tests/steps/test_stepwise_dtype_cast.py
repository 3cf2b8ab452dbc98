"""A loop that casts the timestep to its latents' dtype before the DiT call (plan.py's cast match).

Flow-Factory's SD3.5 adapter calls the DiT with ``t.expand(B).to(latents.dtype)`` and stores its
latents in bf16 or fp16, so the module sees the declared timestep rounded to that dtype (960.13 →
960.0 in bf16): 1e-4 to 2e-3 away from it, beyond the fp32 matching tolerance. Checked, on a tiny
SD3 under a live CPU autocast of the latents' dtype (the GPU's bf16/fp16 mixed precision):

  * bf16 and fp16: the loop runs with the declaration in float32 as the scheduler gives it; W=2 is
    the unchanged loop bit for bit (every step exact, each its own backward) and W=4 ``weights="t"``
    in a ``randperm`` order is the JAGG computed apart from jaggc (``reference_jagg``, its weights
    from the timesteps the DiT saw, as jaggc's) to 1e-5: the reference and jaggc run the same bf16/
    fp16 forwards, and differ only in how the composites are summed (float64 rounded once there, in
    the output dtype here: a few roundings of the composite, far below 1e-5 relative after J^T);
  * the tolerance is not widened: the same rounded value passed as a float32 tensor is refused;
  * two declared steps that round to one bf16 value are refused with an error naming both.
"""

from __future__ import annotations

import pytest
import torch

import jaggc
from helpers import grads, reference_jagg, rel_err
from jaggc import models
from jaggc.errors import JaggInputError

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]

B, T = 2, 6
# FlowMatchEulerDiscreteScheduler(shift=3.0).set_timesteps(10).timesteps[1:7]: float32, every one
# off its bf16 and fp16 rounding (960.1293 -> bf16 960.0, fp16 960.0; 913.3490 -> 912.0, 913.5)
TIMESTEPS = torch.tensor([960.1293, 913.3490, 857.6923, 790.3683, 707.2785, 602.1506])
ORDER = [3, 0, 5, 1, 4, 2]          # a randperm of the trained steps, Flow-Factory's train_timesteps


@pytest.fixture(scope="module")
def problem():
    model = models.sd3("tiny", seed=0)
    cond = models.sd3_conditioning(model, B, seed=1).kwargs
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(B, T, *models.sd3_latent_shape(model, B)[1:], generator=g)
    targets = torch.randn(B, T, *models.sd3_latent_shape(model, B)[1:], generator=g)
    return model, cond, latents, targets


def step_loss(dit, cond, latents, targets, j, dtype):
    """One step as the adapter writes it: latents stored in ``dtype``, the timestep cast to theirs,
    the DiT under the mixed-precision autocast, a loss on the float32 output."""
    x = latents[:, j].to(dtype)
    t = TIMESTEPS[j]
    with torch.autocast("cpu", dtype):
        v = dit(hidden_states=x, timestep=t.expand(B).to(x.dtype), return_dict=False, **cond)[0]
    return (v.float() * targets[:, j]).mean()


def run_loop(model, cond, latents, targets, dtype, order, stepwise=None):
    for p in model.parameters():
        p.grad = None
    steps = order if stepwise is None else stepwise.steps(order, TIMESTEPS[order])
    for j in steps:
        step_loss(model, cond, latents, targets, j, dtype).backward()
    return grads(model).clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_two_is_the_unchanged_loop(problem, dtype):
    model, cond, latents, targets = problem
    unchanged = run_loop(model, cond, latents, targets, dtype, ORDER)
    sw = jaggc.stepwise(model, window=2)
    try:
        got = run_loop(model, cond, latents, targets, dtype, ORDER, sw)
        assert sw.counts.exact_steps == T
    finally:
        sw.close()
    assert torch.equal(got, unchanged)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_four_in_randperm_order_is_jagg(problem, dtype):
    model, cond, latents, targets = problem
    sw = jaggc.stepwise(model, window=4, weights="t")
    try:
        got = run_loop(model, cond, latents, targets, dtype, ORDER, sw)
        assert (sw.counts.jagg_windows, sw.counts.exact_steps) == (1, 2)
    finally:
        sw.close()

    def whole(m):        # the steps in σ order, so that the reference cuts the same windows
        return sum(step_loss(m, cond, latents, targets, j, dtype) for j in range(T))

    for p in model.parameters():
        p.grad = None
    _, ref = reference_jagg(whole, (model,), model, 4)
    assert rel_err(got, ref) <= 1e-5


def test_the_tolerance_is_not_widened(problem):
    """The bf16-rounded timestep passed as float32 is no cast: refused, as before."""
    model, cond, latents, targets = problem
    sw = jaggc.stepwise(model, window=4)
    try:
        with pytest.raises(JaggInputError, match="is none of this trajectory's declared steps"):
            for j in sw.steps(range(T), TIMESTEPS):
                x = latents[:, j]
                dit_t = TIMESTEPS[j].to(torch.bfloat16).float().expand(B)
                model(hidden_states=x, timestep=dit_t, return_dict=False, **cond)[0].mean().backward()
    finally:
        sw.close()


def test_two_steps_rounding_to_one_value_are_refused(problem):
    model, cond, latents, targets = problem
    declared = torch.tensor([964.29, 962.5, 913.3490])          # both of the first two: 964.0 in bf16
    sw = jaggc.stepwise(model, window=4)
    try:
        with pytest.raises(JaggInputError, match=r"declared steps \[0, 1\].*all round to"):
            for j in sw.steps(range(3), declared):
                x = latents[:, j].to(torch.bfloat16)
                with torch.autocast("cpu", torch.bfloat16):
                    out = model(hidden_states=x, timestep=declared[j].expand(B).to(x.dtype), return_dict=False,
                                **cond)[0]
                out.float().mean().backward()
    finally:
        sw.close()
