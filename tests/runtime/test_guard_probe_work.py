"""What a probe does beyond its backward passes, made cheaper without losing what it guarantees
(issue 48, item 3): its flat vectors reused (runtime/flat_buffers.py) only when nothing refers to them,
so a kept probe result is never overwritten; its graph walked for stand-ins only when a parameter got
no gradient, which a stand-in always causes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import jaggc
from jaggc import models
from jaggc.runtime.flat_buffers import FlatBuffers

CPU = torch.device("cpu")


def test_a_buffer_is_handed_out_again_only_when_nothing_refers_to_it():
    pool = FlatBuffers(limit=2)
    a = pool.empty(8, torch.float32, CPU)
    b = pool.empty(8, torch.float32, CPU)
    assert a.data_ptr() != b.data_ptr()
    view = a[2:]                                      # a view keeps a's storage taken
    del a
    c = pool.empty(8, torch.float32, CPU)
    assert c.data_ptr() not in (view.data_ptr() - 8, b.data_ptr())
    assert len(pool.held) == 2                        # over the limit: c is not held
    kept = view.data_ptr() - 8
    del view
    assert pool.empty(8, torch.float32, CPU).data_ptr() == kept
    assert pool.empty(8, torch.float64, CPU).dtype == torch.float64     # another dtype: another vector
    assert pool.clone(torch.arange(8.0)).tolist() == list(range(8))


def test_off_the_cpu_nothing_is_held():
    pool = FlatBuffers()
    t = pool.empty(8, torch.float32, torch.device("meta"))
    assert t.device.type == "meta" and pool.held == []


class ProbedLoop:
    """A per-step loop on a tiny SD3 DiT, an SGD step after each trajectory; every trajectory probed
    (``Guard(every=1)``), or none (``guarded=False``). ``gpu_form``: the trainers' GPU form on the
    CPU, ``train()`` and a live bf16 autocast block inside each step."""

    def __init__(self, on_probe=None, guarded: bool = True, gpu_form: bool = False):
        torch.manual_seed(0)
        self.model = models.sd3("tiny")
        self.cond = models.sd3_conditioning(self.model, 1, seed=1).kwargs
        self.shape = models.sd3_latent_shape(self.model, 1)
        self.guard = jaggc.Guard(every=1, probes=2, on_drift="warn", on_probe=on_probe) if guarded else None
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        jaggc.stepwise(self.model, window=4, weights="t", guard=self.guard)
        self.times = torch.linspace(0.95, 0.3, 6)
        self.gpu_form = gpu_form
        self.done = 0

    def train(self, trajectories: int) -> None:
        for _ in range(trajectories):
            zs = torch.randn(6, *self.shape, generator=torch.Generator().manual_seed(self.done))
            self.done += 1
            self.optimizer.zero_grad()
            for j in jaggc.stepwise(self.model).steps(range(6), self.times):
                if self.gpu_form:
                    self.model.train()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.gpu_form):
                    out = self.model(hidden_states=zs[j], timestep=self.times[j:j + 1] * 1000, return_dict=False,
                                     **self.cond)[0]
                out.float().square().mean().backward()
            self.optimizer.step()


@pytest.mark.filterwarnings("ignore:jaggc guard. JAGG drifted")
def test_kept_probe_results_are_never_overwritten():
    results, at_probe = [], []

    def keep(result):
        results.append(result)
        at_probe.append({n: getattr(result, n).clone() for n in ("jagg", "exact", "error")})

    loop = ProbedLoop(on_probe=keep)
    loop.train(5)
    assert loop.guard.probed == 5 and len(results) == 5
    for result, then in zip(results, at_probe):
        for name, value in then.items():
            assert torch.equal(getattr(result, name), value), name
    storages = {getattr(r, n).untyped_storage().data_ptr() for r in results for n in ("jagg", "exact")}
    assert len(storages) == 10                        # every kept result has vectors of its own


@pytest.mark.filterwarnings("ignore:jaggc guard. JAGG drifted")
def test_results_nobody_keeps_let_the_guard_reuse_its_vectors():
    loop = ProbedLoop()
    loop.train(2)
    held = [t.untyped_storage().data_ptr() for t in loop.guard.buffers.held]
    assert held
    loop.train(4)                                     # four more probes take no new vector
    assert loop.guard.probed == 6
    assert [t.untyped_storage().data_ptr() for t in loop.guard.buffers.held] == held
    assert loop.guard.buffer_bytes >= sum(t.numel() * 4 for t in loop.guard.buffers.held)


@pytest.mark.filterwarnings("ignore:jaggc. the trajectory ended", "ignore:jaggc. the guard's probe")
def test_a_stand_in_weight_is_named_by_the_probe():
    """A hook that computes a layer with a trainable copy of its weight (a stand-in): the parameter
    gets no gradient from the probe's backward, so the probe walks the graph and refuses, naming it,
    rather than measuring an error without that layer."""
    loop = ProbedLoop()
    layer = next(m for m in loop.model.modules() if isinstance(m, torch.nn.Linear))
    weight = layer.weight

    def swap(module, args):
        module._parameters["weight"] = weight.detach().clone().requires_grad_()

    def back(module, args, out):
        module._parameters["weight"] = weight

    layer.register_forward_pre_hook(swap)
    layer.register_forward_hook(back)
    with pytest.raises(jaggc.JaggUnsupportedError, match="not the DiT's parameters.*get no gradient"):
        loop.train(1)


@pytest.mark.filterwarnings("ignore:jaggc guard. JAGG drifted")
def test_the_gpu_form_probed_trains_as_unprobed():
    """Live bf16 autocast and train() inside each step, an SGD step after each trajectory: the probed
    loop's parameters are the unprobed loop's bit for bit (the probe hands nothing to .grad; both runs
    make the same calls on this CPU), its probes measured JAGG's error (cosine < 1, finite) and from
    the third probe on took no new vector."""
    probed, plain = ProbedLoop(gpu_form=True), ProbedLoop(guarded=False, gpu_form=True)
    probed.train(2)
    held = [t.untyped_storage().data_ptr() for t in probed.guard.buffers.held]
    probed.train(2)
    plain.train(4)
    for (name, a), b in zip(probed.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(a, b), name
    assert probed.guard.probed == 4 and [t.untyped_storage().data_ptr() for t in probed.guard.buffers.held] == held
    last = probed.guard.last
    assert math.isfinite(last.cosine) and last.cosine < 1 and last.rel_error > 0


def test_without_torch_s_storage_count_nothing_is_reused(monkeypatch):
    """The count is private torch API (_compat): where a torch lacks it, every vector is fresh, and
    the guard says so once."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    pool = FlatBuffers()
    a = pool.empty(8, torch.float32, CPU)
    ptr = a.data_ptr()
    del a
    with pytest.warns(UserWarning, match="no storage reference count.*fresh ones"):
        assert pool.empty(8, torch.float32, CPU).data_ptr() != ptr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.empty(8, torch.float32, CPU)                 # said once
