"""Classifier-free guidance in training (passes/split_batch.py, the stream rule of passes/windows.py).

  * one call on ``[uncond; cond]``, output ``.chunk(2)``, uncond half detached (Flow-GRPO): the call
    is split, the uncond chunk runs without grad, the cond chunk in the windows; the gradient equals
    the unsplit one (float32 1e-6, float64 1e-12) in the joint, per-window and low-memory modes,
    through FX and Dynamo, with routing and with the rollout cache; the DiT backward runs on B
    samples per step instead of 2B; golden text of the split;
  * a chunk used without grad elsewhere in the loss (a diagnostic under no_grad) is split too; a
    chunk that carries gradient anywhere is not;
  * chunks with gradient stay one trained call (a step keeps one); the split as a hypothesis
    property (verify/cfg_properties.py);
  * two calls per step (uncond, then cond), with and without grad on the uncond call: windows per
    stream, equal to a per-stream reference JAGG at W=2 and W=4.
"""

from __future__ import annotations

import pytest
import torch

import jaggc
from helpers import loss_and_grad, reference_jagg, rel_err
from jaggc_studies import example_losses
from jaggc import jagg_compile
from jaggc.runtime import count_dit_passes
from jaggc.verify.fields import AffineJacobianField

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def cfg64():
    ex = example_losses.build_example("cfg_sd3", num_steps=8, batch=2, seed=0)
    ex.model.double()
    ex.batch = {k: v.double() for k, v in ex.batch.items()}
    return ex


@pytest.mark.parametrize("backward", ["joint", "per_window", "lowmem"])
@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_split_equals_unsplit_float64(cfg64, backward, capture):
    ex = cfg64
    split = jagg_compile(ex.loss_fn, window=4, capture=capture, backward=backward)
    unsplit = jagg_compile(ex.loss_fn, window=4, capture=capture, backward=backward, options=jaggc.Options(split_batches=False))
    loss, grad = loss_and_grad(split, (ex.model, ex.batch), ex.model)
    ref_loss, ref = loss_and_grad(unsplit, (ex.model, ex.batch), ex.model)
    assert len(split.report.splits) == 8 and not unsplit.report.splits
    assert rel_err(grad, ref) < 1e-12
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)


def test_split_float32_backward_on_half_the_batch():
    ex = example_losses.build_example("cfg_sd3", num_steps=8, batch=2, seed=0)
    split = jagg_compile(ex.loss_fn, window=4, weights="t")
    unsplit = jagg_compile(ex.loss_fn, window=4, weights="t", options=jaggc.Options(split_batches=False))
    split(ex.model, ex.batch), unsplit(ex.model, ex.batch)                 # traces
    counts = {}
    grads = {}
    for name, fn in (("split", split), ("unsplit", unsplit)):
        with count_dit_passes(ex.model) as c:
            _, grads[name] = loss_and_grad(fn, (ex.model, ex.batch), ex.model)
        counts[name] = c
    assert rel_err(grads["split"], grads["unsplit"]) < 1e-6
    # knots of 2 steps x B = 4 samples per window instead of 2 x 2B = 8; the uncond halves no-grad
    assert counts["split"].backward_batches == [4, 4] and counts["unsplit"].backward_batches == [8, 8]
    assert counts["split"].backward_samples == counts["unsplit"].backward_samples // 2
    assert "chunks [0] of 2 run without grad" in split.report.splits[0]


def test_split_with_routing_and_the_rollout_cache():
    ex = example_losses.build_example("cfg_sd3", num_steps=8, batch=2, seed=0)
    _, ref = loss_and_grad(jagg_compile(ex.loss_fn, window=4, weights="t", options=jaggc.Options(split_batches=False), routing=jaggc.Routing(jagg_frac=0.5)),
                           (ex.model, ex.batch), ex.model)
    _, got = loss_and_grad(jagg_compile(ex.loss_fn, window=4, weights="t", routing=jaggc.Routing(jagg_frac=0.5)), (ex.model, ex.batch), ex.model)
    assert rel_err(got, ref) < 1e-6
    cache = jaggc.RolloutCache(ex.model)
    with torch.no_grad(), cache.record():
        ex.loss_fn(ex.model, ex.batch)                    # the rollout's [uncond; cond] calls
    fast = jagg_compile(ex.loss_fn, window=4, weights="t", options=jaggc.Options(rollout_cache=cache))
    fast(ex.model, ex.batch)
    with count_dit_passes(ex.model) as counts:
        _, got = loss_and_grad(fast, (ex.model, ex.batch), ex.model)
    # the uncond halves and the interior cond halves all come from the rollout
    assert counts.nograd_forwards == 0 and counts.grad_forward_batches == [4, 4]
    _, plain = loss_and_grad(jagg_compile(ex.loss_fn, window=4, weights="t"), (ex.model, ex.batch), ex.model)
    assert rel_err(got, plain) < 1e-6


def test_split_golden():
    """The first step's call on [uncond; cond] becomes a no-grad call on chunk 0 of every batched
    input (between grad-mode switches) and a call with grad on chunk 1; the detach reads chunk 0."""
    ex = example_losses.build_example("cfg_sd3", num_steps=2, batch=2, seed=0)
    compiled = jagg_compile(ex.loss_fn, window=2, capture="fx")
    compiled(ex.model, ex.batch)
    code = [line.split(";")[0].strip() for line in compiled.report.stage("split_cfg_batches").splitlines()]
    start = code.index("_set_grad_enabled = torch._C._set_grad_enabled(False)")
    assert code[start:start + 16] == [
        "_set_grad_enabled = torch._C._set_grad_enabled(False)",
        "batch_chunk = jaggc_graph_ops_batch_chunk(cat_2, cat_2, 2, 0)",
        "batch_chunk_1 = jaggc_graph_ops_batch_chunk(cat_3, cat_2, 2, 0)",
        "batch_chunk_2 = jaggc_graph_ops_batch_chunk(cat, cat_2, 2, 0)",
        "batch_chunk_3 = jaggc_graph_ops_batch_chunk(cat_1, cat_2, 2, 0)",
        "dit_call_2 = jaggc_graph_ops_dit_call(jagg_dit, (), {'hidden_states': batch_chunk, 'timestep': batch_chunk_1, "
        "'encoder_hidden_states': batch_chunk_2, 'pooled_projections': batch_chunk_3, 'return_dict': False})",
        "getitem_20 = dit_call_2[0]",
        "_set_grad_enabled_1 = torch._C._set_grad_enabled(True)",
        "batch_chunk_4 = jaggc_graph_ops_batch_chunk(cat_2, cat_2, 2, 1)",
        "batch_chunk_5 = jaggc_graph_ops_batch_chunk(cat_3, cat_2, 2, 1)",
        "batch_chunk_6 = jaggc_graph_ops_batch_chunk(cat, cat_2, 2, 1)",
        "batch_chunk_7 = jaggc_graph_ops_batch_chunk(cat_1, cat_2, 2, 1)",
        "dit_call_3 = jaggc_graph_ops_dit_call(jagg_dit, (), {'hidden_states': batch_chunk_4, 'timestep': batch_chunk_5, "
        "'encoder_hidden_states': batch_chunk_6, 'pooled_projections': batch_chunk_7, 'return_dict': False})",
        "getitem_21 = dit_call_3[0]",
        "detach = getitem_20.detach()",
        "sub = getitem_21 - detach",
    ]
    assert not any(line.startswith("chunk = ") for line in code)   # the original call's chunk is gone


def cfg_field_loss(dit, zs, ts, g, use_uncond):
    """One call on [uncond; cond] (the uncond state scaled to stand for null conditioning)."""
    total = 0.0
    for k in range(zs.shape[0]):
        both = dit(torch.cat([0.5 * zs[k], zs[k]]), torch.cat([ts[k], ts[k]]))
        uncond, cond = both.chunk(2)
        v = uncond.detach() + 3.0 * (cond - uncond.detach())
        total = total + (v * g[k]).sum() + use_uncond(uncond)
    return total


def _field_inputs(T=8, B=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    return (torch.randn(T, B, 3, generator=gen, dtype=torch.float64), torch.stack([t, 0.9 * t], 1),
            torch.randn(T, B, 3, generator=gen, dtype=torch.float64))


def _diagnostic(uncond):
    with torch.no_grad():
        return uncond.abs().mean() * 0.0     # a logged statistic: used, without gradient


@pytest.mark.parametrize("use, split", [(lambda u: 0.0, True), (_diagnostic, True),
                                        (lambda u: 0.1 * u.sum(), False)],
                         ids=["unused", "used_under_no_grad", "carries_gradient"])
def test_what_is_split(use, split):
    model = AffineJacobianField(3, seed=1)
    args = (model, *_field_inputs(), use)
    _, exact = loss_and_grad(cfg_field_loss, args, model)
    compiled = jagg_compile(cfg_field_loss, window=2)
    _, got = loss_and_grad(compiled, args, model)
    assert bool(compiled.report.splits) == split
    assert rel_err(got, exact) < 1e-12


class CondField(torch.nn.Module):
    """An affine-Jacobian field with a conditioning input (as a DiT's text embedding)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.inner = AffineJacobianField(3, seed=seed)
        self.c = torch.nn.Parameter(torch.full((3,), 0.3, dtype=torch.float64))

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        return self.inner(hidden_states, timestep) + torch.tanh(self.c) * encoder_hidden_states


def two_call_cfg(dit, zs, ts, g, uncond_grad):
    """Two calls per step on the same state and timestep: null conditioning, then the prompt's."""
    total = 0.0
    null, prompt = torch.zeros_like(zs[0]), torch.ones_like(zs[0])
    for k in range(zs.shape[0]):
        z, t = zs[k], ts[k]
        with torch.set_grad_enabled(uncond_grad):
            uncond = dit(z, t, null)
        cond = dit(z, t, prompt)
        total = total + ((uncond + 3.0 * (cond - uncond)) * g[k]).sum()
    return total


@pytest.mark.parametrize("uncond_grad", [True, False])
@pytest.mark.parametrize("window", [2, 4])
@pytest.mark.parametrize("capture", ["fx", "dynamo", "intercept"])
def test_two_call_cfg_windows_per_stream(uncond_grad, window, capture):
    """Every capture path cuts windows by the one grouping rule (the intercept path used to mix
    the uncond and cond calls of consecutive steps in one window)."""
    model = CondField(seed=2)
    args = (model, *_field_inputs(seed=1), uncond_grad)
    compiled = jagg_compile(two_call_cfg, window=window, weights="t", capture=capture)
    loss, got = loss_and_grad(compiled, args, model)
    ref_loss, ref = reference_jagg(two_call_cfg, args, model, window, time_arg=1, streams=2 if uncond_grad else 1)
    assert compiled.report.path == capture
    assert rel_err(got, ref) < 1e-12
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    steps = [w.steps for w in compiled.report.windows]
    if uncond_grad:     # stream 0 (uncond) = even steps, stream 1 (cond) = odd steps
        assert all(len({s % 2 for s in w}) == 1 for w in steps)
        assert any("one window per stream" in n for n in compiled.report.notes)
    if window == 2:
        _, exact = loss_and_grad(two_call_cfg, args, model)
        assert rel_err(got, exact) < 1e-12


def test_two_call_cfg_eager_drivers_share_the_windows():
    """jagg_calls on the recorded calls and the fidelity estimators (runtime_gradient, the basis
    estimate of plain JAGG) cut the interleaved calls into the same per-stream windows."""
    from jaggc.fidelity import estimators as E
    from jaggc.runtime import jagg_calls

    model = CondField(seed=2)
    zs, ts, g = _field_inputs(seed=1)
    args = (model, zs, ts, g, True)
    _, ref = reference_jagg(two_call_cfg, args, model, 4, time_arg=1, streams=2)
    rec = E.record(lambda dit, b: two_call_cfg(dit, *b, True), model, (zs, ts, g), time_arg=1)
    assert E.windows_of(rec, 4) == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    params = [p for p in model.parameters()]
    outs = jagg_calls(model, rec.calls, window=4, options=jaggc.runtime.WindowOptions(weights="t", time_arg=1))
    for out, recorded in zip(outs, rec.outputs):          # values exact, in call order
        torch.testing.assert_close(out.detach(), recorded, rtol=1e-12, atol=1e-14)
    driven = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, rec.upstream)), params)
    assert rel_err(torch.cat([x.reshape(-1) for x in driven]), ref) < 1e-12
    assert rel_err(E.jagg(rec, model, window=4).grad, ref) < 1e-12
    assert rel_err(E.runtime_gradient(lambda dit, b: two_call_cfg(dit, *b, True), model, (zs, ts, g), window=4), ref) < 1e-12


def three_way_loss(dit, zs, ts, g):
    """One call on three variants; two carry gradient, the middle one is detached."""
    total = 0.0
    for k in range(zs.shape[0]):
        out = dit(torch.cat([zs[k], 0.5 * zs[k], 2.0 * zs[k]]), torch.cat([ts[k]] * 3))
        a, b, c = out.chunk(3)
        total = total + ((a + 0.3 * b.detach() + 2.0 * c) * g[k]).sum()
    return total


def test_chunks_with_gradient_stay_one_trained_call():
    model = AffineJacobianField(3, seed=3)
    args = (model, *_field_inputs(seed=2))
    _, exact = loss_and_grad(three_way_loss, args, model)
    compiled = jagg_compile(three_way_loss, window=2)
    _, got = loss_and_grad(compiled, args, model)
    assert len(compiled.report.splits) == 8
    assert all("chunks [1] of 3 run without grad" in s for s in compiled.report.splits)
    # one trained call per step (chunks 0 and 2 together), so the windows see 8 steps, not 16
    assert sorted(s for w in compiled.report.windows for s in w.steps) == list(range(8))
    assert compiled.report.reference_calls == 8
    assert rel_err(got, exact) < 1e-12


def test_cfg_split_identity_property():
    from jaggc.verify.cfg_properties import cfg_split_identity

    result = cfg_split_identity(6, seed=3)
    assert result.passed, result.counterexample
    assert result.max_rel_err < 1e-12
