"""The on-policy fast path (runtime/rollout_cache.py): interior outputs served from the rollout's
recorded calls while the parameters are unchanged; any parameter change falls back to forwards."""

from __future__ import annotations

import pytest
import torch

import jaggc
from helpers import grads, rel_err, zero_grads
from jaggc import models
from jaggc.runtime import DitCall, RolloutCache, WindowOptions, count_dit_passes, jagg_calls

T, B = 8, 3


@pytest.fixture()
def model():
    return models.sd3("tiny", seed=0).double()


def rollout(model, cache: RolloutCache | None = None, seed: int = 0):
    """Euler-Maruyama sampling with the DiT (no grad), storing each step's state and timestep."""
    g = torch.Generator().manual_seed(seed)
    cond = {k: v.double() for k, v in models.sd3_conditioning(model, B, seed=seed).kwargs.items()}
    z = torch.randn(models.sd3_latent_shape(model, B), generator=g).double()
    sigmas = torch.linspace(1.0, 0.05, T + 1, dtype=torch.float64)
    states, times = [], []
    ctx = cache.record() if cache is not None else torch.no_grad()
    with torch.no_grad(), ctx:
        for k in range(T):
            t = torch.full((B,), 1000.0, dtype=torch.float64) * sigmas[k]
            v = model(hidden_states=z, timestep=t, return_dict=False, **cond)[0]
            states.append(z)
            times.append(t)
            z = z + (sigmas[k + 1] - sigmas[k]) * v + 0.1 * torch.randn(z.shape, generator=g).double()
    return dict(states=torch.stack(states, 1), times=torch.stack(times, 1), cond=cond)


def training_calls(traj, order=None):
    order = torch.arange(B) if order is None else order
    cond = {k: v[order] for k, v in traj["cond"].items()}
    return [DitCall((), dict(hidden_states=traj["states"][order, k], timestep=traj["times"][order, k],
                             return_dict=False, **cond)) for k in range(T)]


def loss_and_grad(model, calls, options):
    """A loss whose upstream gradients depend on the step values (as a GRPO loss's do)."""
    zero_grads(model)
    with count_dit_passes(model) as counts:
        outs = jagg_calls(model, calls, window=4, options=options)
        loss = sum(((o[0] - 0.1 * k) ** 2).sum() for k, o in enumerate(outs))
        loss.backward()
    return loss.detach(), grads(model).clone(), counts


def test_fast_path_skips_interior_forwards_with_the_same_gradient(model):
    cache = RolloutCache(model)
    traj = rollout(model, cache)
    assert len(cache) == T * B
    # Flow-GRPO trains on shuffled samples: rows are matched one by one
    calls = training_calls(traj, order=torch.tensor([2, 0, 1]))
    slow_loss, slow, slow_counts = loss_and_grad(model, calls, WindowOptions())
    fast_loss, fast, fast_counts = loss_and_grad(model, calls, WindowOptions(rollout_cache=cache))
    assert slow_counts.nograd_forwards == 2 and fast_counts.nograd_forwards == 0
    assert fast_counts.grad_forwards == 2 and fast_counts.backwards == 2
    assert cache.stats.hits == 4 and cache.stats.misses == 0
    assert rel_err(fast, slow) < 1e-10
    torch.testing.assert_close(fast_loss, slow_loss, rtol=1e-12, atol=0)


def test_parameter_change_falls_back_to_forwards(model):
    cache = RolloutCache(model)
    calls = training_calls(rollout(model, cache))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss_and_grad(model, calls, WindowOptions(rollout_cache=cache))
    opt.step()  # in-place parameter update: version counters move
    slow_loss, slow, _ = loss_and_grad(model, calls, WindowOptions())
    fast_loss, fast, counts = loss_and_grad(model, calls, WindowOptions(rollout_cache=cache))
    assert counts.nograd_forwards == 2  # the stale cache was not used...
    assert cache.stats.invalidations == 1 and len(cache) == 0  # ...and was dropped
    assert torch.equal(fast, slow) and torch.equal(fast_loss, slow_loss)


def test_manual_in_place_edit_invalidates(model):
    cache = RolloutCache(model)
    calls = training_calls(rollout(model, cache))
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)  # same values, but written: must not be trusted
    assert cache.lookup(calls[1]) is None
    assert cache.stats.invalidations == 1


def test_unrecorded_inputs_miss(model):
    cache = RolloutCache(model)
    traj = rollout(model, cache)
    other = rollout(model, None, seed=1)
    assert cache.lookup(training_calls(other)[1]) is None
    # a row whose conditioning differs from the recording is another input
    calls = training_calls(traj)
    changed = DitCall((), {**calls[1].kwargs, "pooled_projections": calls[1].kwargs["pooled_projections"] + 1})
    assert cache.lookup(changed) is None
    hit = cache.lookup(calls[1])
    with torch.no_grad():
        assert torch.equal(hit[0], model(**calls[1].kwargs)[0])  # same batch as the rollout: same bits


def test_compiled_loss_uses_the_cache(model):
    cache = RolloutCache(model)
    traj = rollout(model, cache)

    def loss_fn(dit, batch):
        total = 0
        for j in range(batch["states"].shape[1]):
            v = dit(hidden_states=batch["states"][:, j], timestep=batch["times"][:, j], return_dict=False,
                    **batch["cond"])[0]
            total = total + ((v - 0.1 * j) ** 2).sum()
        return total

    slow_fn = jaggc.jagg_compile(loss_fn, window=4)
    fast_fn = jaggc.jagg_compile(loss_fn, window=4, options=jaggc.Options(rollout_cache=cache))
    zero_grads(model)
    slow_fn(model, traj).backward()
    slow = grads(model).clone()
    fast_fn(model, traj)  # capture
    zero_grads(model)
    with count_dit_passes(model) as counts:
        fast_fn(model, traj).backward()
    assert counts.nograd_forwards == 0 and counts.backwards == 2
    assert rel_err(grads(model), slow) < 1e-10


def test_per_window_backward_uses_the_cache(model):
    """backward="per_window" takes its no-grad values from the rollout cache like the joint mode
    (it used to ignore the cache: 0 hits, every forward run)."""
    cache = RolloutCache(model)
    traj = rollout(model, cache)
    calls = training_calls(traj)
    _, joint, _ = loss_and_grad(model, calls, WindowOptions())
    hits = cache.stats.hits
    loss, got, counts = loss_and_grad(model, calls, WindowOptions(rollout_cache=cache, backward="per_window"))
    assert cache.stats.hits > hits
    # no no-grad forward at all: every value came from the rollout; the knot forwards (with grad)
    # run inside the backward, one per window
    assert counts.nograd_forwards == 0 and counts.grad_forwards == counts.backwards
    assert rel_err(got, joint) < 1e-10


def test_rows_are_keyed_alike_whatever_the_input_layout(model):
    """A sample recorded in a batch of 3 is found from a batch of 1, whose timestep is a scalar
    expanded to (1,) (stride 0): the per-row digest depends on values, not on memory layout."""
    cache = RolloutCache(model)
    traj = rollout(model, cache)
    k, b = 2, 1
    t = traj["times"][b, k].reshape(()).expand(1)
    assert t.stride() == (0,)
    call = DitCall((), dict(hidden_states=traj["states"][b:b + 1, k], timestep=t, return_dict=False,
                            **{name: v[b:b + 1] for name, v in traj["cond"].items()}))
    with torch.no_grad():
        hit = cache.lookup(call)
        direct = call(model)
    assert hit is not None and cache.stats.hits == 1
    torch.testing.assert_close(hit[0], direct[0], rtol=1e-12, atol=1e-12)


# --- what a row is keyed by: the function's state, the call as the forward binds it --------------------

class _ScaledInEval(torch.nn.Module):
    """A module whose own forward reads self.training: its output changes with the mode."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x, t=None):
        return self.lin(x) * (1.0 if self.training else 0.5)


def test_function_state_keeps_only_the_modes_that_change_the_function(model):
    from jaggc.runtime.function_state import FunctionStateReader, mode_matters

    sd3 = FunctionStateReader(model)
    model.eval()
    a = sd3.read()
    model.train()
    assert sd3.read() == a and a.reusable          # SD3's dropouts all have p = 0: the same function
    custom = _ScaledInEval()
    reader = FunctionStateReader(custom)
    custom.eval()
    e = reader.read()
    custom.train()
    assert reader.read() != e and mode_matters(custom) and not mode_matters(custom.lin)
    norm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Dropout(0.2))
    reader = FunctionStateReader(norm)
    norm.eval()
    assert reader.read().reusable                   # running statistics, no dropout: a function of the input
    norm.train()
    assert not reader.read().reusable               # batch statistics and live dropout: not
    with torch.autocast("cpu", torch.bfloat16):
        assert FunctionStateReader(model).read() != a


def test_a_module_reading_self_training_misses_across_modes():
    custom = _ScaledInEval().double()
    cache = RolloutCache(custom, time_arg=1)
    x, t = torch.randn(4, 3, dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)
    custom.eval()
    with torch.no_grad(), cache.record():
        custom(x, t)
    custom.train()
    assert cache.lookup(DitCall((x, t))) is None
    custom.eval()
    assert cache.lookup(DitCall((x, t))) is not None


def test_a_call_is_read_as_the_forward_binds_it(model):
    """Flow-GRPO's sampler passes joint_attention_kwargs=None, its training call omits it; a keyword
    passed by position is the same call."""
    cache = RolloutCache(model)
    traj = rollout(model, cache)
    call = training_calls(traj)[1]
    explicit = DitCall((), {**call.kwargs, "joint_attention_kwargs": None})
    positional = DitCall((call.kwargs["hidden_states"],), {k: v for k, v in call.kwargs.items() if k != "hidden_states"})
    for same in (explicit, positional):
        assert cache.lookup(same) is not None
    assert cache.lookup(DitCall((), {**call.kwargs, "return_dict": True})) is None     # another output structure
