"""The per-window backward mode (runtime/deferred.py): same gradient as the joint mode, values from
no-grad forwards, one knot forward+backward per window inside ``loss.backward()``, and the peak
saved-activation memory of one window instead of all of them."""

from __future__ import annotations

import pytest
import torch

import jaggc
from helpers import grad_of, grads, linear_loss, rel_err, zero_grads
from jaggc import models
from jaggc_studies.example_losses import build_example
from jaggc.runtime import DitCall, WindowOptions, count_dit_passes, jagg_calls, run_exact, run_window
from jaggc.runtime.memory import track_saved_tensors

PER_WINDOW = WindowOptions(backward="per_window")


def trajectory(model, steps: int, batch: int = 2, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cond = {k: v.to(dtype) for k, v in models.sd3_conditioning(model, batch, seed=seed).kwargs.items()}
    shape = models.sd3_latent_shape(model, batch)
    # per-sample timesteps (non-uniform, decreasing) so the weights differ per sample
    t0 = torch.tensor([950.0, 900.0][:batch], dtype=dtype)
    calls = [DitCall((), dict(hidden_states=torch.randn(shape, generator=g).to(dtype),
                              timestep=t0 - 37.0 * k - 3.0 * k * k, return_dict=False, **cond))
             for k in range(steps)]
    gs = [torch.randn(shape, generator=g).to(dtype) for _ in range(steps)]
    return calls, gs


@pytest.fixture(scope="module")
def model64():
    return models.sd3("tiny", seed=0).double()


def first(outs):
    return [o[0] for o in outs]


@pytest.mark.parametrize("steps,window,batch_knots,chunk", [
    (4, 4, True, None), (7, 3, True, None), (10, 4, True, None), (9, 8, True, 2), (10, 4, False, 1)])
def test_per_window_gradient_equals_joint_mode(model64, steps, window, batch_knots, chunk):
    calls, gs = trajectory(model64, steps)
    joint = grad_of(model64, lambda: first(jagg_calls(model64, calls, window=window)), gs)
    opts = WindowOptions(backward="per_window", batch_knots=batch_knots, interior_chunk=chunk)
    deferred = grad_of(model64, lambda: first(jagg_calls(model64, calls, window=window, options=opts)), gs)
    assert joint.norm() > 0
    assert rel_err(deferred, joint) < 1e-12


def test_per_window_with_unused_steps_and_scaled_loss(model64):
    """Steps the loss never reads get no upstream gradient (None); a scaled loss (accelerate divides
    by the accumulation steps) scales the nested backward too."""
    calls, gs = trajectory(model64, 8)
    gs = [None if k in (1, 4, 5) else g for k, g in enumerate(gs)]
    joint = grad_of(model64, lambda: first(jagg_calls(model64, calls, window=4)), gs)
    zero_grads(model64)
    outs = first(jagg_calls(model64, calls, window=4, options=PER_WINDOW))
    (0.25 * linear_loss(outs, gs)).backward()
    assert rel_err(grads(model64), 0.25 * joint) < 1e-12
    zero_grads(model64)


def test_per_window_values_match_per_step_calls(model64):
    calls, _ = trajectory(model64, 5)
    with torch.no_grad():
        want = [c(model64)[0] for c in calls]
    # one step per forward: the same computation as the per-step calls, bit for bit
    got = first(run_window(model64, calls, options=WindowOptions(backward="per_window", interior_chunk=1)))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
        assert a.requires_grad
    batched = first(run_window(model64, calls, options=PER_WINDOW))
    for a, b in zip(batched, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_per_window_runs_knot_passes_inside_backward(model64):
    calls, gs = trajectory(model64, 8)
    zero_grads(model64)
    with count_dit_passes(model64) as counts:
        outs = first(jagg_calls(model64, calls, window=4, options=PER_WINDOW))
        after_forward = (counts.grad_forwards, counts.nograd_forwards, counts.backwards)
        linear_loss(outs, gs).backward()
    assert after_forward == (0, 2, 0)  # forward: one no-grad forward of all 4 steps per window
    assert counts.grad_forward_batches == [4, 4]  # backward: one 2-knot forward per window...
    assert counts.backward_batches == [4, 4]  # ...and one joint backward
    zero_grads(model64)


def test_per_window_peak_saved_memory_is_one_window():
    """16 steps, W=4: the joint mode keeps 4 windows' knot activations until backward; the
    per-window mode one window's, and with separate knot passes about one step's, like the
    per-step backward loop Flow-GRPO runs."""
    model = models.sd3("tiny", seed=0)
    calls, gs = trajectory(model, 16, dtype=torch.float32)

    def peak(run):
        zero_grads(model)
        with track_saved_tensors() as stats:
            linear_loss(first(run()), gs).backward()
        assert stats.live_bytes == 0  # everything saved was released
        return stats.peak_bytes

    def per_step_loop():
        for c, g in zip(calls, gs):
            linear_loss([c(model)[0]], [g]).backward()
        return []

    exact = peak(lambda: run_exact(model, calls))
    joint = peak(lambda: jagg_calls(model, calls, window=4))
    deferred = peak(lambda: jagg_calls(model, calls, window=4, options=PER_WINDOW))
    separate = peak(lambda: jagg_calls(model, calls, window=4,
                                       options=WindowOptions(backward="per_window", batch_knots=False)))
    with track_saved_tensors() as stats:
        per_step_loop()
    loop = stats.peak_bytes
    assert joint < 0.6 * exact  # 2 knots of 4 steps
    assert deferred < 0.35 * joint
    assert separate < deferred
    assert separate < 1.1 * loop


def test_per_window_double_backward_is_refused(model64):
    calls, gs = trajectory(model64, 4)
    loss = linear_loss(first(run_window(model64, calls, options=PER_WINDOW)), gs)
    loss.backward(retain_graph=True)
    with pytest.raises(jaggc.JaggUnsupportedError, match="backpropagated twice"):
        loss.backward()
    zero_grads(model64)


def test_unknown_backward_mode_is_refused():
    with pytest.raises(jaggc.JaggInputError, match="backward='sideways'"):
        WindowOptions(backward="sideways")


def test_compiled_per_window_mode_matches_joint():
    ex = build_example("flow_grpo_sd3", num_steps=8, batch=2, seed=0)
    ex.model.double()
    batch = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in ex.batch.items()}

    def run(fn):
        zero_grads(ex.model)
        loss = fn(ex.model, batch)
        loss.backward()
        return loss.detach(), grads(ex.model).clone()

    plain_loss, _ = run(ex.loss_fn)
    joint_loss, joint = run(jaggc.jagg_compile(ex.loss_fn, window=4))
    compiled = jaggc.jagg_compile(ex.loss_fn, window=4, backward="per_window")
    run(compiled)  # the first call captures (Dynamo runs the DiT's hooks on fake tensors)
    with count_dit_passes(ex.model) as counts:
        loss, deferred = run(compiled)
    assert rel_err(deferred, joint) < 1e-12
    torch.testing.assert_close(loss, plain_loss, rtol=1e-12, atol=0)
    assert counts.backwards == 2 and counts.grad_forwards == 2
