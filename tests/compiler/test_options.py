"""jagg_compile's grouped settings (jaggc/options.py): at most eight keywords, ``Options`` and
``Routing`` for the rest, release-0.1 keywords still working for one release with a warning
that names their new place, and ``explain`` taking exactly what ``jagg_compile`` takes."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

import jaggc
from helpers import grads, zero_grads
from jaggc.options import DEPRECATED, KEYWORDS
from jaggc.verify.fields import AffineJacobianField

T, B, D = 6, 2, 3


def _loss(dit, zs, ts, gs):
    return sum((dit(zs[k], ts[k]) * gs[k]).sum() for k in range(zs.shape[0]))


def _inputs(T=T):
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    return (torch.randn(T, B, D, generator=g, dtype=torch.float64), torch.stack([t, 0.9 * t], 1),
            torch.randn(T, B, D, generator=g, dtype=torch.float64))


def test_jagg_compile_has_at_most_eight_keywords_besides_the_deprecated_ones():
    params = inspect.signature(jaggc.jagg_compile).parameters
    keywords = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) <= 8, [p.name for p in keywords]
    assert [p.name for p in keywords][:len(KEYWORDS)] == list(KEYWORDS)
    assert list(params.values())[-1].kind is inspect.Parameter.VAR_KEYWORD   # the deprecated ones
    assert set(inspect.signature(jaggc.JaggCompiled).parameters) == set(params) - {"fn"} | {"fn"}


def test_every_deprecated_keyword_names_a_field_of_its_new_home():
    fields = {"options": {f.name for f in dataclasses.fields(jaggc.Options)},
              "routing": {f.name for f in dataclasses.fields(jaggc.Routing)}}
    for name, (where, field_name) in DEPRECATED.items():
        assert field_name in fields[where], name


@pytest.mark.parametrize("old, new", [
    (dict(jagg_frac=0.5), dict(routing=jaggc.Routing(jagg_frac=0.5))),
    (dict(jagg_threshold=0.2), dict(routing=jaggc.Routing(threshold=0.2))),
    (dict(exact_below_t=0.3), dict(routing=jaggc.Routing(exact_below=0.3))),
    (dict(exact_below_t=300.0), dict(routing=jaggc.Routing(exact_below=0.3))),
    (dict(batch_knots=False, interior_chunk=1), dict(options=jaggc.Options(batch_knots=False, interior_chunk=1))),
    (dict(split_batches=False, check_inputs=False), dict(options=jaggc.Options(split_batches=False, check_inputs=False))),
    (dict(on_unsupported="exact", time_arg=1), dict(options=jaggc.Options(on_unsupported="exact", time_arg=1))),
])
def test_a_deprecated_keyword_warns_naming_its_place_and_compiles_the_same(old, new):
    with pytest.warns(DeprecationWarning) as record:
        compiled_old = jaggc.jagg_compile(_loss, window=4, weights="t", **old)
    messages = [str(w.message) for w in record]
    assert len(messages) == len(old)
    for name in old:
        where = DEPRECATED[name][0]
        assert any(f"jagg_compile({name}=...) is deprecated: pass {where}=jaggc." in m for m in messages), messages
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled_new = jaggc.jagg_compile(_loss, window=4, weights="t", **new)
    assert compiled_old.config == compiled_new.config
    assert compiled_old._on_unsupported == compiled_new._on_unsupported


def test_the_warning_points_at_the_callers_line():
    with pytest.warns(DeprecationWarning) as record:
        jaggc.jagg_compile(_loss, jagg_frac=0.5)
    assert record[0].filename == __file__


def test_a_setting_given_both_ways_is_refused():
    with pytest.raises(jaggc.JaggInputError, match=r"jagg_frac= and routing.jagg_frac"), \
            pytest.warns(DeprecationWarning):
        jaggc.jagg_compile(_loss, jagg_frac=0.5, routing=jaggc.Routing(jagg_frac=0.25))


def test_deprecated_and_new_keywords_give_the_same_loss_and_gradient_on_two_calls():
    """W=4 windows, on FX (asserted), the loss value beside the gradient, and a second call after a
    parameter step: the release-0.1 keywords and their grouped forms compile the same loss."""
    zs, ts, gs = _inputs(T=12)
    results = {}
    for form, settings in {"old": dict(jagg_frac=0.5, exact_below_t=0.3, batch_knots=False),
                           "new": dict(routing=jaggc.Routing(jagg_frac=0.5, exact_below=0.3),
                                       options=jaggc.Options(batch_knots=False))}.items():
        model = AffineJacobianField(D, seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            compiled = jaggc.jagg_compile(_loss, window=4, weights="t", **settings)
        calls = []
        for _ in range(2):
            zero_grads(model)
            loss = compiled(model, zs, ts, gs)
            loss.backward()
            calls.append((loss.detach().clone(), grads(model).clone()))
            with torch.no_grad():              # a parameter step between the calls
                for p in model.parameters():
                    p.sub_(0.05 * p.grad)
        assert compiled.report.path == "fx"
        results[form] = (calls, [r.mode for r in compiled.report.windows])
    (old_calls, old_modes), (new_calls, new_modes) = results["old"], results["new"]
    assert old_modes == new_modes and "routed:exact" in old_modes and "routed:jagg" in old_modes
    for (old_loss, old_grad), (new_loss, new_grad) in zip(old_calls, new_calls):
        assert torch.equal(old_loss, new_loss) and torch.equal(old_grad, new_grad)
    assert not torch.equal(old_calls[0][1], old_calls[1][1])      # the step changed the gradient


def test_explain_takes_the_same_settings():
    zs, ts, gs = _inputs()
    model = AffineJacobianField(D, seed=3)
    report = jaggc.explain(_loss, model, zs, ts, gs, window=3, weights="t", options=jaggc.Options(batch_knots=False),
                           routing=jaggc.Routing(jagg_frac=0.0))
    assert [r.mode for r in report.windows] == ["exact", "exact"]
    with pytest.raises(jaggc.JaggInputError, match="already compiled"):
        jaggc.explain(jaggc.jagg_compile(_loss), model, zs, ts, gs, options=jaggc.Options())
