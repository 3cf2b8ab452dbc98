"""``jaggc.stepwise``'s safety cases: never a silently wrong or partial ``.grad``.

Each case of ``jaggc/stepwise/safety.py``'s table on the float64 Flow-GRPO step of test_stepwise.py,
8 steps, two windows of 4, plain JAGG: the window runs exactly with one warning (and ``.grad`` is
then what the unchanged loop computes for the exact steps plus JAGG for the untouched windows), or a
``JaggUnsupportedError`` names the step, its line and the fix, the parameters are unchanged and the
next trajectory starts clean.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jaggc
from helpers import grads, rel_err
from test_stepwise import T, problem, step_loss, whole_loss  # noqa: F401 - the shared fixture

pytestmark = pytest.mark.usefixtures("one_thread")

LINE = r"test_stepwise\.py:\d+"       # the user's call site (the DiT call in step_loss)


def exact_grad(model, batch, steps):
    """The unchanged loop's gradient of ``steps`` (each its own backward, repeats counted)."""
    m = copy.deepcopy(model)
    for j in steps:
        step_loss(m, batch, j).backward()
    return grads(m)


def jagg_grad(model, batch, steps):
    """Plain JAGG (one window of 4) over ``steps`` as a whole loss."""
    m = copy.deepcopy(model)
    jaggc.jagg_compile(lambda dit, b: sum(step_loss(dit, b, j) for j in steps), window=4, weights="t",
                       dit=m)(m, batch).backward()
    return grads(m)


@pytest.fixture
def setup(problem):
    model, batch = problem
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4, weights="t")
    yield model, batch, m, jagg
    jagg.close()


def clean_trajectory_after(model, batch, m, jagg, weights="t"):
    """The next trajectory is right: .grad from zero equals whole-loss JAGG at m's parameters."""
    m.zero_grad()
    for j in jagg.steps(range(T), batch["timesteps"]):
        step_loss(m, batch, j).backward()
    ref = copy.deepcopy(m)
    ref.zero_grad()
    jaggc.jagg_compile(whole_loss, window=4, weights=weights)(ref, batch).backward()
    assert rel_err(grads(m), grads(ref)) < 1e-13


def test_optimizer_step_inside_a_window_is_refused_before_parameters_move(setup):
    model, batch, m, jagg = setup
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": optimizer.step\(\) ran while JAGG window\(s\) \[0\] "
                                                                 r"were open \(steps \[0, 1\] ran.*gradient_accumulation_steps"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 1:
                opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    clean_trajectory_after(model, batch, m, jagg)


def test_optimizer_step_between_windows_is_fine(setup):
    """An optimizer step after a window completed (window 0 is steps 0-3) breaks nothing."""
    model, batch, m, jagg = setup
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 3:
                opt.step()
                opt.zero_grad()
    assert jagg.counts.fallbacks == 0 and jagg.counts.jagg_windows == 2


def test_a_parameter_written_inside_a_window_is_refused(setup):
    model, batch, m, jagg = setup
    with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": parameter '.*' was written between the steps of an "
                                                                 r"open JAGG window \(steps \[0, 1, 2\] ran before step 3"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 2:
                with torch.no_grad():
                    next(m.parameters()).mul_(1.01)
    clean_trajectory_after(model, batch, m, jagg)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_inside_a_window_drops_what_the_loop_drops(setup, set_to_none):
    """zero_grad after step 5 (window 1 = steps 4-7 open; window 0 done): the loop keeps steps 6, 7
    only, so window 1 runs exactly from step 6 on; .grad = exact(6, 7)."""
    model, batch, m, jagg = setup
    with pytest.warns(UserWarning, match=r"zero_grad\(\) ran between the steps of a JAGG window \(before step 6\): the "
                                         r"gradient of steps \[4, 5\] was dropped"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 5:
                m.zero_grad(set_to_none=set_to_none)
    assert rel_err(grads(m), exact_grad(model, batch, [6, 7])) < 1e-13
    assert jagg.counts.fallbacks == 1


def test_a_clip_inside_a_window_is_refused(setup):
    """clip_grad_norm_ after step 5 reads window 0's gradient without window 1's steps 4, 5."""
    model, batch, m, jagg = setup
    with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": the .grad of '.*' was written between the steps of "
                                                                 r"an open JAGG window \(before step 6, while the gradient of steps \[4, 5\] was held back.*clip_grad_norm_"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 5:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    clean_trajectory_after(model, batch, m, jagg)


def test_break_runs_the_open_window_exactly(setup):
    model, batch, m, jagg = setup
    with pytest.warns(UserWarning, match=r"ended when its loop was left early \(break or an exception\) \(6 of 8 declared "
                                         r"steps ran; steps \[6, 7\] did not\): JAGG window\(s\) \[1\] ran exactly"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 5:
                break
    assert rel_err(grads(m), jagg_grad(model, batch, range(4)) + exact_grad(model, batch, [4, 5])) < 1e-13
    clean_trajectory_after(model, batch, m, jagg)


def test_an_exception_between_forward_and_backward(setup):
    """The step the exception left the loop in never ran its backward: it contributes nothing, as in
    the loop; the open window's earlier steps run exactly."""
    model, batch, m, jagg = setup
    with pytest.warns(UserWarning, match=r"JAGG window\(s\) \[1\] ran exactly"), pytest.raises(RuntimeError, match="NaN"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            loss = step_loss(m, batch, j)
            if j == 5:
                raise RuntimeError("NaN loss")
            loss.backward()
    assert rel_err(grads(m), jagg_grad(model, batch, range(4)) + exact_grad(model, batch, [4])) < 1e-13
    clean_trajectory_after(model, batch, m, jagg)


def test_fewer_steps_than_declared(setup):
    model, batch, m, jagg = setup
    with pytest.warns(UserWarning, match=r"ended when its loop ended \(6 of 8 declared steps ran; steps \[6, 7\] did not\)"):
        for j in jagg.steps(range(6), batch["timesteps"]):
            step_loss(m, batch, j).backward()
    assert rel_err(grads(m), jagg_grad(model, batch, range(4)) + exact_grad(model, batch, [4, 5])) < 1e-13


def test_a_step_visited_twice_runs_its_window_exactly(setup):
    model, batch, m, jagg = setup
    order = [0, 1, 1, 2, 3, 4, 5, 6, 7]
    with pytest.warns(UserWarning, match=LINE + r": step 1 \(window 0\) was called twice in one trajectory"):
        for j in jagg.steps(order, batch["timesteps"]):
            step_loss(m, batch, j).backward()
    expected = exact_grad(model, batch, [0, 1, 1, 2, 3]) + jagg_grad(model, batch, range(4, 8))
    assert rel_err(grads(m), expected) < 1e-13


def test_a_second_trajectory_before_the_first_finished(setup):
    """The declaration form: trajectory() again after 6 steps ends the first (window 1 exactly)."""
    model, batch, m, jagg = setup
    jagg.trajectory(batch["timesteps"])
    for j in range(6):
        step_loss(m, batch, j).backward()
    with pytest.warns(UserWarning, match=r"ended when the next trajectory was declared \(6 of 8"):
        jagg.trajectory(batch["timesteps"])
    assert rel_err(grads(m), jagg_grad(model, batch, range(4)) + exact_grad(model, batch, [4, 5])) < 1e-13
    clean_trajectory_after(model, batch, m, jagg)


@pytest.mark.parametrize("form", ["inputs", "autograd.grad", "autograd.grad allow_unused"])
def test_backward_forms_that_skip_jaggc_are_refused(setup, form):
    """``backward(inputs=params)`` and ``torch.autograd.grad`` (torch's default ``allow_unused=False``
    too, which torch itself would refuse first: the parameters are inputs of jaggc's node) cannot
    serve a JAGG step, whose gradient reaches ``.grad`` only through its window's joint backward:
    refused at that step's backward, naming the step and its line, with no gradient written."""
    model, batch, m, jagg = setup
    params = list(m.parameters())
    with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": step 0's loss went through torch.autograd.grad or "
                                                                 r"backward\(inputs=\.\.\.\).*loss.backward\(\) once per step"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            loss = step_loss(m, batch, j)
            if form == "inputs":
                loss.backward(inputs=params)
            else:
                torch.autograd.grad(loss, params, allow_unused=form.endswith("allow_unused"))
    assert all(p.grad is None for p in params)
    clean_trajectory_after(model, batch, m, jagg)


def test_a_step_left_without_backward_adds_nothing(setup):
    """Step 1's loss left without backward, then the loop left by ``break`` after step 2's forward: as
    in the loop, steps 1 and 2 add nothing; window 0 runs step 0 exactly, with a warning."""
    model, batch, m, jagg = setup
    with pytest.warns(UserWarning, match=r"steps \[1, 2\] ran no backward and add nothing, as in the loop\): JAGG "
                                         r"window\(s\) \[0\] ran exactly"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            loss = step_loss(m, batch, j)
            if j == 2:
                break
            if j == 0:
                loss.backward()
    assert rel_err(grads(m), exact_grad(model, batch, [0])) < 1e-13
    clean_trajectory_after(model, batch, m, jagg)


def test_a_refusal_at_the_end_of_a_finished_loop_raises_there(setup):
    """A loop that ends by exhaustion ends its trajectory in the generator's own frame: the refusal
    (a clip after the last step read a gradient that lacks the held-back steps) raises right there."""
    model, batch, m, jagg = setup
    with pytest.raises(jaggc.JaggUnsupportedError, match=r"the trajectory ended when its loop ended with JAGG windows "
                                                         r"open, and the .grad of '.*' was written"):
        for j in jagg.steps(range(2), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 1:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    clean_trajectory_after(model, batch, m, jagg)


def test_a_second_backward_through_a_finished_window_is_refused(setup):
    model, batch, m, jagg = setup
    with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": step 3's output got a second gradient after its "
                                                                 r"window's joint backward ran"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            loss = step_loss(m, batch, j)
            loss.backward(retain_graph=True)
            if j == 3:
                loss.backward()
    clean_trajectory_after(model, batch, m, jagg)


def test_an_input_written_after_its_call_is_refused_when_re_run(problem):
    model, batch = problem
    m = copy.deepcopy(model)
    jagg = jaggc.stepwise(m, window=4, weights="t", backward="per_window")
    latents = batch["latents"].clone()
    local = dict(batch, latents=latents)
    with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": an input of step 0's DiT call was written in place"):
        for j in jagg.steps(range(T), local["timesteps"]):
            step_loss(m, local, j).backward()
            if j == 1:
                latents.mul_(0.5)
    jagg.close()
