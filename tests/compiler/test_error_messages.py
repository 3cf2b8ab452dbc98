"""Errors a newcomer can act on (issue 30): every refusal the suite's refusal catalogue provokes
(tests/compiler/test_compile_refusals.py's CASES, the runtime's input refusals) names *where* (a step, a
graph node, a file:line, an input or an option) and *what to do* (a fix, in the imperative)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import jaggc
from jaggc.runtime import DitCall, jagg_calls
from jaggc.verify.fields import AffineJacobianField
from test_compile_refusals import CASES, case_inputs, inputs

WHERE = re.compile(r"steps? \[?\d+|node \w+|option\(s\) \[|\.py:\d+|input '\w+'|argument '?\w+|option '?\w+|window \d+|"
                   r"[A-Za-z]+\(\w+=|\w+=\S+")
FIX = re.compile(r"\b(use|pass|call|move|cast|detach|return|draw|accumulate|give|keep|run|drop|compute|scale|"
                 r"check|wrap|choose|replace|remove|split|add|put|record|make|raise|train|set|lower|write)\b",
                 re.IGNORECASE)


def assert_actionable(message: str) -> None:
    assert WHERE.search(message), f"names no step, node, line, input or option:\n{message}"
    assert FIX.search(message), f"says nothing to do:\n{message}"


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_every_compile_refusal_names_where_and_a_fix(case_id):
    case = CASES[case_id]
    _, args = case_inputs(case)
    with pytest.raises(jaggc.JaggError) as info:
        jaggc.jagg_compile(case.loss, **case.options)(*args)
    assert_actionable(str(info.value))


def _calls(zs, ts):
    return [DitCall((zs[k], ts[k])) for k in range(zs.shape[0])]


def _nan_at_step_2(zs, ts):
    zs[2, 0, 0] = math.nan
    return zs, ts


RUNTIME = {
    "nan_state": _nan_at_step_2,
    "float32_state": lambda zs, ts: (zs.float(), ts),
    "non_monotone_time": lambda zs, ts: (zs, ts.flip(0)[torch.tensor([0, 2, 1, 3, 4, 5])]),
    "grad_state": lambda zs, ts: (zs.clone().requires_grad_(), ts),
}


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_every_runtime_input_refusal_names_where_and_a_fix(name):
    model = AffineJacobianField(3, seed=1)
    zs, ts, _ = inputs(6)
    zs, ts = RUNTIME[name](zs.clone(), ts.clone())
    with pytest.raises(jaggc.JaggError) as info:
        jagg_calls(model, _calls(zs, ts), window=3)
    assert_actionable(str(info.value))


@pytest.mark.parametrize("bad", [dict(window=1), dict(capture="torchscript"), dict(backward="later"),
                                 dict(options=jaggc.Options(backend="tvm")), dict(batch_size=2)])
def test_every_option_refusal_names_the_option_and_a_fix(bad):
    with pytest.raises(jaggc.JaggError) as info:
        jaggc.jagg_compile(lambda dit, x: dit(x), **bad)
    assert_actionable(str(info.value))


def test_the_check_can_fail():
    with pytest.raises(AssertionError):
        assert_actionable("something went wrong")
    with pytest.raises(AssertionError):
        assert_actionable("step 3 is bad")


def test_an_error_formats_its_own_location():
    """``where=`` prefixes the message once, in errors.py; an unknown location leaves it alone, and
    the capture error keeps its path and location as attributes."""
    from jaggc.errors import JaggCaptureError, JaggInputError, located

    located_error = JaggInputError("the state is float16", where="step 3, input x")
    assert str(located_error) == "step 3, input x: the state is float16" and located_error.where == "step 3, input x"
    assert str(JaggInputError("the state is float16")) == "the state is float16"
    err = JaggCaptureError("the loss calls F.apply", path="fx", where="loss.py:12")
    assert (str(err), err.path, err.where) == ("loss.py:12: the loss calls F.apply", "fx", "loss.py:12")
    assert str(JaggCaptureError("no path", path="dynamo")) == "no path"
    assert located("a value changed", "") == "a value changed"
    assert isinstance(JaggInputError("x", where="y"), ValueError)


def test_a_traced_refusal_is_located_once():
    """A capture refusal raised while FX traces names the user's line once (no doubled prefix)."""
    from helpers import LinearDiT

    def loss(dit, x):
        return dit.forward(x, 1.0).sum()      # through .forward: refused, located at this line

    with pytest.raises(jaggc.JaggGraphError) as info:
        jaggc.jagg_compile(loss, capture="fx")(LinearDiT(), torch.ones(1, 2))
    message = str(info.value)
    assert re.match(r"\S+test_error_messages\.py:\d+: the DiT \(LinearDiT\) is called through `\.forward", message), message
    assert message.count("test_error_messages.py:") == 1
