"""Issue 36 C: every backward mode honours the backward forms trainers use, on every capture path
(per-window under DDP/FSDP: refused, naming the mode).

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


def eager_gradients(form, dit, args) -> dict:
    """What ``form`` gives for the undecorated loss, by parameter name; ``.grad`` cleared after."""
    _clear(dit)
    want = form(steps_loss(dit, *args), dit)
    want = {n: (g.clone() if g is not None else None) for n, g in want.items()}
    _clear(dit)
    return want


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("backward", MODES)
@pytest.mark.parametrize("capture", PATHS)
def test_C_backward_forms(capture, backward, form):
    dit = AffineJacobianField(D, seed=5)
    args = chord_inputs(4, window=4)
    want = eager_gradients(form, dit, args)
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


@pytest.mark.parametrize("form", [inputs_some, autograd_grad], ids=lambda f: f.__name__)
@pytest.mark.parametrize("capture", ["fx", "intercept"])
def test_C_per_window_with_one_forward_per_knot(capture, form):
    """``batch_knots=False``: each knot's re-run is its own backward; their gradients add up."""
    import jaggc

    dit = AffineJacobianField(D, seed=6)
    args = chord_inputs(5, window=4)
    want = eager_gradients(form, dit, args)
    compiled = jagg_compile(steps_loss, window=4, weights="t", backward="per_window", capture=capture,
                            options=jaggc.Options(batch_knots=False))
    got = form(compiled(dit, *args), dit)
    for name, g in want.items():
        assert (got[name] is None) == (g is None), name
        if g is not None:
            torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-14)


def test_C_per_window_refuses_a_second_backward_naming_the_mode():
    dit = AffineJacobianField(D, seed=7)
    args = chord_inputs(6, window=4)
    loss = jagg_compile(steps_loss, window=4, weights="t", backward="per_window", capture="fx")(dit, *args)
    torch.autograd.grad(loss, list(dit.parameters()), retain_graph=True)
    with pytest.raises(JaggUnsupportedError, match="per-window-mode .* backpropagated twice"):
        torch.autograd.grad(loss, list(dit.parameters()))


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (torch's DDP needs one): the per-window mode's
    DDP refusal is reached without starting ranks (tests/runtime/test_ddp.py runs the plain backward
    under real DDP on two)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("form", [inputs_all, autograd_grad], ids=lambda f: f.__name__)
def test_C_per_window_under_ddp_refuses_the_forms_that_bypass_its_reduction(form, one_rank_group):
    dit = torch.nn.parallel.DistributedDataParallel(AffineJacobianField(D, seed=8))
    args = chord_inputs(7, window=4)
    loss = jagg_compile(steps_loss, dit=dit, window=4, weights="t", backward="per_window", capture="fx")(dit, *args)
    with pytest.raises(JaggUnsupportedError, match=r"backward='per_window' under DDP .* use backward='joint'"):
        form(loss, dit.module)
