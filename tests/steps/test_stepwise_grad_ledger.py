"""What the loop does to ``.grad`` while a JAGG window holds a step's gradient back (issue 42).

Each case is a loop that disturbs a window where ``.grad`` shows nothing of it: the first window of
an accumulation cycle (every ``.grad`` None, or zero after ``zero_grad(set_to_none=False)``), right
after an exact step's backward in a random order, and a ``zero_grad`` followed by the loop's end.
On the float64 Flow-GRPO step of test_stepwise.py, 8 steps, windows of 4: ``.grad`` equals what
the unchanged loop keeps (its exact steps, JAGG for the untouched windows) with one warning, or a
``JaggUnsupportedError`` names the step, and the next trajectory is clean. The ledger's marks
(steps/ledger.py) never show: a parameter no step reaches keeps ``.grad`` None, and ``.grad`` is
the unmarked loop's bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jaggc
from helpers import grads, rel_err
from test_stepwise import RANDOM_ORDER, T, problem, step_loss  # noqa: F401 - the shared fixture
from test_stepwise_safety import LINE, clean_trajectory_after, exact_grad, jagg_grad

pytestmark = pytest.mark.usefixtures("one_thread")

DEFAULT = jaggc.Basis("linear", "t", exact_below=0.5)     # window [4..7] reaches σ < 0.5: exact


def stepwise_on(problem, weights="t"):
    model, batch = problem
    m = copy.deepcopy(model)
    return model, batch, m, jaggc.stepwise(m, window=4, weights=weights)


def reset(m, how: str) -> None:
    if how == "module":
        m.zero_grad()
    elif how == "optimizer":
        torch.optim.SGD(m.parameters(), lr=0.1).zero_grad()
    else:                           # set_to_none=False: gradients zeroed in place (or left None)
        m.zero_grad(set_to_none=False)


def start_of_cycle(m, batch, jagg, entry: str) -> None:
    """``.grad`` as an accumulation cycle starts: None, or zero tensors (``set_to_none=False``)."""
    if entry == "zeros":
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
        m.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
    else:
        assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("entry", ["none", "zeros"])
@pytest.mark.parametrize("how", ["module", "optimizer", "in place"])
def test_zero_grad_in_the_first_window_of_a_cycle(problem, entry, how):
    """zero_grad after step 1 of window [0..3] while every .grad shows nothing: the loop keeps steps
    2-7; window 0 runs steps 2, 3 exactly, window 1 stays JAGG."""
    model, batch, m, jagg = stepwise_on(problem)
    start_of_cycle(m, batch, jagg, entry)
    with pytest.warns(UserWarning, match=r"zero_grad\(\) ran between the steps of a JAGG window \(before step 2\): the "
                                         r"gradient of steps \[0, 1\] was dropped"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 1:
                reset(m, how)
    expected = exact_grad(model, batch, [2, 3]) + jagg_grad(model, batch, range(4, 8))
    assert rel_err(grads(m), expected) < 1e-13
    jagg.close()


@pytest.mark.parametrize("entry", ["none", "zeros"])
@pytest.mark.parametrize("write", ["clip", "scale", "unscale"])
def test_a_gradient_write_in_the_first_window_of_a_cycle_is_refused(problem, entry, write):
    """A clip (which skips None gradients), a hand-written scaling or a GradScaler's unscale_ and a clip
    after step 1 would scale steps 0 and 1 in the loop, and jaggc holds them back: refused at step 2.
    (``unscale_`` alone is not seen: torch's unscale kernel bumps no version counter; docs/stepwise.md)"""
    model, batch, m, jagg = stepwise_on(problem)
    start_of_cycle(m, batch, jagg, entry)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": the .grad of '.*' was written between the steps of "
                                                                 r"an open JAGG window \(before step 2, while the gradient "
                                                                 r"of steps \[0, 1\] was held back"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            loss = step_loss(m, batch, j)
            (scaler.scale(loss) if write == "unscale" else loss).backward()
            if j == 1:
                if write == "clip":
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
                elif write == "scale":
                    for p in m.parameters():
                        if p.grad is not None:
                            p.grad.mul_(0.5)
                else:               # unscale_ then clip, as accelerate's clip_grad_norm_ does
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    clean_trajectory_after(model, batch, m, jagg)
    jagg.close()


@pytest.mark.parametrize("disturbance", ["zero_grad", "clip"])
def test_right_after_an_exact_step_in_a_random_order(problem, disturbance):
    """σ-aware placement: window [4..7] is exact. In the order 0, 4, then a zero_grad (or a clip),
    the exact step 4's own backward wrote .grad just before: the reset is still seen (the ledger
    looks again when that backward has finished), and step 0's held-back gradient is dropped."""
    model, batch, m, jagg = stepwise_on(problem, DEFAULT)
    order = [0, 4, 1, 2, 3, 5, 6, 7]
    if disturbance == "zero_grad":
        with pytest.warns(UserWarning, match=r"before step 1\): the gradient of steps \[0\] was dropped"):
            for j in jagg.steps(order, batch["timesteps"]):
                step_loss(m, batch, j).backward()
                if j == 4:
                    m.zero_grad()
        assert rel_err(grads(m), exact_grad(model, batch, [1, 2, 3, 5, 6, 7])) < 1e-13
    else:
        with pytest.raises(jaggc.JaggUnsupportedError, match=r"before step 1, while the gradient of steps \[0\] was held"):
            for j in jagg.steps(order, batch["timesteps"]):
                step_loss(m, batch, j).backward()
                if j == 4:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    m.zero_grad()
    clean_trajectory_after(model, batch, m, jagg, DEFAULT)
    jagg.close()


def test_a_reset_or_clip_with_nothing_held_back_changes_nothing(problem):
    """Window [0..3] in the order 3, 2, 1, 0: after step 3's forward but before its backward nothing is
    held back, so a clip or zero_grad there reads the unchanged loop's .grad: no fallback, no error."""
    model, batch, m, jagg = stepwise_on(problem)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for j in jagg.steps(range(T), batch["timesteps"]):
            loss = step_loss(m, batch, j)
            if j == 4:                                     # window 0 done, window 1's first step not yet back
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
                m.zero_grad()
            loss.backward()
    assert jagg.counts.fallbacks == 0 and jagg.counts.jagg_windows == 2
    assert rel_err(grads(m), jagg_grad(model, batch, range(4, 8))) < 1e-13
    jagg.close()


@pytest.mark.parametrize("end", ["break", "fewer steps", "next declaration"])
def test_zero_grad_then_the_loop_ends(problem, end):
    """zero_grad after step 1, then no DiT call before the trajectory ends: the loop's .grad is None,
    and so is jaggc's (the dropped steps are not backpropagated at the close)."""
    model, batch, m, jagg = stepwise_on(problem)
    with pytest.warns(UserWarning, match=r"the gradient of steps \[0, 1\] was dropped"):
        if end == "next declaration":
            jagg.trajectory(batch["timesteps"])
            for j in range(2):
                step_loss(m, batch, j).backward()
            m.zero_grad()
            jagg.trajectory(batch["timesteps"])
        else:
            for j in jagg.steps(range(T) if end == "break" else range(2), batch["timesteps"]):
                step_loss(m, batch, j).backward()
                if j == 1:
                    m.zero_grad()
                    if end == "break":
                        break
    assert all(p.grad is None for p in m.parameters())
    m.zero_grad()
    clean_trajectory_after(model, batch, m, jagg)
    jagg.close()


def test_grad_scaler_with_a_declaration_left_early_is_jaggcs_refusal(problem):
    """``trajectory()`` (no ``steps()``: a ``break`` is not seen), the loop left after step 1, then
    ``scaler.step``: torch's GradScaler would assert "No inf checks were recorded" (every .grad None);
    the marks give it gradients to check, and jaggc's optimizer-step refusal names the open window."""
    model, batch, m, jagg = stepwise_on(problem)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in m.parameters()]
    jagg.trajectory(batch["timesteps"])
    for j in range(T):
        scaler.scale(step_loss(m, batch, j)).backward()
        if j == 1:
            break
    with pytest.raises(jaggc.JaggUnsupportedError, match=r"optimizer.step\(\) ran while JAGG window\(s\) \[0\] were open"):
        scaler.step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    m.zero_grad()
    clean_trajectory_after(model, batch, m, jagg)
    jagg.close()


def test_the_marks_never_show(problem):
    """A parameter no step reaches keeps .grad None through a trajectory, as in the unchanged loop, and
    a zero gradient stays +0.0 (its mark, -0.0 while a step's gradient is held back, is taken back);
    the reached ones are whole-loss JAGG's."""
    model, batch = problem
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    for mod in (ref, m):
        mod.register_parameter("unreached", torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    for j in RANDOM_ORDER:
        step_loss(ref, batch, j).backward()
    jagg = jaggc.stepwise(m, window=4, weights="t")
    marked = []
    for j in jagg.steps(RANDOM_ORDER, batch["timesteps"]):
        step_loss(m, batch, j).backward()
        marked.append(m.unreached.grad is not None)
    assert any(marked) and m.unreached.grad is None and ref.unreached.grad is None
    m.zero_grad(set_to_none=False)
    m.unreached.grad = torch.zeros(3, dtype=torch.float64)
    for j in jagg.steps(RANDOM_ORDER, batch["timesteps"]):
        step_loss(m, batch, j).backward()
        marked.append(bool(m.unreached.grad.signbit().all()))
    assert any(marked[T:]) and not m.unreached.grad.any() and not m.unreached.grad.signbit().any()
    reached = torch.cat([p.grad.reshape(-1) for n, p in m.named_parameters() if n != "unreached"])
    assert rel_err(reached, jagg_grad(model, batch, range(4)) + jagg_grad(model, batch, range(4, 8))) < 1e-13
    jagg.close()


def test_another_models_optimizer_steps_freely(problem):
    """An open window refuses an optimizer step of its module's parameters only: another model's
    optimizer in the same process (a reward model's, a plain loop's) steps."""
    model, batch, m, jagg = stepwise_on(problem)
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 1:
                opt.step()
    assert jagg.counts.jagg_windows == 2
    with pytest.raises(jaggc.JaggUnsupportedError, match=r"optimizer.step\(\) ran while JAGG window\(s\) \[0\]"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 1:
                torch.optim.SGD(m.parameters(), lr=0.1).step()
    jagg.close()


@pytest.mark.parametrize("between", ["zero_grad", "clip"])
def test_between_a_steps_forward_and_its_backward(problem, between):
    """Step 1's forward, then the loop resets (or clips) .grad, then step 1's backward: the reset drops
    step 0's held-back gradient (window 0 runs steps 1-3 exactly), the clip is refused at step 1's
    backward, before the window's joint backward could add to a clipped gradient."""
    model, batch, m, jagg = stepwise_on(problem)
    if between == "zero_grad":
        with pytest.warns(UserWarning, match=r"\(between step 1's forward and its backward\): the gradient of steps \[0\]"):
            for j in jagg.steps(range(T), batch["timesteps"]):
                loss = step_loss(m, batch, j)
                if j == 1:
                    m.zero_grad()
                loss.backward()
        assert rel_err(grads(m), exact_grad(model, batch, [1, 2, 3]) + jagg_grad(model, batch, range(4, 8))) < 1e-13
    else:
        with pytest.raises(jaggc.JaggUnsupportedError, match=LINE + r": the .grad of '.*' was written between the steps "
                                                                     r"of an open JAGG window \(between step 1's forward"):
            for j in jagg.steps(range(T), batch["timesteps"]):
                loss = step_loss(m, batch, j)
                if j == 1:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
                loss.backward()
        m.zero_grad()
        clean_trajectory_after(model, batch, m, jagg)
    jagg.close()


def test_what_a_reset_dropped_no_longer_holds_the_parameters(problem):
    """zero_grad after step 0, then a parameter written: nothing of the window is held back any more,
    so the write is the loop's business (steps 1-3 run exactly with the new parameters)."""
    model, batch, m, jagg = stepwise_on(problem)
    with pytest.warns(UserWarning, match=r"the gradient of steps \[0\] was dropped"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 0:
                m.zero_grad()
                with torch.no_grad():
                    next(m.parameters()).mul_(1.01)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        next(ref.parameters()).mul_(1.01)
    assert rel_err(grads(m), exact_grad(ref, batch, [1, 2, 3]) + jagg_grad(ref, batch, range(4, 8))) < 1e-13
    jagg.close()


def test_an_optimizer_step_with_nothing_held_back_is_the_loops(problem):
    """trajectory(), step 0's forward raises (caught), then optimizer.step(): step 0 ran no backward, so
    nothing is held back and the step is taken; the trajectory ends at the next declaration, where
    step 0 adds nothing, as in the loop."""
    model, batch, m, jagg = stepwise_on(problem)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(hidden_states=batch["latents"][:, 0], timestep=batch["timesteps"][:, 0], encoder_hidden_states=batch["prompt_embeds"],
      pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0].sum().backward()     # some .grad
    jagg.trajectory(batch["timesteps"])
    try:
        step_loss(m, batch, 0)
        raise RuntimeError("a NaN reward")
    except RuntimeError:
        pass
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    with pytest.warns(UserWarning, match=r"steps \[0\] ran no backward and add nothing"):
        jagg.trajectory(batch["timesteps"])
    jagg.close()


def test_an_optimizer_step_right_after_a_zero_grad_steps(problem):
    """After step 0's backward, zero_grad(set_to_none=False) then optimizer.step(), before any other DiT
    call: the optimizer's pre-hook reads the reset first (step 0's held-back gradient is dropped, as
    the loop drops it), so nothing is held back and the step is taken (a found campaign case)."""
    model, batch, m, jagg = stepwise_on(problem)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"\(before optimizer.step\(\)\): the gradient of steps \[0\] was dropped"):
        for j in jagg.steps(range(T), batch["timesteps"]):
            step_loss(m, batch, j).backward()
            if j == 0:
                m.zero_grad(set_to_none=False)
                before = [p.detach().clone() for p in m.parameters()]
                opt.step()
                assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))    # zero gradients
                with torch.no_grad():
                    ref = copy.deepcopy(m)
    assert rel_err(grads(m), exact_grad(ref, batch, [1, 2, 3]) + jagg_grad(ref, batch, range(4, 8))) < 1e-13
    jagg.close()
