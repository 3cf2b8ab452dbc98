"""The capture runs the DiT on fake tensors once per call signature, not once per call, and traces a
tuple-output DiT call as one custom op.

Checked: a 6-step Flow-GRPO loss is captured with one fake DiT forward (it was six), its
gradient is unchanged (against the exact gradient at W=2, where JAGG is exact); the cache is keyed
on everything that decides the output (shape, dtype, grad mode) and never outlives one fake mode.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from jaggc_studies import example_losses
from jaggc import jagg_compile
from jaggc.frontends.fake_cache import cached_fake_call, signature

from helpers import grads, rel_err, zero_grads

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _count_fake_forwards(module):
    seen = [0]

    def pre(mod, args, kwargs):
        leaves = list(args) + list(kwargs.values())
        if any(isinstance(x, FakeTensor) for x in leaves):
            seen[0] += 1

    return seen, module.register_forward_pre_hook(pre, with_kwargs=True)


def test_capture_runs_one_fake_forward_per_signature():
    ex = example_losses.build_example("flow_grpo_sd3", num_steps=6, batch=2, seed=0)
    seen, handle = _count_fake_forwards(ex.model)
    try:
        compiled = jagg_compile(ex.loss_fn, window=2, capture="dynamo")
        zero_grads(ex.model)
        compiled(ex.model, ex.batch).backward()
    finally:
        handle.remove()
    assert compiled.report.path == "dynamo"
    assert seen[0] == 1, f"{seen[0]} fake DiT forwards for 6 identical-signature calls"
    got = grads(ex.model).clone()
    zero_grads(ex.model)
    ex.loss_fn(ex.model, ex.batch).backward()
    assert rel_err(got, grads(ex.model)) < 1e-5


class _Double(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.runs = 0

    def forward(self, x, scale=1.0, **ignored):
        self.runs += 1
        return (x[..., :3] * self.w * scale,)


def test_cache_key_follows_shape_dtype_and_grad_mode():
    m = _Double()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.zeros(2, 4))
        outs = [cached_fake_call(m, m, (x,), {})[0] for _ in range(3)]
        assert m.runs == 1
        assert all(o.shape == (2, 3) and o.requires_grad and not o.is_leaf for o in outs)
        assert outs[1] is not outs[2], "every call needs its own fake output"
        y = cached_fake_call(m, m, (mode.from_tensor(torch.zeros(5, 4)),), {})[0]
        assert m.runs == 2 and y.shape == (5, 3)
        z = cached_fake_call(m, m, (mode.from_tensor(torch.zeros(2, 4, dtype=torch.float64)),), {})[0]
        assert m.runs == 3 and z.dtype == torch.float64
        with torch.no_grad():
            n = cached_fake_call(m, m, (x,), {})[0]
        assert m.runs == 4 and not n.requires_grad
        cached_fake_call(m, m, (x,), {"scale": 2.0})
        assert m.runs == 5
    with FakeTensorMode(allow_non_fake_inputs=True) as other:
        cached_fake_call(m, m, (other.from_tensor(torch.zeros(2, 4)),), {})
    assert m.runs == 6, "a new fake mode (a new trace) must not reuse the old trace's outputs"


def test_unkeyable_calls_are_not_cached():
    m = _Double()
    assert signature(m, (torch.zeros(2, 4),), {"scale": object()}) is None
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.zeros(2, 4))
        for _ in range(2):
            cached_fake_call(m, m, (x,), {"tags": ["a", 1]})   # containers of constants are keyed
        assert m.runs == 1
        marker = object()
        for _ in range(2):
            cached_fake_call(m, lambda *a, **k: m(a[0]), (x,), {"tag": marker})
        assert m.runs == 3


@pytest.mark.parametrize("name,fast", [("flow_grpo_sd3", True), ("dance_flux", False)])
def test_tuple_output_calls_are_traced_as_one_custom_op(name, fast):
    """``return_dict=False`` calls with tensor/constant arguments go through the ``jaggc::opaque_dit``
    custom op while Dynamo traces (a call site is registered for them); a ``.sample`` output keeps the
    ``nonstrict_trace`` path. Either way the gradient is the exact one at W=2."""
    from jaggc.frontends import opaque_op

    ex = example_losses.build_example(name, num_steps=4, batch=2, seed=0)
    sites = len(opaque_op._SITES)
    compiled = jagg_compile(ex.loss_fn, window=2, capture="dynamo")
    zero_grads(ex.model)
    compiled(ex.model, ex.batch).backward()
    assert (len(opaque_op._SITES) > sites) == fast
    got = grads(ex.model).clone()
    zero_grads(ex.model)
    ex.loss_fn(ex.model, ex.batch).backward()
    assert rel_err(got, grads(ex.model)) < 1e-5


def test_the_custom_op_never_runs():
    from jaggc.errors import JaggGraphError

    with pytest.raises(JaggGraphError, match="internal error"):
        torch.ops.jaggc.opaque_dit([torch.zeros(1)], 0)
