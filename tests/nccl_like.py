"""A process group that, like NCCL, serves one non-CPU device type only, on CPU-only gloo ranks.

NCCL takes CUDA tensors only: a CPU tensor in one of its collectives is ``RuntimeError: No backend
type associated with device type cpu``. Here no rank has a GPU, so ``nccl_like()`` makes the ranks'
gloo group look and act as such a group for jaggc's own collectives:

- ``torch.distributed.get_backend_config`` reads ``meta:nccl`` (what a group reports; NCCL's reads
  ``cuda:nccl``): the group serves the stand-in device (tests/device_standin.py) and nothing else;
- a collective called from a frame of jaggc (``torch.distributed.all_reduce``, ``broadcast``,
  ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``) with a tensor that is not a
  stand-in raises NCCL's error; a stand-in's CPU data goes through the real gloo collective, in place;
- factories asked for the stand-in device make stand-ins (``on_standin_device``).

The engines' own collectives (DDP's reducer in C++, FSDP's, DeepSpeed's, the loop's own
``all_reduce`` of its loss) are the CPU's, as the parameters are: only what jaggc adds is checked.
``calls`` counts jaggc's checked collectives by name, so a test can assert that they ran.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

import jaggc
from device_standin import StandIn, on_standin_device

JAGGC_DIR = str(Path(jaggc.__file__).resolve().parent)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
SERVED = "meta:nccl"


def _from_jaggc() -> bool:
    return sys._getframe(2).f_code.co_filename.startswith(JAGGC_DIR)


def _unwrapped(name: str, value):
    if isinstance(value, StandIn):
        return value.data_cpu
    if isinstance(value, list):
        return [_unwrapped(name, v) for v in value]
    if hasattr(value, "device") and hasattr(value, "dim"):
        raise RuntimeError(f"No backend type associated with device type {value.device.type} "
                           f"(dist.{name} from jaggc on a group that serves {SERVED})")
    return value


@contextlib.contextmanager
def nccl_like() -> Iterator[Counter]:
    calls: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES + ("get_backend_config",)}

    def checked(name):
        real = originals[name]

        def collective(*args, **kwargs):
            if not _from_jaggc():
                return real(*args, **kwargs)
            calls[name] += 1
            args = [_unwrapped(name, a) for a in args]
            kwargs = {k: _unwrapped(name, v) for k, v in kwargs.items()}
            return real(*args, **kwargs)
        return collective

    def backend_config(group=None):
        return SERVED

    try:
        for name in COLLECTIVES:
            setattr(dist, name, checked(name))
        dist.get_backend_config = backend_config
        with on_standin_device():
            yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


__all__ = ["nccl_like"]
