"""The tripwire on FSDP2's sharded gradients (jaggc/_compat/tripwire.py), on a one-rank gloo group.

torch's ``clip_grad_norm_`` of DTensor gradients bumps no version (of the DTensor or its shard) and, on
zero gradients or under its bound, changes no value: the ledger sees it only through the tripwire. Here:
FSDP2's own accumulation (its reduce-scatter's ``add_``) does not trip it; a clip (even with a factor of
1), a ``zero_``, a hand-written ``mul_``, a foreach zero do; the ledger's reads (``local_shard``) do not;
``lift`` puts the shard back, bit for bit.

Each check runs in its own Python process (this file run as a script): a process group initialised in a
pytest worker would stay behind in the ranks the two-rank tests fork from it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def _check(case: str) -> None:
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from jaggc._compat import TripFlag, lay_tripwire as lay, lift_tripwire as lift, local_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model)
        params = list(model.parameters())
        model(torch.randn(3, 4)).sum().backward()
        flag = TripFlag()
        assert all(lay(p.grad, flag) for p in params)
        assert not lay(params[0].grad, flag)                         # laid once
        if case == "accumulate_then_clip":
            before = [local_shard(p.grad).clone() for p in params]
            model(torch.randn(3, 4)).sum().backward()                # FSDP2 adds into the shards
            assert not flag.tripped
            assert all(type(p.grad._local_tensor) is not torch.Tensor for p in params)      # wrapped
            assert all(not torch.equal(local_shard(p.grad), b) for p, b in zip(params, before))
            torch.nn.utils.clip_grad_norm_(params, 1e9)              # a factor of 1: no value changes
            assert flag.tripped and flag.what
            after = [local_shard(p.grad).clone() for p in params]
            for p in params:
                lift(p.grad)
            assert all(type(p.grad._local_tensor) is torch.Tensor for p in params)
            assert all(torch.equal(local_shard(p.grad), a) for p, a in zip(params, after))
        else:
            with torch.no_grad():
                if case == "zero_":
                    params[1].grad.zero_()
                elif case == "mul_":
                    params[1].grad.mul_(0.5)
                else:
                    torch._foreach_zero_([p.grad for p in params])
            assert flag.tripped
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["accumulate_then_clip", "zero_", "mul_", "foreach_zero"])
def test_tripwire(case):
    done = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


if __name__ == "__main__":
    _check(sys.argv[1])
