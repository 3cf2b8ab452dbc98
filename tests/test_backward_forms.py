"""Issue 36 C: every backward mode honours the backward forms trainers use, on every capture path.

``loss.backward(inputs=[...])`` accumulates into the ``.grad`` of exactly those tensors;
``torch.autograd.grad(loss, params)`` returns the gradient and writes no ``.grad``. W=4 on an
affine-Jacobian field with each window's states on its chord (JAGG exact), float64: every form
equals the undecorated loss's. The per-window mode used to lose the gradient in both (its knots'
backward ran as a nested backward that neither form reaches).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from jaggc import JaggUnsupportedError, jagg_compile
from jaggc.verify.fields import AffineJacobianField
from test_module_state_anywhere import D, chord_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

PATHS = ("auto", "fx", "dynamo", "intercept")
MODES = ("joint", "per_window", "lowmem")


def steps_loss(dit, zs, ts, gs):
    total = 0
    for k in range(zs.shape[0]):
        total = total + (dit(zs[k], ts[k]) * gs[k]).sum()
    return total


def _clear(dit):
    for p in dit.parameters():
        p.grad = None


def plain(loss, dit):
    loss.backward()
    return {n: p.grad for n, p in dit.named_parameters()}


def inputs_all(loss, dit):
    loss.backward(inputs=list(dit.parameters()))
    return {n: p.grad for n, p in dit.named_parameters()}


def inputs_some(loss, dit):
    """Only A and u: the others' .grad must stay None."""
    loss.backward(inputs=[dit.A, dit.u])
    return {n: p.grad for n, p in dit.named_parameters()}


def autograd_grad(loss, dit):
    names = [n for n, _ in dit.named_parameters()]
    got = torch.autograd.grad(loss, list(dit.parameters()))
    assert all(p.grad is None for p in dit.parameters()), "autograd.grad wrote .grad"
    return dict(zip(names, got))


def autograd_grad_some(loss, dit):
    got = torch.autograd.grad(loss, [dit.B, dit.w], allow_unused=True)
    assert all(p.grad is None for p in dit.parameters()), "autograd.grad wrote .grad"
    return {"B": got[0], "w": got[1], "A": None, "u": None}


FORMS = (plain, inputs_all, inputs_some, autograd_grad, autograd_grad_some)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("backward", MODES)
@pytest.mark.parametrize("capture", PATHS)
def test_C_backward_forms(capture, backward, form):
    dit = AffineJacobianField(D, seed=5)
    args = chord_inputs(4, window=4)
    _clear(dit)
    want = form(steps_loss(dit, *args), dit)
    want = {n: (g.clone() if g is not None else None) for n, g in want.items()}
    _clear(dit)
    compiled = jagg_compile(steps_loss, window=4, weights="t", backward=backward, capture=capture)
    for call in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                loss = compiled(dit, *args)
            except JaggUnsupportedError as e:
                assert capture == "intercept" and backward == "lowmem", e
                return
        got = form(loss, dit)
        for name, g in want.items():
            if g is None:
                assert got[name] is None, f"{capture}/{backward}/{form.__name__}: {name} got a gradient"
            else:
                assert got[name] is not None, f"{capture}/{backward}/{form.__name__}: no gradient of {name}"
                torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-14,
                                           msg=f"{capture}/{backward}/{form.__name__}, call {call}: {name}")
        _clear(dit)
