"""A new capture path is one module plus one registry line (frontends/registry.py): registered, it
is a value of ``jagg_compile(capture=...)``, ``capture="auto"`` tries it in registration order, and
a fallback to it is announced with its cost note. The toy frontends below are the "module"; each
test's ``register`` call is the "line" (on a copy of the registry, so other tests see the real one)."""

from __future__ import annotations

import pytest
import torch

import jaggc
from jaggc import options
from jaggc.errors import JaggCaptureError, JaggInputError
from jaggc.frontends import registry
from helpers import LinearDiT as Tiny


def loss(dit, x):
    return dit(x, 0.5).pow(2).sum()


class ToyFrontend:
    """Runs the loss as written and says so in the report: the smallest frontend the contract allows."""

    name = "toy"
    runs: list[str] = []

    def __init__(self, session, qualname):
        self.session = session
        self.qualname = qualname

    def reset(self) -> None:
        pass

    def run(self, args, kwargs):
        ToyFrontend.runs.append(self.qualname)
        self.session.candidates(args, kwargs)       # the session's view of the DiT, as a real frontend asks
        self.session.show(self.session.empty_report(self.name, "toy frontend: ran as written"))
        return self.session.fn(*args, **kwargs)


class RefusingToy(ToyFrontend):
    name = "refusing_toy"

    def run(self, args, kwargs):
        ToyFrontend.runs.append("refused")
        raise JaggCaptureError("the refusing toy takes no loss", path=self.name)


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(registry, "FRONTENDS", dict(registry.FRONTENDS))
    ToyFrontend.runs = []
    return registry


def test_a_registered_frontend_is_a_capture_choice_and_runs(fresh_registry):
    fresh_registry.register("toy", ToyFrontend)
    assert "toy" in options.CAPTURES and fresh_registry.capture_choices()[-1] == "toy"
    model, x = Tiny(), torch.randn(3, 2)
    compiled = jaggc.jagg_compile(loss, capture="toy")
    with pytest.warns(UserWarning, match="without JAGG"):    # the toy's report trains nothing: said
        out = compiled(model, x)
    assert ToyFrontend.runs == [compiled.__qualname__]
    assert compiled.report.path == "toy" and torch.equal(out, loss(model, x))


def test_an_unregistered_capture_is_refused_with_the_registered_ones(fresh_registry):
    with pytest.raises(JaggInputError, match="use one of .*'intercept'") as info:
        jaggc.jagg_compile(loss, capture="toy")
    assert "'toy'" not in str(info.value).split("use one of")[1]
    fresh_registry.register("toy", ToyFrontend)
    jaggc.jagg_compile(loss, capture="toy")                 # one line later, it is a choice


def test_auto_tries_the_paths_in_registration_order_and_announces_the_cost(fresh_registry, monkeypatch):
    monkeypatch.setattr(registry, "FRONTENDS", {})
    fresh_registry.register("refusing_toy", RefusingToy)
    fresh_registry.register("toy", ToyFrontend, fallback_cost="no JAGG at all, a toy")
    assert fresh_registry.auto_order() == ("refusing_toy", "toy")
    model, x = Tiny(), torch.randn(3, 2)
    compiled = jaggc.jagg_compile(loss)                     # capture="auto"
    with pytest.warns(UserWarning, match=r"capture path 'toy' \(no JAGG at all, a toy\)"):
        compiled(model, x)
    assert ToyFrontend.runs[0] == "refused" and compiled.report.path == "toy"
    assert compiled.capture_failures == ["refusing_toy: the refusing toy takes no loss"]
    ToyFrontend.runs.clear()
    compiled(model, x)                                      # auto stays on the path that took the loss
    assert ToyFrontend.runs == [compiled.__qualname__]


def test_the_real_registry_keeps_the_documented_auto_order():
    assert registry.auto_order() == ("fx", "dynamo", "intercept")
    assert options.CAPTURES == ("auto", "fx", "dynamo", "intercept")
    assert "5x slower" in registry.FRONTENDS["dynamo"].fallback_cost


def test_the_compiled_loss_exposes_its_call_report_and_documented_counters_only():
    """Nothing of the compile session (rewrite, show, candidates, frontends, ...) is public on the
    user's object: its call, ``.report``, ``__wrapped__`` and the read-only counters its docstring
    names (docs/api.md)."""
    compiled = jaggc.jagg_compile(loss)
    public = {name for name in dir(compiled) if not name.startswith("_")}
    assert public == {"report", "traces", "capture_failures", "config"}, public
    assert compiled.__wrapped__ is loss and callable(compiled)
    for name in ("traces", "capture_failures", "config"):
        assert name in type(compiled).__doc__
        with pytest.raises(AttributeError):
            setattr(compiled, name, None)
