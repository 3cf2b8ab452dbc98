"""The FX frontend on real GRPO losses: shape, dtype and device questions answered while tracing,
and what its cache key guards.

What is checked:
  * every built-in example loss written as Flow-GRPO / DanceGRPO write it (step count from
    ``batch["timesteps"].shape[1]``, reductions over ``range(1, x.ndim)``, ``.sample`` outputs,
    CFG ``chunk(2)``, a KL reference call under ``torch.no_grad()``) captures with
    ``capture="fx"``; its loss and gradient equal the Dynamo capture's, and its window table is
    the same; the KL loss's no-grad block is recorded as grad-mode switches around each reference;
  * each question (``shape``, ``ndim``, ``size()``, ``dim()``, ``numel()``, ``len()``, ``dtype``,
    ``device``, tuple unpacking of the DiT output) gets the eager answer, checked against the
    undecorated loss on the same inputs;
  * an in-place op that changes a shape (``unsqueeze_``) is seen by later questions, and not by
    values computed before it;
  * a shape that depends on tensor values (boolean-mask indexing) is refused, naming the source
    line; control flow on a value is still refused;
  * new input shapes, dtypes and a model cast to another dtype re-trace;
  * example values are computed lazily and cached per op signature: a 12-step loss runs each
    distinct op of a step once on fake tensors, not once per step;
  * an in-place accumulation survives ``cleanup`` (Dynamo) or is refused (FX, where the
    accumulator is a constant of the trace);
  * a changed module-level constant read by a helper, a changed closure constant, and a changed
    attribute of a config object (an argument, or held by a closure) re-trace; an argument object
    too large to key by content is refused;
  * a no-grad block inside a helper is recorded (loss and gradient as eager's at W=2, as
    Dynamo's at W=3); so is an autocast block, which ``capture="auto"`` now keeps on FX (more
    autocast cases in test_autocast.py).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch

from jaggc import JaggCaptureError, JaggUnsupportedError, jagg_compile
from jaggc_studies import example_losses
from jaggc.frontends import fake_cache
from jaggc.verify.fields import AffineJacobianField

from helpers import grads, rel_err, zero_grads

NAMES = list(example_losses.EXAMPLES)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _loss_and_grad(compiled, ex):
    zero_grads(ex.model)
    loss = compiled(ex.model, ex.batch)
    loss.backward()
    g = grads(ex.model).clone()
    zero_grads(ex.model)
    return loss.detach(), g


@pytest.mark.parametrize("name", NAMES)
def test_fx_captures_example_losses_like_dynamo(name):
    ex = example_losses.build_example(name, num_steps=6, batch=2, seed=0)
    results = {}
    for capture in ("dynamo", "fx"):
        compiled = jagg_compile(ex.loss_fn, window=3, capture=capture)
        results[capture] = _loss_and_grad(compiled, ex)
        assert compiled.report.path == capture
        results[capture + "_table"] = compiled.report.table()
        # the default weights: the high-noise window interpolates, the one reaching σ < 0.5 runs exactly
        assert [w.mode for w in compiled.report.windows] == ["jagg", "jagg:σ-exact"]
    # the same runtime ops on the same batches behind both frontends: bit for bit on any CPU
    assert torch.equal(results["fx"][0], results["dynamo"][0])
    assert rel_err(results["fx"][1], results["dynamo"][1]) < 1e-6
    assert results["fx_table"] == results["dynamo_table"]


def test_fx_records_the_kl_loss_no_grad_block():
    """The KL reference call's no_grad block is recorded as grad-mode switches (plain FX drops it):
    the reference call is classified as a reference, and after the rewrite the mode switches
    bracket it exactly."""
    ex = example_losses.build_example("kl_reference_sd3", num_steps=4, batch=2, seed=0)
    compiled = jagg_compile(ex.loss_fn, window=4, capture="fx")
    compiled(ex.model, ex.batch)
    assert compiled.report.reference_calls == 4
    code = compiled.report.stage("place_modes")
    assert code.count("_set_grad_enabled(False)") == 4 and code.count("_set_grad_enabled(True)") == 4


class TupleField(torch.nn.Module):
    """A DiT stand-in returning a 1-tuple (``return_dict=False``)."""

    def __init__(self):
        super().__init__()
        self.field = AffineJacobianField(3, seed=2)

    def forward(self, x, t):
        return (self.field(x, t),)


def metadata_loss(dit, zs, ts, g):
    """Every metadata question the FX frontend answers, each steering Python."""
    total = zs.new_zeros(())
    assert len(zs) == zs.shape[0] == zs.size(0) == zs.size()[0]
    for k in range(zs.size(0)):
        (v,) = dit(zs[k], ts[k])                       # tuple unpacking of the DiT output
        dims = tuple(range(1, v.ndim))
        scale = 1.0 / v.numel() if v.dim() == 2 else 0.0
        if v.dtype == torch.float64 and v.device.type == "cpu" and v.is_floating_point():
            weight = torch.ones(v.shape[-1], dtype=v.dtype, device=v.device)
        else:
            weight = torch.zeros(v.shape[-1], dtype=v.dtype, device=v.device)
        total = total + scale * ((v * g[k] * weight).sum(dim=dims) ** 2).sum()
    return total


def _inputs(num_steps: int, batch: int = 2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(num_steps)
    zs = torch.randn(num_steps, batch, 3, generator=gen, dtype=dtype)
    t = torch.linspace(1.0, 0.1, num_steps, dtype=dtype)
    ts = torch.stack([t] * batch, 1)
    gs = torch.randn(num_steps, batch, 3, generator=gen, dtype=dtype)
    return zs, ts, gs


def test_metadata_questions_get_eager_answers():
    field = TupleField()
    zs, ts, gs = _inputs(4)
    eager = metadata_loss(field, zs, ts, gs)
    compiled = jagg_compile(metadata_loss, window=2, capture="fx")   # W=2: exact windows
    assert torch.equal(compiled(field, zs, ts, gs), eager)
    assert eager != 0            # the float64/cpu branch was taken (weights of one, not zero)
    assert compiled.report.path == "fx"
    assert compiled.report.backward_before == 4


def inplace_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        before = v.ndim               # 2
        flat = v.sum(dim=tuple(range(1, v.ndim)))
        v2 = v.clone()
        v2.unsqueeze_(0)              # the clone's shape changes from here on
        assert v2.ndim == before + 1 and flat.ndim == 1
        total = total + (flat * g[k].sum(dim=1)).sum() + v2.sum(dim=tuple(range(v2.ndim)))
    return total


def test_in_place_shape_change_is_seen_after_not_before():
    field = AffineJacobianField(3, seed=3)
    zs, ts, gs = _inputs(4)
    compiled = jagg_compile(inplace_loss, window=2, capture="fx")
    torch.testing.assert_close(compiled(field, zs, ts, gs), inplace_loss(field, zs, ts, gs), rtol=0, atol=0)


def masked_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        positive = v[v > 0]                 # its length depends on the values
        total = total + positive.sum() / positive.shape[0]
    return total


def test_value_dependent_shape_is_refused_with_the_line():
    field = AffineJacobianField(3, seed=3)
    zs, ts, gs = _inputs(3)
    with pytest.raises(JaggCaptureError, match=r"test_fx_frontend.py:\d+: the loss asks for the shape of a "
                       r"tensor whose shape depends on the values of the DiT's output") as info:
        jagg_compile(masked_loss, window=3, capture="fx")(field, zs, ts, gs)
    # Dynamo fails on the same line: the message must not send the user there
    assert "capture='dynamo'" not in str(info.value) and "Dynamo breaks the graph at the same line" in str(info.value)


def value_branch_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        if v.mean() > 0:                    # control flow on a value: FX cannot trace it
            total = total + v.sum()
    return total


def test_control_flow_on_values_is_still_refused():
    field = AffineJacobianField(3, seed=3)
    zs, ts, gs = _inputs(3)
    with pytest.raises(JaggCaptureError, match=r"test_fx_frontend.py:\d+: the loss reads a tensor as a Python "
                       r"value \(bool\(x\)\) that depends on the DiT's output \(made at .*test_fx_frontend.py:\d+\)"):
        jagg_compile(value_branch_loss, window=3, capture="fx")(field, zs, ts, gs)


def dtype_following_loss(dit, zs, ts, g):
    """Casts the states to the DiT's parameter dtype, read while tracing."""
    dtype = next(dit.parameters()).dtype
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k].to(dtype), ts[k].to(dtype))
        total = total + (v.double() * g[k]).sum()
    return total


def test_new_shapes_dtypes_and_model_dtype_retrace():
    field = AffineJacobianField(3, seed=5)
    compiled = jagg_compile(dtype_following_loss, window=3, capture="fx")
    zs, ts, gs = _inputs(3)
    compiled(field, zs, ts, gs)
    compiled(field, zs, ts, gs)
    assert compiled.traces == 1
    compiled(field, *_inputs(4))                          # new step count
    assert compiled.traces == 2
    field.float()                                         # same inputs, the model cast: the graph's casts change
    out = compiled(field, zs, ts, gs)
    assert compiled.traces == 3
    torch.testing.assert_close(out, dtype_following_loss(field, zs, ts, gs))


def test_example_values_run_each_op_signature_once(monkeypatch):
    """12 steps of the Flow-GRPO loss: the ops of one step run on fake tensors once; later
    steps reuse the recorded metadata (``x[:, j]`` differs per step by ``j`` and runs again)."""
    runs: list = []
    original = fake_cache.cached_fake_call

    def counting(owner, run, args, kwargs, **kw):
        def counted(*a, **k):
            runs.append(owner)
            return run(*a, **k)
        return original(owner, counted, args, kwargs, **kw)

    from jaggc.frontends import example_values
    monkeypatch.setattr(example_values, "cached_fake_call", counting)
    counts = {}
    for steps in (4, 12):
        ex = example_losses.build_example("flow_grpo_sd3", num_steps=steps, batch=2, seed=0)
        runs.clear()
        jagg_compile(ex.loss_fn, window=4, capture="fx")(ex.model, ex.batch)
        counts[steps] = len(runs)
    dit_runs = runs.count(ex.model)
    assert dit_runs == 1                                  # one fake DiT forward for 12 calls
    # 8 more steps add only their per-step indexing (2 `x[:, j]` per step reach a shape question)
    assert counts[12] - counts[4] == 2 * 8, counts


def accumulate_in_place_loss(dit, zs, ts, g):
    total = torch.zeros((), dtype=zs.dtype)
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        total.add_((v * g[k]).sum())        # the result is unused: the effect lives in `total`
    return total * 1.0


def test_in_place_accumulation_survives_cleanup_or_is_refused():
    """``cleanup`` once dropped in-place method calls whose result was unused (fx calls every
    call_method pure): the Dynamo-compiled loss above returned 0. Under FX the accumulator is a
    constant of the trace, so the write is refused."""
    field = AffineJacobianField(3, seed=3)
    zs, ts, gs = _inputs(4)
    eager = accumulate_in_place_loss(field, zs, ts, gs)
    compiled = jagg_compile(accumulate_in_place_loss, window=2, capture="dynamo")
    torch.testing.assert_close(compiled(field, zs, ts, gs), eager, rtol=0, atol=0)
    assert eager != 0
    with pytest.raises(JaggUnsupportedError, match=r"test_fx_frontend.py:\d+: the loss writes in place \(add_\)"):
        jagg_compile(accumulate_in_place_loss, window=2, capture="fx")(field, zs, ts, gs)


SCALE = 2.0


def scaled(v):
    return SCALE * v


def make_closure_loss(power: int):
    def closure_loss(dit, zs, ts, g):
        total = 0.0
        for k in range(zs.shape[0]):
            total = total + (scaled(dit(zs[k], ts[k]) * g[k]) ** power).sum()
        return total
    return closure_loss


def test_changed_global_or_closure_constant_retraces(monkeypatch):
    """The trace bakes in SCALE (read by a helper the loss calls) and the closure's ``power``:
    changing either must not reuse the old graph."""
    field = AffineJacobianField(3, seed=6)
    zs, ts, gs = _inputs(3)
    loss = make_closure_loss(2)
    compiled = jagg_compile(loss, window=3, capture="fx")
    compiled(field, zs, ts, gs)
    assert {r.where for r in compiled._session.frontends["fx"].reads} >= {f"{__name__}.SCALE", "make_closure_loss.<locals>.closure_loss.<closure power>"}
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    out = compiled(field, zs, ts, gs)
    assert compiled.traces == 2
    torch.testing.assert_close(out, loss(field, zs, ts, gs))
    power = loss.__code__.co_freevars.index("power")
    loss.__closure__[power].cell_contents = 3              # the closure's power, changed in place
    out = compiled(field, zs, ts, gs)
    assert compiled.traces == 3
    torch.testing.assert_close(out, loss(field, zs, ts, gs))


def _reference_velocity(dit, x, t):
    with torch.no_grad():                     # inside a helper: the loss's own source has no `with`
        return dit(x, t)


def helper_no_grad_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        total = total + ((v - _reference_velocity(dit, zs[k], ts[k])) * g[k]).sum() + (v * g[k]).sum()
    return total


def autocast_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total = total + (v.float() @ g[k].float().T).sum()
    return total


def _value_and_grad(fn, field, *args):
    zero_grads(field)
    out = fn(field, *args)
    out.backward()
    g = grads(field).clone()
    zero_grads(field)
    return out.detach(), g


def test_no_grad_block_in_a_helper_is_recorded():
    """A no-grad block inside a helper (no `with` in the loss's own source) is recorded as grad-mode
    switches: at W=2 (every step a knot, the per-step calls eager runs) the loss equals eager's bit
    for bit; at W=3 the knots run as one batch of 2B, so the loss equals eager's to 1e-14 in float64
    (batch-size roundoff differs between CPUs, e.g. with AVX-512) and FX's JAGG gradient equals
    Dynamo's."""
    field = AffineJacobianField(3, seed=3)
    zs, ts, gs = _inputs(3)
    eager = _value_and_grad(helper_no_grad_loss, field, zs, ts, gs)
    fx_w2 = _value_and_grad(jagg_compile(helper_no_grad_loss, window=2, capture="fx"), field, zs, ts, gs)
    torch.testing.assert_close(fx_w2[0], eager[0], rtol=0, atol=0)
    assert rel_err(fx_w2[1], eager[1]) < 1e-12
    fx_w3 = _value_and_grad(jagg_compile(helper_no_grad_loss, window=3, capture="fx"), field, zs, ts, gs)
    dynamo_w3 = _value_and_grad(jagg_compile(helper_no_grad_loss, window=3, capture="dynamo"), field, zs, ts, gs)
    torch.testing.assert_close(fx_w3[0], eager[0], rtol=1e-14, atol=0)   # batched knots: not bit for bit
    assert rel_err(fx_w3[1], dynamo_w3[1]) < 1e-12


def test_autocast_block_is_recorded():
    """An autocast block in the loss is recorded (set_autocast switches): ``auto`` takes FX without a
    fallback, and the ops in the block run in bf16 (W=2: loss and gradient equal eager's bit for bit;
    they differ from the fp32 loss's, so a dropped block would show); at W=3 FX equals Dynamo."""
    field = AffineJacobianField(3, seed=3)
    zs, ts, gs = _inputs(3)
    eager = _value_and_grad(autocast_loss, field, zs, ts, gs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # no fallback warning
        auto = jagg_compile(autocast_loss, window=2)
        got = _value_and_grad(auto, field, zs, ts, gs)
    assert auto.report.path == "fx" and not auto.report.capture_failures
    assert "set_autocast" in auto.report.stage("capture") and "set_autocast" in auto.report.stage("place_modes")
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
    assert rel_err(got[1], eager[1]) == 0
    with torch.autocast("cpu", enabled=False):
        fp32 = (sum((field(zs[k], ts[k]) @ gs[k].T).sum() for k in range(3)))
    assert abs(float(fp32.detach()) - float(eager[0])) > 1e-6
    fx_w3 = _value_and_grad(jagg_compile(autocast_loss, window=3, capture="fx"), field, zs, ts, gs)
    dynamo_w3 = _value_and_grad(jagg_compile(autocast_loss, window=3, capture="dynamo"), field, zs, ts, gs)
    # both frontends run the same runtime ops on the same batches: bit for bit on any CPU
    torch.testing.assert_close(fx_w3[0], dynamo_w3[0], rtol=0, atol=0)
    assert rel_err(fx_w3[1], dynamo_w3[1]) < 1e-12


@dataclasses.dataclass
class LossConfig:
    clip: float
    weights: dict


def config_loss(dit, zs, ts, g, cfg: LossConfig):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        total = total + cfg.weights["policy"] * torch.clamp((v * g[k]).sum(dim=1), -cfg.clip, cfg.clip).sum()
    return total


def test_changed_config_attribute_retraces_and_a_huge_object_is_refused():
    """``cfg.clip`` is read while tracing and baked into the graph: the key holds what ``cfg``
    holds, so changing it (in place, same object) re-traces instead of reusing a stale graph."""
    field = AffineJacobianField(3, seed=6)
    zs, ts, gs = _inputs(3)
    cfg = LossConfig(clip=0.5, weights={"policy": 1.0})
    compiled = jagg_compile(config_loss, window=3, capture="fx")
    compiled(field, zs, ts, gs, cfg)
    compiled(field, zs, ts, gs, cfg)
    assert compiled.traces == 1
    for change in (lambda: setattr(cfg, "clip", 0.01), lambda: cfg.weights.update(policy=3.0)):
        change()
        out = compiled(field, zs, ts, gs, cfg)
        torch.testing.assert_close(out, config_loss(field, zs, ts, gs, cfg))
    assert compiled.traces == 3
    huge = LossConfig(clip=0.5, weights={"policy": 1.0, **{f"w{i}": float(i) for i in range(600)}})
    with pytest.raises(JaggUnsupportedError, match=r"argument 'cfg' \(LossConfig\) holds more than 512 values"):
        compiled(field, zs, ts, gs, huge)


def make_config_closure(cfg: LossConfig):
    def loss(dit, zs, ts, g):
        return config_loss(dit, zs, ts, g, cfg)
    return loss


def test_config_held_by_a_closure_is_guarded():
    field = AffineJacobianField(3, seed=6)
    zs, ts, gs = _inputs(3)
    cfg = LossConfig(clip=0.5, weights={"policy": 1.0})
    loss = make_config_closure(cfg)
    compiled = jagg_compile(loss, window=3, capture="fx")
    compiled(field, zs, ts, gs)
    cfg.clip = 0.01
    torch.testing.assert_close(compiled(field, zs, ts, gs), loss(field, zs, ts, gs))
    assert compiled.traces == 2


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


@pytest.mark.parametrize("failure", ["loss_raises", "function_apply_refused"])
def test_function_apply_is_patched_only_while_tracing(failure):
    """The FX frontend refuses raw ``Function.apply`` by patching it process-wide for the trace;
    a trace that raises must restore it, or every custom autograd Function would stay broken."""
    from jaggc.frontends.fx import capture_fx

    original = torch.autograd.Function.__dict__["apply"]
    model = AffineJacobianField(3, seed=1)
    seen = []

    def loss(dit, z):
        seen.append(torch.autograd.Function.__dict__["apply"] is original)
        if failure == "loss_raises":
            raise ValueError("the loss fails while FX traces it")
        return _Double.apply(dit(z, torch.ones(2, dtype=torch.float64))).sum()

    with pytest.raises(JaggCaptureError, match="fails while FX traces" if failure == "loss_raises" else "apply"):
        capture_fx(loss, (model, torch.ones(2, 3, dtype=torch.float64)), {}, [model])
    assert seen == [False]          # patched during the trace
    assert torch.autograd.Function.__dict__["apply"] is original
    x = torch.ones(2, requires_grad=True)
    _Double.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def default_flag_loss(dit, batch, scale=2.0, enabled=True):
    total = 0.0
    for k in range(batch["zs"].shape[0]):
        total = total + (dit(batch["zs"][k], batch["ts"][k]) * batch["gs"][k]).sum() * (scale if enabled else 1.0)
    return total


def test_keyword_defaults_beside_a_container_argument():
    """Regression: a default argument next to a dict argument made fx's pytree codegen emit
    ``enabled_1 = True, = ...`` (a SyntaxError); the defaults are bound, the graph takes them as inputs."""
    field = AffineJacobianField(3, seed=3)
    zs, ts, gs = _inputs(3)
    batch = dict(zs=zs, ts=ts, gs=gs)
    compiled = jagg_compile(default_flag_loss, window=2, capture="fx")
    torch.testing.assert_close(compiled(field, batch), default_flag_loss(field, batch))
    torch.testing.assert_close(compiled(field, batch, 3.0, False), default_flag_loss(field, batch, 3.0, False))
    assert compiled.report.path == "fx"
