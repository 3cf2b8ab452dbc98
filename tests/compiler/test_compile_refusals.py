"""What ``@jagg_compile`` refuses, and how.

Every refusal raises a ``jaggc.JaggError`` subclass whose message names where the problem is
(the step, graph node or ``file:line`` of the user's code) and how to fix it, and nothing is
computed: the model's ``.grad`` is what it was before the call. ``on_unsupported="exact"`` turns
a capture refusal into a warning and the uncompiled (exact) loss.

All cases use small float64 fields from ``jaggc.verify.fields`` (cheap to capture).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import jaggc
from jaggc import JaggCaptureError, JaggGraphError, JaggInputError, JaggUnsupportedError, jagg_compile
from jaggc.runtime import count_dit_passes
from jaggc.verify.fields import AffineJacobianField, CurvedField

from helpers import grads, rel_err, zero_grads

T = 4
B = 2
HERE = re.escape(__file__.rsplit("/", 1)[-1])
AT_LINE = HERE + r":\d+"


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def inputs(num_steps: int = T, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.2, num_steps, dtype=torch.float64)
    ts = torch.stack([t, t * 0.9], 1)
    zs = torch.randn(num_steps, B, 3, generator=g, dtype=torch.float64)
    gs = torch.randn(num_steps, B, 3, generator=g, dtype=torch.float64)
    return zs, ts, gs


# --------------------------------------------------------------------------- the losses

HEAD = torch.nn.Linear(3, 3).double()


def never_calls_dit(dit, zs, ts, g, n: int):
    total = 0.0
    for k in range(n):
        total = total + (HEAD(zs[k]) * g[k]).sum()
    return total


def calls_forward(dit, zs, ts, g, n: int):
    total = 0.0
    for k in range(n):
        v = dit.forward(zs[k], ts[k])
        total = total + (v * g[k]).sum()
    return total


def chained_states(dit, zs, ts, g, n: int):
    """The next state is computed from this step's output without detach: not a stored trajectory."""
    total = 0.0
    x = zs[0]
    for k in range(n):
        v = dit(x, ts[k])
        total = total + (v * g[k]).sum()
        x = x + 0.1 * v
    return total


def with_no_grad_block(dit, zs, ts, g, n: int):
    total = 0.0
    for k in range(n):
        v = dit(zs[k], ts[k])
        with torch.no_grad():
            v_ref = dit(zs[k], ts[k])
        total = total + (v * g[k]).sum() + ((v - v_ref) ** 2).sum()
    return total


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def with_function_apply(dit, zs, ts, g, n: int):
    total = 0.0
    for k in range(n):
        v = dit(zs[k], ts[k])
        total = total + (Scale.apply(v) * g[k]).sum()
    return total


def tensor_control_flow(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        loss = (v * g[k]).sum()
        if loss.item() > 0:
            loss = loss * 0.5
        total = total + loss
    return total


def reference_calls(dit, zs, ts, g, n: int):
    """n grad-enabled calls and n no-grad reference calls."""
    total = 0.0
    for k in range(n):
        v = dit(zs[k], ts[k])
        with torch.no_grad():
            v_ref = dit(zs[k], ts[k])
        total = total + (v * g[k]).sum() + 0.1 * ((v - v_ref) ** 2).sum()
    return total


def plain_loss(dit, zs, ts, g, n: int):
    total = 0.0
    for k in range(n):
        total = total + (dit(zs[k], ts[k]) * g[k]).sum()
    return total


# --------------------------------------------------------------------------- the cases


@dataclass
class Case:
    loss: Callable
    options: dict
    error: type
    patterns: list[str]
    with_n: bool = True
    num_steps: int = T
    ts: Callable | None = None           # ts override: (ts) -> ts
    fields: dict = field(default_factory=dict)


CASES = {
    "forward-fx": Case(calls_forward, dict(capture="fx", window=2), JaggUnsupportedError,
                       [AT_LINE + r": the DiT \(AffineJacobianField\) is called through `\.forward\(\.\.\.\)`",
                        r"call the module itself, `dit\(\.\.\.\)`"]),
    "forward-dynamo": Case(calls_forward, dict(capture="dynamo", window=2), JaggGraphError,
                           [AT_LINE + r": the DiT \(AffineJacobianField\) is called through `\.forward\(\.\.\.\)`",
                            r"graph node flat_apply", r"call the module itself, `dit\(\.\.\.\)`"]),
    "dependent_states-fx": Case(chained_states, dict(capture="fx", window=2), JaggGraphError,
                                [r"step 1 \(node dit_call_1, .*" + AT_LINE + r"\)",
                                 r"depends on the output of step 0 \(node dit_call\)", r"`\.detach\(\)` the states"]),
    "dependent_states-dynamo": Case(chained_states, dict(capture="dynamo", window=2), JaggGraphError,
                                    [r"step 1 \(node dit_call_1, .*" + AT_LINE + r"\)",
                                     r"depends on the output of step 0 \(node dit_call\)",
                                     r"`\.detach\(\)` the states"]),
    "function_apply-fx": Case(with_function_apply, dict(capture="fx", window=2), JaggCaptureError,
                              [AT_LINE + r": the loss calls Scale\.apply", r"@torch\.fx\.wrap",
                               r"capture='dynamo'"]),
    "control_flow-dynamo": Case(tensor_control_flow, dict(capture="dynamo", window=2), JaggUnsupportedError,
                                [r"^" + r".*" + AT_LINE + r": Dynamo could not capture tensor_control_flow",
                                 r"on_unsupported='exact'", r"\.item\(\)"], with_n=False),
    "duplicate_timesteps": Case(plain_loss, dict(capture="dynamo", window=4), JaggInputError,
                                [r"steps 1 and 2 have the same timestep", r"pass each step's own timestep"],
                                ts=lambda ts: torch.stack([ts[0], ts[1], ts[1], ts[3]])),
}


def case_inputs(case: Case) -> tuple:
    """The model and the loss's arguments of a refusal case."""
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs(case.num_steps)
    if case.ts is not None:
        ts = case.ts(ts)
    return model, (model, zs, ts, gs, case.num_steps) if case.with_n else (model, zs, ts, gs)


@pytest.mark.parametrize("case_id", list(CASES))
def test_refusal(case_id):
    case = CASES[case_id]
    model, args = case_inputs(case)
    # a gradient from an earlier micro-batch: a refusal must leave it as it is
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = grads(model).clone()
    HEAD.zero_grad(set_to_none=True)

    compiled = jagg_compile(case.loss, **case.options)
    with pytest.raises(case.error) as info:
        compiled(*args)
    message = str(info.value)
    for pattern in case.patterns:
        assert re.search(pattern, message), f"{pattern!r} not in:\n{message}"
    assert torch.equal(grads(model), before)
    assert HEAD.weight.grad is None
    # Function.apply is restored after the FX frontend's refusal
    x = torch.ones(2, requires_grad=True)
    Scale.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


@pytest.mark.parametrize("window", [1, 0, -3, 2.5, "4"])
def test_window_below_two_or_not_int(window):
    with pytest.raises(JaggInputError, match=re.escape(f"window={window!r}") + r": a JAGG window needs an int of "
                                             r"at least 2 steps"):
        jagg_compile(plain_loss, window=window)


@pytest.mark.parametrize("bad, value", [
    (lambda: dict(capture="torchscript"), "torchscript"), (lambda: dict(options=jaggc.Options(on_unsupported="ignore")), "ignore"),
    (lambda: dict(routing=jaggc.Routing(jagg_frac=1.5)), 1.5), (lambda: dict(options=jaggc.Options(backend="tvm")), "tvm"),
    (lambda: dict(routing=jaggc.Routing(threshold=1.5)), 1.5), (lambda: dict(backward="later"), "later"),
    (lambda: dict(routing=jaggc.Routing(exact_below=500.0)), 500.0), (lambda: dict(options=dict(batch_knots=False)), "dict"),
    (lambda: dict(jagg_frac=1.5), 1.5), (lambda: dict(batch_size=4), "batch_size")])
def test_bad_options_refused_at_decoration(bad, value):
    """The options objects refuse bad values when built, jagg_compile when given them (or a
    deprecated keyword with a bad value), each naming the value."""
    with pytest.raises(jaggc.JaggError, match=re.escape(repr(value) if not isinstance(value, str) or value not in ("dict", "batch_size") else value)):
        jagg_compile(plain_loss, **bad())


def test_forward_refusal_is_final_in_auto():
    """Calling the DiT through `.forward` breaks a precondition whatever captures the loss: auto
    refuses at the first path, as a JaggGraphError, without running any DiT forward elsewhere."""
    compiled = jagg_compile(calls_forward, window=2)
    model = AffineJacobianField(3, seed=1)
    with count_dit_passes(model) as counts, pytest.raises(JaggGraphError) as info:
        compiled(model, *inputs(), T)
    assert re.search(AT_LINE + r": the DiT \(AffineJacobianField\) is called through `\.forward\(\.\.\.\)`", str(info.value))
    assert counts.grad_forwards + counts.nograd_forwards == 0 and compiled.capture_failures == []


def test_no_grad_block_compiles_with_fx_and_dynamo_alike():
    """A no-grad reference block (once refused by FX) is recorded as grad-mode switches."""
    model = AffineJacobianField(3, seed=1)
    args = (model, *inputs(), T)
    results = []
    for capture in ("fx", "dynamo"):
        zero_grads(model)
        compiled = jagg_compile(with_no_grad_block, window=2, capture=capture)
        loss = compiled(*args)
        loss.backward()
        assert compiled.report.path == capture and compiled.report.reference_calls == T
        results.append((loss.detach(), grads(model).clone()))
    zero_grads(model)
    eager = with_no_grad_block(*args)
    eager.backward()
    for loss, grad in results:
        torch.testing.assert_close(loss, eager.detach(), rtol=0, atol=0)
        assert rel_err(grad, grads(model)) < 1e-12


def test_on_unsupported_exact_falls_back_with_warning():
    model = CurvedField(3, seed=2)
    zs, ts, gs = inputs(6)
    zero_grads(model)
    eager = tensor_control_flow(model, zs, ts, gs)
    eager.backward()
    exact = grads(model).clone()

    # capture="dynamo": under "auto" the intercept fallback would run it (tests/compiler/test_intercept.py)
    compiled = jagg_compile(tensor_control_flow, window=3, capture="dynamo", options=jaggc.Options(on_unsupported="exact"))
    zero_grads(model)
    with pytest.warns(UserWarning, match=r"running tensor_control_flow uncompiled \(exact per-step gradient\)"):
        loss = compiled(model, zs, ts, gs)
    loss.backward()
    assert torch.equal(loss.detach(), eager.detach())
    assert rel_err(grads(model), exact) < 1e-12
    assert compiled.report.path == "uncompiled"
    assert "Dynamo could not capture" in compiled.report.notes[0]
    # later calls stay uncompiled, silently
    with torch.no_grad():
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(compiled(model, zs, ts, gs), eager.detach())


def test_on_unsupported_exact_does_not_hide_input_errors():
    """Bad inputs (here: two steps of a window at the same timestep) are errors, not capture limits."""
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs()
    ts = torch.stack([ts[0], ts[1], ts[1], ts[3]])
    compiled = jagg_compile(plain_loss, window=4, options=jaggc.Options(on_unsupported="exact"))
    with pytest.raises(JaggInputError, match="steps 1 and 2 have the same timestep"):
        compiled(model, zs, ts, gs, T)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("capture", ["fx", "dynamo", "intercept"])
def test_a_loss_that_never_calls_the_dit_runs_as_written_and_says_so(capture):
    """No DiT call, but the loss trains another module: it runs as written (value and gradient of
    the undecorated loss) and warns that it runs without JAGG, naming the watched module and the fix."""
    model = AffineJacobianField(3, seed=1)
    args = (model, *inputs(), T)
    HEAD.zero_grad(set_to_none=True)
    eager = never_calls_dit(*args)
    eager.backward()
    want = HEAD.weight.grad.clone()
    HEAD.zero_grad(set_to_none=True)
    compiled = jagg_compile(never_calls_dit, window=2, capture=capture)
    with pytest.warns(UserWarning, match=r"makes no grad-enabled call of the module\(s\) jaggc watched "
                                         r"\(AffineJacobianField \(argument 'dit'\)\).*jagg_compile\(dit=model\)"):
        out = compiled(*args)
    out.backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(HEAD.weight.grad, want)
    assert all(p.grad is None for p in model.parameters())
    HEAD.zero_grad(set_to_none=True)


@pytest.mark.parametrize("loss, window, steps, capture", [
    (reference_calls, 4, 3, "dynamo"), (plain_loss, 5, 4, "fx"), (plain_loss, 5, 4, "intercept")])
def test_a_window_longer_than_the_loss_is_the_loss(loss, window, steps, capture):
    """``window`` is the largest window: 3 trained calls at window=4 are one window of 3."""
    model = AffineJacobianField(3, seed=1)
    compiled = jagg_compile(loss, window=window, capture=capture)
    args = (model, *inputs(steps), steps)
    torch.testing.assert_close(compiled(*args), loss(*args))
    assert [w.steps for w in compiled.report.windows] == [list(range(steps))]


def two_module_loss(dit, other, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        total = total + (dit(zs[k], ts[k]) * g[k]).sum() + (other(zs[k], ts[k]) * g[k]).sum()
    return total + (dit(zs[0], ts[0]) * g[0]).sum()


def test_two_trained_module_arguments_need_dit():
    """The loss calls two module arguments with grad: jaggc refuses to guess which is the DiT, and
    with dit= it rewrites only that module's calls."""
    a, b = AffineJacobianField(3, seed=1), AffineJacobianField(3, seed=2)
    zs, ts, gs = inputs()
    with pytest.raises(JaggGraphError, match=r"calls 2 module arguments with grad .*jagg_compile\(fn, dit=model\)"):
        jagg_compile(two_module_loss, window=2, capture="dynamo")(a, b, zs, ts, gs)
    assert all(p.grad is None for p in a.parameters())
    compiled = jagg_compile(two_module_loss, dit=a, window=2, capture="dynamo")
    compiled(a, b, zs, ts, gs).backward()
    assert compiled.report.backward_before == T + 1


def skip_one_dependent_loss(dit, zs, ts, g):
    """Step 2 takes step 0's output (step 1 is independent): the refusal names 0 -> 2."""
    outs = []
    total = 0.0
    for k in range(zs.shape[0]):
        x = zs[k] if k != 2 else zs[k] + 0.1 * outs[0]
        v = dit(x, ts[k])
        outs.append(v)
        total = total + (v * g[k]).sum()
    return total


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_dependence_across_an_independent_step_names_both_steps(capture):
    field = AffineJacobianField(3, seed=1)
    zs = torch.randn(4, 2, 3, dtype=torch.float64)
    ts = torch.linspace(1.0, 0.2, 4, dtype=torch.float64)[:, None].expand(4, 2).contiguous()
    g = torch.randn(4, 2, 3, dtype=torch.float64)
    with pytest.raises(JaggGraphError, match=r"step 2 \(node .*depends on the output of step 0"):
        jagg_compile(skip_one_dependent_loss, window=4, capture=capture)(field, zs, ts, g)


def loss_over_steps(dit, zs, ts, g, steps):
    total = 0.0
    for k in steps:
        total = total + (dit(zs[k], ts[k]) * g[k]).sum()
    return total


def test_recompile_limit_names_the_changing_value():
    """Dynamo recompiles for every new list of step indices; its limit error names the list."""
    import itertools

    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs(10)
    compiled = jagg_compile(loss_over_steps, window=2, capture="dynamo")
    with pytest.raises(JaggCaptureError, match=r"each new value of `steps\[\d\]` \(last failed guard: "
                                               r"steps\[\d\] == \d\).*capture='fx'"):
        for steps in itertools.islice(itertools.combinations(range(10), 4), 20):
            compiled(model, zs, ts, gs, list(steps))


def test_new_step_lists_under_auto_trace_once_each_and_never_fail():
    model = AffineJacobianField(3, seed=1)
    zs, ts, gs = inputs(10)
    compiled = jagg_compile(loss_over_steps, window=2)
    for i in range(12):
        steps = sorted(torch.randperm(10, generator=torch.Generator().manual_seed(i))[:4].tolist())
        torch.testing.assert_close(compiled(model, zs, ts, gs, steps), loss_over_steps(model, zs, ts, gs, steps))
    assert compiled.report.path == "fx" and compiled.traces <= 12


def test_final_refusal_under_auto_is_a_graph_error_with_no_forward_run():
    """A DiT input computed from an earlier DiT output is refused whatever captures the loss: auto
    raises JaggGraphError (catchable as such) from its first path, without trying the intercept
    path (which would run real DiT forwards first)."""
    model = AffineJacobianField(3, seed=1)
    compiled = jagg_compile(chained_states, window=2)
    with count_dit_passes(model) as counts, pytest.raises(JaggGraphError, match=r"step 1 .* depends on the "
                                                                                r"output of step 0"):
        compiled(model, *inputs(), T)
    assert counts.grad_forwards + counts.nograd_forwards == 0 and compiled.capture_failures == []


def two_call_cfg(dit, zs, ts, g, n: int):
    total = 0.0
    for k in range(n):
        uncond = dit(zs[k] * 0.0, ts[k])          # classifier-free guidance, two calls per step
        cond = dit(zs[k], ts[k])
        total = total + ((uncond + 4.5 * (cond - uncond)) * g[k]).sum()
    return total


def test_two_call_cfg_is_refused_naming_cfg():
    model = AffineJacobianField(3, seed=1)
    with pytest.raises(JaggInputError, match=r"steps 0 and 1 have the same timestep.*classifier-free guidance "
                                             r"with separate uncond and cond calls.*\[uncond; cond\]"):
        jagg_compile(two_call_cfg, window=4)(model, *inputs(), T)
