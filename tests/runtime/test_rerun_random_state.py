"""Random state in the whole-loss re-runs (issue 52): ``backward="per_window"`` re-runs a window's knots
inside the loss's backward, and the guard's probe of a per-window window re-runs its knots and interior
steps; with live dropout (an ``nn.Dropout`` module, ``F.dropout`` in the forward, attention's
``dropout_p``) the re-run must draw the masks the values were computed with.

Checked in float64 against a hand computation with the same masks (tests/dropout_dits.py: each value's
own forward, found in a log of the forwards, replayed from its RNG state): the JAGG gradient in ``.grad``
is Σ_j J_{k_j}ᵀ Γ_j with each knot's Jacobian at its value's masks, batched knots or one by one, any
interior chunking; the guard's exact gradient is Σ_s J_sᵀ g_s with every step's.
"""

from __future__ import annotations

import pytest
import torch

import jaggc
from dropout_dits import DropoutDiT, Recorder, flat_grad, hand_gradient, jagg_cotangents, rel, trajectory
from jaggc.runtime import DitCall, WindowOptions, jagg_calls

KINDS = ["module", "functional", "sdpa"]
T, W = 8, 4


def _calls(zs, ts):
    return [DitCall((), dict(hidden_states=z, timestep=t)) for z, t in zip(zs, ts)]


def _run(rec, calls, gs, options):
    """The loss Σ_s <y_s, g_s> through jagg_calls, its backward; the values it saw."""
    rec.zero_grad(set_to_none=True)
    rec.log.clear()
    outs = jagg_calls(rec, calls, window=W, options=options)
    values = [o.detach().clone() for o in outs]
    logged = len(rec.log)
    sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    del rec.log[logged:]
    return values


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_knots,chunk", [(True, None), (False, None), (True, 2)])
def test_per_window_knot_reruns_use_the_values_masks(kind, batch_knots, chunk):
    torch.manual_seed(0)
    rec = Recorder(DropoutDiT(kind)).train()
    zs, ts, gs = trajectory(T)
    options = WindowOptions(backward="per_window", weights="t", batch_knots=batch_knots, interior_chunk=chunk)
    for _ in range(2):                     # the second call: what jaggc learned of the module in the first
        values = _run(rec, _calls(zs, ts), gs, options)
        want = hand_gradient(rec, values, jagg_cotangents(gs, ts, W))
        assert want.norm() > 0
        assert rel(flat_grad(rec), want) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_per_window_in_eval_mode_draws_nothing_and_is_the_joint_gradient(kind):
    """No live dropout: nothing is recorded nor replayed, the gradient is the joint mode's."""
    rec = Recorder(DropoutDiT(kind)).eval()
    zs, ts, gs = trajectory(T)
    _run(rec, _calls(zs, ts), gs, WindowOptions(backward="joint", weights="t"))
    joint = flat_grad(rec)
    values = _run(rec, _calls(zs, ts), gs, WindowOptions(backward="per_window", weights="t"))
    assert rel(flat_grad(rec), joint) < 1e-13
    assert rel(joint, hand_gradient(rec, values, jagg_cotangents(gs, ts, W))) < 1e-12    # the hand computation


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_knots", [True, False])
def test_guard_probe_of_a_per_window_window_uses_the_values_masks(kind, batch_knots):
    torch.manual_seed(1)
    rec = Recorder(DropoutDiT(kind)).train()
    zs, ts, gs = trajectory(T, seed=3)
    results = []
    guard = jaggc.Guard(every=1, on_probe=results.append)
    options = WindowOptions(backward="per_window", weights="t", batch_knots=batch_knots, guard=guard)
    calls = _calls(zs, ts)

    def loss():
        outs = jagg_calls(rec, calls, window=W, options=options)
        values.extend(o.detach().clone() for o in outs)
        return sum((o * g).sum() for o, g in zip(outs, gs))

    values: list = []
    rec.log.clear()
    out = guard.call(loss, loss, (), {})
    logged = len(rec.log)
    out.backward()
    del rec.log[logged:]
    assert len(results) == 1
    exact = hand_gradient(rec, values, gs)
    jagg = hand_gradient(rec, values, jagg_cotangents(gs, ts, W))
    assert rel(jagg, exact) > 1e-3                       # the probe has something to find
    assert rel(flat_grad(rec), jagg) < 1e-12
    assert rel(results[0].jagg, jagg) < 1e-12
    assert rel(results[0].exact, exact) < 1e-12


def test_per_window_knots_served_by_the_rollout_cache_with_live_dropout_are_refused():
    """A forward that reads ``self.training`` and draws through ``F.dropout`` is recorded by the rollout
    cache (no dropout module tells it the call is random): its knots' values then come from the rollout,
    whose masks no re-run can draw again. The re-run that draws is refused, naming dropout and the fixes."""
    from jaggc.runtime.rollout_cache import RolloutCache

    rec = Recorder(DropoutDiT("functional")).train()
    zs, ts, gs = trajectory(T)
    calls = _calls(zs, ts)
    cache = RolloutCache(rec, time_arg="timestep")
    with torch.no_grad(), cache.record():
        for c in calls:
            c(rec)
    outs = jagg_calls(rec, calls, window=W, options=WindowOptions(backward="per_window", weights="t",
                                                                  rollout_cache=cache))
    assert cache.stats.hits > 0
    with pytest.raises(jaggc.JaggUnsupportedError, match=r"live dropout.*(?s:.*)dit\.eval\(\), p=0.*rollout cache off"):
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()


def test_rng_states_on_the_cpu_read_draws_and_replay_them():
    """``_compat``'s RNG helpers on a CPU-only setup: no device state, a draw through any API is seen
    (``rng_drawn``), and ``rng_states_restored`` replays a call's draws and gives the caller's stream back."""
    from jaggc._compat import accelerator_devices, rng_drawn, rng_states, rng_states_restored

    dit = DropoutDiT("functional").train()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert accelerator_devices(dit, x) == ()
    states = rng_states((x,), {}, module=dit)
    assert states.devices == () and not rng_drawn(states)
    torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
    assert rng_drawn(states)
    first = torch.nn.functional.dropout(x, 0.5)
    states = rng_states(x)
    drawn = torch.nn.functional.dropout(x, 0.5)
    left = torch.get_rng_state()
    with rng_states_restored(states):
        again = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(again, drawn) and not torch.equal(first, drawn)
    assert torch.equal(torch.get_rng_state(), left)            # the caller's stream, where it was left
