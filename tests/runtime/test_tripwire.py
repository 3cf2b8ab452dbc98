"""The tripwire on FSDP2's sharded gradients (jaggc/_compat/tripwire.py), on a one-rank gloo group.

torch's ``clip_grad_norm_`` of DTensor gradients bumps no version (of the DTensor or its shard) and, on
zero gradients or under its bound, changes no value: the ledger sees it only through the tripwire. Here:
FSDP2's own accumulation (its reduce-scatter's ``add_``) does not trip it; a clip (even with a factor of
1), a ``zero_``, a hand-written ``mul_`` do; the ledger's reads (``local_shard``) do not; ``lift`` puts the
shard back, bit for bit.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from jaggc._compat import TripFlag, lay_tripwire as lay, lift_tripwire as lift, local_shard


@pytest.fixture
def fsdp2_model():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model)
        yield model
    finally:
        dist.destroy_process_group()


def _backward(model):
    model(torch.randn(3, 4)).sum().backward()


def test_fsdp2_accumulation_passes_a_clip_trips(fsdp2_model):
    model = fsdp2_model
    params = list(model.parameters())
    _backward(model)
    flag = TripFlag()
    assert all(lay(p.grad, flag) for p in params)
    assert not lay(params[0].grad, flag)                             # laid once
    before = [local_shard(p.grad).clone() for p in params]
    _backward(model)                                                 # FSDP2 adds into the shards
    assert not flag.tripped
    assert all(type(p.grad._local_tensor) is not torch.Tensor for p in params)      # wrapped
    assert all(not torch.equal(local_shard(p.grad), b) for p, b in zip(params, before))
    torch.nn.utils.clip_grad_norm_(params, 1e9)                      # a factor of 1: no value changes
    assert flag.tripped and flag.what
    after = [local_shard(p.grad).clone() for p in params]
    for p in params:
        lift(p.grad)
    assert all(type(p.grad._local_tensor) is torch.Tensor for p in params)
    assert all(torch.equal(local_shard(p.grad), a) for p, a in zip(params, after))


@pytest.mark.parametrize("write", ["zero_", "mul_", "foreach_zero"])
def test_other_writes_trip(fsdp2_model, write):
    model = fsdp2_model
    params = list(model.parameters())
    _backward(model)
    flag = TripFlag()
    for p in params:
        lay(p.grad, flag)
    with torch.no_grad():
        if write == "zero_":
            params[1].grad.zero_()
        elif write == "mul_":
            params[1].grad.mul_(0.5)
        else:
            torch._foreach_zero_([p.grad for p in params])
    assert flag.tripped
    for p in params:
        lift(p.grad)
