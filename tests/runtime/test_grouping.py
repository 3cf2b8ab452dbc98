"""The one window-grouping rule (jaggc/runtime/grouping.py): streams, runs and windows on abstract
keys, the keys of recorded calls, and the same windows from every path that runs a loss (the fx
window pass, the intercept path, jagg_calls, the fidelity estimators)."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from jaggc import JaggInputError, jagg_compile
from jaggc.fidelity import estimators as E
from jaggc.runtime import DitCall
from jaggc.runtime.grouping import group_calls, group_windows, same_step_of, streams
from jaggc.verify.fields import AffineJacobianField

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _by_key(step_keys, batch_keys=None):
    batch_keys = batch_keys or [0] * len(step_keys)
    return dict(same_step=lambda j, k: step_keys[j] == step_keys[k], batch_key=lambda k: batch_keys[k])


@pytest.mark.parametrize("step_keys,expected", [
    ([0, 1, 2, 3], [[0, 1, 2, 3]]),                            # one call per step
    ([0, 0, 1, 1, 2, 2], [[0, 2, 4], [1, 3, 5]]),              # two-call CFG
    ([0, 0, 0, 1, 1, 1], [[0, 3], [1, 4], [2, 5]]),            # three calls per step
    ([0, 0, 1, 2, 2], [[0, 1, 2, 3, 4]]),                      # uneven: no streams
    ([], [[]]),
])
def test_streams(step_keys, expected):
    assert streams(len(step_keys), lambda j, k: step_keys[j] == step_keys[k]) == expected


@pytest.mark.parametrize("n,window,batch_keys,expected", [
    (8, 4, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (7, 3, None, [[0, 1, 2], [3, 4, 5], [6]]),                                   # a tail of its own
    (6, 3, [0, 0, 1, 1, 1, 1], [[0, 1], [2, 3, 4], [5]]),                        # a cut
    (6, 2, [0, 1, 0, 1, 0, 1], [[0], [1], [2], [3], [4], [5]]),                  # every call cut
])
def test_runs_and_windows(n, window, batch_keys, expected):
    grouping = group_windows(n, window, **_by_key(list(range(n)), batch_keys))
    assert grouping.windows == expected
    assert grouping.cut == (batch_keys is not None)
    assert sorted(k for w in grouping.windows for k in w) == list(range(n))     # each call once


def test_windows_never_mix_streams_and_say_so():
    grouping = group_windows(12, 4, **_by_key([k // 2 for k in range(12)]))
    assert grouping.windows == [[0, 2, 4, 6], [8, 10], [1, 3, 5, 7], [9, 11]]
    assert any("one window per stream" in note for note in grouping.notes())


def test_window_longer_than_a_stream_is_the_stream():
    """``window`` is the largest window: a stream (or run) shorter than it is one window of its
    length (MixGRPO's window shrinking at the end of its run), never a refusal."""
    assert group_windows(6, 4, **_by_key([0, 0, 1, 1, 2, 2])).windows == [[0, 2, 4], [1, 3, 5]]
    assert group_windows(3, 4, **_by_key(list(range(3)))).windows == [[0, 1, 2]]
    assert group_windows(1, 4, **_by_key([0])).windows == [[0]]
    assert group_windows(0, 4, **_by_key([])).windows == []
    with pytest.raises(JaggInputError, match=r"window=1: a JAGG window needs an int of at least 2"):
        group_windows(6, 1, **_by_key(list(range(6))))


# ----------------------------------------------------------------------------- recorded calls

def test_same_step_compares_values_not_objects():
    z = torch.randn(2, 3)
    t = torch.tensor([0.5, 0.5])
    calls = [DitCall((z, t)), DitCall((z.clone(), t.clone())), DitCall((z, 0.25)), DitCall((z + 1, 0.25))]
    same = same_step_of(calls, None)
    assert same(0, 1)                  # equal values in other tensors: one step (a CFG loss indexing twice)
    assert not same(1, 2)              # another timestep
    assert not same(2, 3)              # another state
    assert same_step_of([DitCall(kwargs=dict(hidden_states=z, timestep=0.5))] * 2, None)(0, 1)


def test_recorded_calls_are_cut_by_structure_and_state_not_by_shape():
    z, t = torch.randn(2, 3), torch.linspace(1.0, 0.1, 6)
    calls = [DitCall((z + k, t[k]), {"scale": 1.0 if k < 3 else 2.0}) for k in range(6)]
    assert group_calls(calls, 3).windows == [[0, 1, 2], [3, 4, 5]]
    assert group_calls(calls, 3, states=["a", "a", "b", "b", "b", "b"]).windows == [[0, 1], [2], [3, 4, 5]]
    other_shape = calls[:5] + [DitCall((torch.randn(4, 3), t[5]), {"scale": 2.0})]
    # a shape change is the window's to refuse (batch-compatible inputs), as on the graph path
    assert group_calls(other_shape, 3).windows == [[0, 1, 2], [3, 4, 5]]


# ----------------------------------------------------------------------------- every path agrees

class ScaledField(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = AffineJacobianField(3, seed=4)

    def forward(self, hidden_states, timestep, scale: float = 1.0):
        return self.inner(hidden_states, timestep) * scale


def scale_change_loss(dit, zs, ts, g):
    """A loss whose guidance scale changes half-way: windows are cut where the structure changes."""
    total = 0.0
    for k in range(zs.shape[0]):
        total = total + (dit(zs[k], ts[k], scale=1.0 if k < 5 else 1.5) * g[k]).sum()
    return total


def _inputs(T=9, B=2):
    gen = torch.Generator().manual_seed(0)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    return (torch.randn(T, B, 3, generator=gen, dtype=torch.float64), torch.stack([t, 0.9 * t], 1),
            torch.randn(T, B, 3, generator=gen, dtype=torch.float64))


def test_every_path_cuts_the_same_windows():
    model = ScaledField().double()
    args = (model, *_inputs())
    expected = [[0, 1, 2, 3], [4], [5, 6, 7, 8]]
    grads = {}
    eager_loss = scale_change_loss(*args).detach()
    for capture in ("fx", "dynamo", "intercept"):
        compiled = jagg_compile(scale_change_loss, window=4, weights="t", capture=capture)
        loss = compiled(*args)
        assert compiled.report.path == capture
        assert [w.steps for w in compiled.report.windows] == expected, capture
        assert any("cut" in note for note in compiled.report.notes), capture
        torch.testing.assert_close(loss.detach(), eager_loss, rtol=1e-12, atol=1e-14)
        grads[capture] = torch.autograd.grad(loss, list(model.parameters()))
    rec = E.record(lambda dit, b: scale_change_loss(dit, *b), model, args[1:], time_arg=1)
    assert E.windows_of(rec, 4) == expected
    flat = {k: torch.cat([x.reshape(-1) for x in v]) for k, v in grads.items()}
    for capture in ("dynamo", "intercept"):
        assert rel_err(flat[capture], flat["fx"]) < 1e-12
    assert rel_err(E.jagg(rec, model, window=4).grad, flat["fx"]) < 1e-12
