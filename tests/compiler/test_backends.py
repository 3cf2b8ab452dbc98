"""backend='aot_eager' / 'inductor': the rewritten graph is split at jaggc's runtime nodes, the glue
segments are compiled by the backend and the runtime segments run eagerly (jaggc/backends.py)."""

from __future__ import annotations

import jaggc
import pytest
import torch

from helpers import grads, rel_err, zero_grads
from jaggc import JaggInputError, JaggUnsupportedError, jagg_compile
from jaggc.backends import LazyCompiledGlue, is_runtime_node
from jaggc.graph_ops import dit_call, flatten_output, jagg_window
from jaggc.runtime import count_dit_passes
from jaggc.verify.fields import AffineJacobianField

T, B = 6, 2


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.2, T, dtype=torch.float64)
    return dict(z=torch.randn(T, B, 3, generator=g, dtype=torch.float64), t=torch.stack([t, 0.9 * t], 1),
                target=torch.randn(T, B, 3, generator=g, dtype=torch.float64))


def grpo_like_loss(dit, batch):
    """Nonlinear glue between the calls (what a backend would fuse), a no-grad reference call."""
    total = 0.0
    for k in range(batch["z"].shape[0]):
        v = dit(batch["z"][k], batch["t"][k])
        with torch.no_grad():
            ref = dit(batch["z"][k], batch["t"][k])
        logp = -((v - batch["target"][k]) ** 2).mean(dim=tuple(range(1, v.ndim)))
        ratio = torch.exp(logp - logp.detach() + 0.01 * k)
        total = total + torch.maximum(-ratio, -torch.clamp(ratio, 0.9, 1.1)).mean() + 1e-3 * (v - ref).pow(2).sum()
    return total


def run(model, fn, batch):
    zero_grads(model)
    with count_dit_passes(model) as counts:
        loss = fn(model, batch)
        loss.backward()
    return loss.detach(), grads(model).clone(), counts


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_backend_compiles_glue_with_the_eager_gradient(backend):
    model = AffineJacobianField(3, seed=1)
    batch = inputs()
    eager_fn = jagg_compile(grpo_like_loss, window=3, capture="dynamo")
    eager_loss, eager, _ = run(model, eager_fn, batch)
    compiled = jagg_compile(grpo_like_loss, window=3, options=jaggc.Options(backend=backend))
    run(model, compiled, batch)  # capture and compile
    loss, got, counts = run(model, compiled, batch)
    assert eager.norm() > 0
    assert rel_err(got, eager) < 1e-10
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=1e-12)
    assert counts.backwards == 2  # still one joint DiT backward per window
    assert compiled.traces == 1
    assert any(f"backend={backend!r}" in n for n in compiled.report.notes)


def test_no_runtime_node_is_handed_to_the_backend():
    model = AffineJacobianField(3, seed=1)
    compiled = jagg_compile(grpo_like_loss, window=3, options=jaggc.Options(backend="aot_eager"))
    run(model, compiled, inputs())
    split = compiled._session.dynamo_split  # the split graph the backend saw
    glue = [m for m in split.children() if isinstance(m, LazyCompiledGlue)]
    runtime = [m for m in split.children() if not isinstance(m, LazyCompiledGlue)]
    assert glue and runtime
    for m in glue:
        assert m.compiled is not None
        assert not any(is_runtime_node(n) for n in m.segment.graph.nodes)
    targets = {n.target for m in runtime for n in m.graph.nodes if n.op == "call_function"}
    assert jagg_window in targets and dit_call in targets and flatten_output in targets


def test_bad_backend_options_are_refused():
    with pytest.raises(JaggInputError, match=r"backend='tvm'\): use None .* or one of \('aot_eager', 'inductor'\)"):
        jagg_compile(grpo_like_loss, options=jaggc.Options(backend="tvm"))
    with pytest.raises(JaggUnsupportedError, match=r"capture='fx' has no such graph"):
        jagg_compile(grpo_like_loss, capture="fx", options=jaggc.Options(backend="aot_eager"))


def test_routed_windows_with_a_backend():
    """Routing puts every routed window in one jagg_trajectory node; the backend splitter and
    cleanup read the same table of runtime targets (graph_ops.RUNTIME_TARGETS), so the node stays
    eager instead of reaching the glue ("non-tensor values (['TrajectoryPlan'])", once)."""
    model = AffineJacobianField(3, seed=1)
    batch = inputs()
    eager_fn = jagg_compile(grpo_like_loss, window=3, capture="dynamo", routing=jaggc.Routing(jagg_frac=0.5))
    eager_loss, eager, _ = run(model, eager_fn, batch)
    compiled = jagg_compile(grpo_like_loss, window=3, options=jaggc.Options(backend="aot_eager"), routing=jaggc.Routing(jagg_frac=0.5))
    loss, got, counts = run(model, compiled, batch)
    assert [w.mode.split(":")[0] for w in compiled.report.windows] == ["routed", "routed"]
    assert rel_err(got, eager) < 1e-10
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=1e-12)
