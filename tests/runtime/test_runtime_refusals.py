"""The window runtime refuses (spec §5) the inputs under which a JAGG window would be wrong.

Every refusal must be a ``jaggc.JaggInputError`` (or ``JaggTypeError``) whose message names the
step and the input and says how to fix it, and a refused call must leave the model's ``.grad``
untouched (nothing computed, nothing accumulated).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import jaggc
from jaggc import DitCall, JaggInputError, JaggTypeError, WindowOptions, jagg_calls, run_window
from jaggc.runtime import partition
from jaggc.verify.fields import CurvedField, LinearThetaZ

DT = torch.float64
B, D = 2, 3
REFUSALS = (JaggInputError, JaggTypeError)


def _times(window: int) -> list[float]:
    return torch.linspace(1.0, 0.1, window, dtype=DT).tolist()


def _calls(window: int = 4, *, batch: int = B, dim: int = D, times=None, keyword_time: bool = False,
           seed: int = 0) -> list[DitCall]:
    gen = torch.Generator().manual_seed(seed)
    times = _times(window) if times is None else times
    calls = []
    for t in times:
        z = torch.randn(batch, dim, generator=gen, dtype=DT)
        tt = torch.full((batch,), float(t), dtype=DT)
        calls.append(DitCall((z,), {"timestep": tt}) if keyword_time else DitCall((z, tt)))
    return calls


def _replace_state(calls: list[DitCall], step: int, state) -> list[DitCall]:
    calls = list(calls)
    c = calls[step]
    calls[step] = DitCall((state,) + tuple(c.args[1:]), c.kwargs)
    return calls


def _field() -> nn.Module:
    field = CurvedField(D, seed=0)
    for i, p in enumerate(field.parameters()):  # a known, nonzero .grad to compare against
        p.grad = torch.full_like(p, 0.25 + i)
    return field


def _grad_snapshot(model: nn.Module):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _named_steps(msg: str) -> set[int]:
    """Step numbers a message names: "step 3", "steps 1 and 2", "steps [0, 1, 2]"."""
    named = set()
    for m in re.finditer(r"\bsteps?\s+((?:\[[\d,\s]*\])|(?:\d+(?:\s*(?:,|and)\s*\d+)*))", msg):
        named.update(int(x) for x in re.findall(r"\d+", m.group(1)))
    return named


def refused(model: nn.Module, fn, *, step=None, mentions=(), advice=()) -> str:
    """Run ``fn`` (which may also call backward), expect a refusal, check the message and that
    ``model``'s gradients did not change. Returns the message."""
    before = _grad_snapshot(model)
    with pytest.raises(REFUSALS) as info:
        fn()
    msg = str(info.value)
    if step is not None:
        assert step in _named_steps(msg), f"message does not name step {step}: {msg}"
    for word in mentions:
        assert word.lower() in msg.lower(), f"message does not mention {word!r}: {msg}"
    assert advice, "every refusal test must check the fix advice"
    assert any(a.lower() in msg.lower() for a in advice), f"message gives no fix advice {advice}: {msg}"
    for b, p in zip(before, model.parameters()):
        if b is None:
            assert p.grad is None
        else:
            assert p.grad is not None and torch.equal(p.grad, b), "a refused call changed .grad"
    return msg


def _forward_backward(model, calls, **kw):
    def fn():
        outs = run_window(model, calls, **kw)
        torch.stack([o.sum() for o in outs]).sum().backward()
    return fn


def _via_jagg_calls(model, calls, window, **kw):
    def fn():
        outs = jagg_calls(model, calls, window=window, **kw)
        torch.stack([o.sum() for o in outs]).sum().backward()
    return fn


ENTRY = pytest.mark.parametrize("entry", ["run_window", "jagg_calls"])


def _run(entry, model, calls, **kw):
    if entry == "run_window":
        return _forward_backward(model, calls, **kw)
    return _via_jagg_calls(model, calls, len(calls), **kw)


# ----------------------------------------------------------------------------- shapes and batches

@ENTRY
@pytest.mark.parametrize("step", [1, 3])  # an interior step and a knot step of a 4-step window
def test_batch_mismatch_between_steps(entry, step):
    field = _field()
    calls = _calls(4)
    bad = _calls(4, batch=B + 1, seed=1)[step]
    calls[step] = bad
    refused(field, _run(entry, field, calls), step=step, mentions=("batch",),
            advice=("same batch", "batch-compatible"))


@ENTRY
@pytest.mark.parametrize("step", [1, 2])
def test_state_shape_mismatch_between_steps(entry, step):
    # v = θz runs on any shape, and (B, 1) broadcasts against (B, D): without the refusal the
    # aggregated gradient would silently broadcast a wrong-shaped upstream gradient
    model = LinearThetaZ(1.0)
    model.theta.grad = torch.tensor(0.5, dtype=DT)
    calls = _replace_state(_calls(3), step, torch.randn(B, 1, dtype=DT))
    refused(model, _run(entry, model, calls), step=step, mentions=("input", "shape"),
            advice=("batch-compatible", "same shape"))


class WithConditioning(nn.Module):
    """A DiT-like module with a batched conditioning tensor and a non-tensor option."""

    def __init__(self):
        super().__init__()
        self.inner = CurvedField(D, seed=1)
        self.proj = nn.Parameter(torch.randn(4, D, dtype=DT, generator=torch.Generator().manual_seed(2)))

    def forward(self, hidden_states, timestep, encoder_hidden_states=None, scale: float = 1.0):
        out = self.inner(hidden_states, timestep) * scale
        if encoder_hidden_states is not None:
            out = out + encoder_hidden_states.mean(1) @ self.proj
        return out


def _cond_calls(window=4, *, scale_at=None, cond_len_at=None, cond_len=5):
    gen = torch.Generator().manual_seed(3)
    calls = []
    for k, t in enumerate(_times(window)):
        length = cond_len + 1 if k == cond_len_at else cond_len
        calls.append(DitCall((), {
            "hidden_states": torch.randn(B, D, generator=gen, dtype=DT),
            "timestep": torch.full((B,), t, dtype=DT),
            "encoder_hidden_states": torch.randn(B, length, 4, generator=gen, dtype=DT),
            "scale": 2.0 if k == scale_at else 1.0,
        }))
    return calls


@pytest.mark.parametrize("step", [1, 3])
def test_conditioning_shape_mismatch_between_steps(step):
    model = WithConditioning()
    refused(model, _forward_backward(model, _cond_calls(cond_len_at=step)), step=step,
            mentions=("encoder_hidden_states",), advice=("batch-compatible", "same shape"))


@pytest.mark.parametrize("window,step,options", [
    (4, 1, WindowOptions()),
    (4, 0, WindowOptions()),
    (3, 1, WindowOptions()),                               # a lone interior step
    (4, 1, WindowOptions(interior_chunk=1)),               # interior steps run one by one
    (4, 0, WindowOptions(batch_knots=False)),              # knots run one by one
    (5, 3, WindowOptions(interior_chunk=1, batch_knots=False)),
], ids=["interior", "knot", "w3-interior", "chunk1", "unbatched-knots", "fully-unbatched"])
def test_non_tensor_argument_differs_between_steps(window, step, options):
    model = WithConditioning()
    msg = refused(model, _forward_backward(model, _cond_calls(window, scale_at=step), options=options),
                  mentions=("scale",), advice=("must be the same",))
    assert re.search(r"\bsteps? \d", msg)


# ----------------------------------------------------------------------------- window size

def test_window_smaller_than_two():
    for w in (1, 0, -3):
        with pytest.raises(JaggInputError, match=rf"window={w}.*at least 2"):
            partition(10, w)
    field = _field()
    refused(field, _via_jagg_calls(field, _calls(10), 1), mentions=("window=1",), advice=("at least 2",))


def test_empty_call_list():
    """An empty trajectory has no outputs (a window that moved past the trained steps)."""
    assert jagg_calls(_field(), [], window=4) == []


# ----------------------------------------------------------------------------- timesteps

@ENTRY
@pytest.mark.parametrize("keyword_time", [False, True])
def test_duplicated_timesteps(entry, keyword_time):
    field = _field()
    calls = _calls(4, times=[1.0, 0.5, 0.5, 0.1], keyword_time=keyword_time)
    refused(field, _run(entry, field, calls), step=1, mentions=("timestep",), advice=("distinct",))


@ENTRY
def test_duplicated_timestep_in_one_sample_only(entry):
    field = _field()
    calls = _calls(4)
    t = calls[2].args[1].clone()
    t[1] = calls[1].args[1][1]
    calls[2] = DitCall((calls[2].args[0], t))
    refused(field, _run(entry, field, calls), step=2, mentions=("timestep",), advice=("distinct",))


@ENTRY
@pytest.mark.parametrize("times", [[1.0, 0.3, 0.5, 0.1], [0.1, 0.5, 0.3, 1.0], [1.0, 0.5, 0.1, 0.3]])
def test_non_monotone_timesteps(entry, times):
    field = _field()
    refused(field, _run(entry, field, _calls(4, times=times)), step=0, mentions=("timestep", "monotone"),
            advice=("order", "schedule"))


@ENTRY
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_timestep_tensor(entry, bad):
    field = _field()
    calls = _calls(4)
    calls[2].args[1][0] = bad
    refused(field, _run(entry, field, calls), step=2, mentions=("nan",), advice=("check", "pass"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_python_float_timestep(bad):
    # a Python-float timestep (shared by the batch) is not a tensor input: check_times sees it
    model = LinearThetaZ(1.0)
    calls = [DitCall((torch.randn(B, D, dtype=DT),), {"timestep": t}) for t in (1.0, bad, 0.5, 0.1)]
    refused(model, _forward_backward(model, calls), step=1, mentions=("timestep", "nan"),
            advice=("pass", "check"))


# ----------------------------------------------------------------------------- states

@ENTRY
@pytest.mark.parametrize("step", [0, 2, 3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_in_states(entry, step, bad):
    field = _field()
    calls = _calls(4)
    calls[step].args[0][1, 2] = bad
    refused(field, _run(entry, field, calls), step=step, mentions=("input", "nan"),
            advice=("check the stored trajectory", "fp32"))


@ENTRY
@pytest.mark.parametrize("window", [2, 4])
def test_state_dtype_differs_from_parameters(entry, window):
    field = _field()
    calls = _replace_state(_calls(window), 1, _calls(window)[1].args[0].float())
    refused(field, _run(entry, field, calls), step=1, mentions=("float32", "float64"),
            advice=("cast", "autocast"))


def test_state_dtype_differs_under_autocast_is_allowed():
    field = CurvedField(D, seed=0)
    calls = _replace_state(_calls(4), 1, _calls(4)[1].args[0].float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = run_window(field, calls)
        loss = torch.stack([o.float().sum() for o in outs]).sum()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in field.parameters())


@ENTRY
def test_device_mismatch(entry):
    field = _field()
    try:
        meta_state = torch.empty(B, D, dtype=DT, device="meta")
    except Exception as exc:  # pragma: no cover - meta tensors exist in every supported torch
        pytest.skip(f"meta tensors unavailable: {exc}")
    calls = _replace_state(_calls(4), 2, meta_state)
    refused(field, _run(entry, field, calls), step=2, mentions=("meta", "cpu"), advice=("move",))


@ENTRY
@pytest.mark.parametrize("window", [2, 4])
def test_state_that_requires_grad(entry, window):
    # the state of step 1 is the DiT's output at step 0, not detached
    field = _field()
    calls = _calls(window)
    z1 = calls[0](field)
    assert z1.requires_grad
    before = _grad_snapshot(field)
    calls = _replace_state(calls, 1, z1)
    refused(field, _run(entry, field, calls), step=1, mentions=("requires grad", "earlier DiT output"),
            advice=("detach",))
    assert all(torch.equal(p.grad, b) for p, b in zip(field.parameters(), before))


def test_refused_call_leaves_no_grad_on_a_fresh_model():
    field = CurvedField(D, seed=0)
    calls = _calls(4)
    calls[2].args[0][0, 0] = float("nan")
    refused(field, _forward_backward(field, calls), step=2, mentions=("nan",), advice=("check",))
    assert all(p.grad is None for p in field.parameters())


def test_check_inputs_false_skips_the_checks():
    # the escape hatch exists and is explicit: NaN states are then the user's business
    field = CurvedField(D, seed=0)
    calls = _calls(4)
    calls[1].args[0][0, 0] = float("nan")
    outs = run_window(field, calls, options=WindowOptions(check_inputs=False))
    assert torch.isnan(outs[1]).any()
    assert jaggc.JaggInputError is JaggInputError
