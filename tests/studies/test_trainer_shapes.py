"""Losses in the trainers' own shapes (``jaggc_studies.trainer_shapes``) on the default ``capture="auto"``.

For Flow-GRPO (scheduler step lookup, CFG, KL under peft's ``disable_adapter()``), DanceGRPO
(``flux_step`` with ``math.sqrt`` of a schedule tensor, ``train()`` in the step, a random subset of
steps per sample), MixGRPO (a moving 4-step window, Flow-GRPO's SDE step on a schedule tensor), the
JAGG author's Qwen-Image loss and a loss built from ``jaggc.grpo``, each in two forms: as it runs on
this CPU (the trainers' ``torch.autocast("cuda", ...)`` blocks off) and in its GPU form (those blocks
live bf16 blocks, ``jaggc_studies.trainer_check.trainer_form("gpu")``):

  * a graph path is taken (not the intercept fallback), with no fallback warning;
  * the loss value equals the undecorated loss's;
  * at W=2 the gradient equals the exact one (under the same autocast); at W=4 it equals a reference
    JAGG computed by hand under the same autocast (``helpers.reference_jagg``: upstream gradients
    from autograd, knots through the eager graph); in the GPU form within the batch-size roundoff
    of bf16, and the GPU form's numbers are not the CPU form's (the blocks are live);
  * DanceGRPO: 50 distinct subsets through one compiled loss, one trace for all of them;
  * the author's two-backward implementation with t-weights equals the reference JAGG, and with
    index weights equals ``@jagg_compile(weights="index")``;
  * the KL loss's result is the same through every capture path, intercept included (it used to
    serve the adapter-off reference output as the policy's velocity).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import loss_and_grad, reference_jagg, rel_err
from jaggc import jagg_compile
from jaggc_studies import trainer_shapes
from jaggc.runtime.module_state import module_state, set_state
from jaggc_studies.trainer_check import trainer_form

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

TOL = 1e-4      # fp32: batched knot forwards differ from per-step ones by roundoff
BF16_TOL = {2: 1e-3, 4: 5e-3}   # bf16: per-step calls (W=2) are exact; a batched knot forward rounds once
NO_BLOCK = {"jaggc_helpers_sd3"}  # written without an autocast block: its GPU form is its CPU form


@pytest.fixture(scope="module")
def shapes():
    built = {}

    def get(name, form="cpu"):
        if (name, form) not in built:
            with trainer_form(form):
                built[name, form] = trainer_shapes.SHAPES[name]()
        return built[name, form]
    return get


def _scale(loss_fn, args):
    """A loss value tolerance: these losses are sums of +-A*ratio terms that nearly cancel."""
    return 1e-5 * max(1.0, float(abs(loss_fn(*args).detach())))


@pytest.mark.parametrize("form", ["cpu", "gpu"])
@pytest.mark.parametrize("name", list(trainer_shapes.SHAPES))
def test_graph_path_exact_at_w2_and_reference_jagg_at_w4(shapes, name, form):
    shape = shapes(name, form)
    entry = module_state(shape.model)
    with trainer_form(form):
        set_state(shape.model, entry)
        exact_loss, exact_grad = loss_and_grad(shape.loss_fn, shape.args, shape.model)
        assert exact_grad.norm() > 0
        for window in (2, 4):
            compiled = jagg_compile(shape.loss_fn, dit=shape.model, window=window)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)      # no fallback warning
                warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
                warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight.*")
                set_state(shape.model, entry)
                loss, grad = loss_and_grad(compiled, shape.args, shape.model)
            assert compiled.report.path == "fx", compiled.report
            assert abs(float(loss - exact_loss)) <= _scale(shape.loss_fn, shape.args)
            autocast = {w.autocast for w in compiled.report.windows}
            live = form == "gpu" and name not in NO_BLOCK
            assert autocast == ({"cpu bfloat16"} if live else {"off"}), autocast
            tol = BF16_TOL[window] if live else TOL
            if window == 2:
                assert rel_err(grad, exact_grad) < tol, rel_err(grad, exact_grad)
            else:
                assert any(w.mode == "jagg" for w in compiled.report.windows)
                # the default weights: plain JAGG, windows reaching σ < 0.5 exact
                set_state(shape.model, entry)
                ref_loss, ref_grad = reference_jagg(shape.loss_fn, shape.args, shape.model, window, exact_below=0.5)
                assert rel_err(grad, ref_grad) < tol, rel_err(grad, ref_grad)
                # and JAGG is an approximation here, not the exact gradient by accident
                assert rel_err(grad, exact_grad) > (3 if live else 10) * tol
    if form == "gpu" and name not in NO_BLOCK:
        # the blocks were live: the GPU form's gradient is not the CPU form's
        cpu = shapes(name, "cpu")
        with trainer_form("cpu"):
            set_state(cpu.model, module_state(cpu.model))
            _, cpu_grad = loss_and_grad(cpu.loss_fn, cpu.args, cpu.model)
        assert rel_err(exact_grad, cpu_grad) > 1e-3


def test_kl_reference_under_disable_adapter_is_right_on_every_path(shapes):
    """The silently wrong case: the intercept path used to hand the policy the adapter-off output."""
    shape = shapes("flow_grpo_sd3")
    assert shape.args[-1].beta > 0
    ref_loss, ref_grad = reference_jagg(shape.loss_fn, shape.args, shape.model, 4, exact_below=0.5)
    for capture in ("fx", "intercept"):
        compiled = jagg_compile(shape.loss_fn, dit=shape.model, window=4, capture=capture)
        loss, grad = loss_and_grad(compiled, shape.args, shape.model)
        assert compiled.report.path == capture
        # fx: 8 KL reference calls + 8 unconditional CFG halves split off the trained calls
        assert compiled.report.reference_calls == (16 if capture == "fx" else 0)
        assert len(compiled.report.splits) == (8 if capture == "fx" else 0)
        assert abs(float(loss - ref_loss)) <= _scale(shape.loss_fn, shape.args), capture
        assert rel_err(grad, ref_grad) < TOL, (capture, rel_err(grad, ref_grad))


def test_dance_grpo_fifty_subsets_one_compiled_loss(shapes):
    shape = shapes("dance_grpo_flux")
    transformer, sample, _, sigmas, args = shape.args
    compiled = jagg_compile(shape.loss_fn, dit=transformer, window=3)
    g = torch.Generator().manual_seed(11)
    subsets = set()
    while len(subsets) < 50:
        perm = trainer_shapes.random_subset(shape.extra["num_steps"], shape.extra["fraction"], g)
        if tuple(perm.tolist()) in subsets:
            continue
        i = len(subsets)
        subsets.add(tuple(perm.tolist()))
        call = (transformer, sample, perm, sigmas, args)
        out = compiled(*call)
        torch.testing.assert_close(out, shape.loss_fn(*call), rtol=1e-5, atol=1e-6)
        if i < 3:      # gradients too, on a few of them
            _, grad = loss_and_grad(compiled, call, transformer)
            assert rel_err(grad, reference_jagg(shape.loss_fn, call, transformer, 3)[1]) < TOL
    # one trace serves every subset: flux_step's math.sqrt/math.log are graph nodes, not constants
    # (a second trace comes from the first call's transformer.train(): the module entered in eval)
    assert compiled.traces <= 2 and compiled.report.path == "fx"


def test_author_two_backward_is_the_reference_jagg(shapes):
    shape = shapes("jagg_author_qwen")
    model = shape.model
    ref_loss, ref_grad = reference_jagg(shape.loss_fn, shape.args, model, 4)
    for weights in ("t", "index"):
        for p in model.parameters():
            p.grad = None
        loss = trainer_shapes.author_two_backward(*shape.args, window=4, weights=weights)
        author = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])
        assert abs(loss - float(ref_loss)) < 1e-5
        if weights == "t":
            assert rel_err(author, ref_grad) < TOL
        else:
            _, jaggc_index = loss_and_grad(jagg_compile(shape.loss_fn, dit=model, window=4, weights="index"),
                                           shape.args, model)
            assert rel_err(jaggc_index, author) < TOL
            assert rel_err(author, ref_grad) > 10 * TOL   # index and t weights differ on this grid
    for p in model.parameters():
        p.grad = None
