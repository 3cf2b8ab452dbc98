"""jaggc's own collectives: every tensor on the device its process group serves.

A process group's backend serves some device types only: gloo the CPU (and CUDA through host copies),
NCCL CUDA alone. torch refuses a tensor of another type (``No backend type associated with device type
cpu`` for a CPU tensor under NCCL), so the ranks' agreements of jaggc (steps/ranks.py, the guard's
runtime/guard_ranks.py and guard_stats.py, the probes) must make their tensors where the group's
backend runs, whatever the parameters' placement (FSDP's CPU offload keeps them on the CPU while its
collectives run on CUDA). ``served_device`` is that device, read from the group's backend config
(``cpu:gloo,cuda:nccl``, torch's default group on a GPU machine, serves both: the CPU is taken there,
since jaggc's agreements are host values, flags and counts, and a gloo all-reduce of them needs no
device copy or stream sync); ``agree`` is the one helper every agreement goes through: host values in,
one all-reduce, host values out (one host read per agreement, not one per element read).
``all_reduce_tensor`` reduces a tensor computed on another device (a guard's dot products on the
gradients' device) on the served device and brings the result back.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

_CPU = torch.device("cpu")


def served_device(group=None) -> torch.device:
    """The device whose tensors ``group``'s collectives take (module docstring): the CPU where the
    backend serves it, else the current device of the type it serves (NCCL: ``cuda:<current>``)."""
    return _served(dist.get_backend_config(group))


@functools.lru_cache(maxsize=None)
def _served_types(config: str) -> tuple[str, ...]:
    # "cpu:gloo,cuda:nccl" names each type with its backend; a bare "gloo" (torch < 2.2) serves the CPU
    if ":" not in config:
        return ("cpu",)
    return tuple(part.split(":")[0].strip() for part in config.split(","))


def _served(config: str) -> torch.device:
    types = _served_types(config)
    if "cpu" in types:
        return _CPU
    kind = types[0]
    module = getattr(torch, kind, None)
    current = getattr(module, "current_device", None)
    return torch.device(kind, current()) if callable(current) else torch.device(kind)


def serves(group, device: torch.device) -> bool:
    """Whether ``group``'s backend takes tensors on ``device``."""
    return torch.device(device).type in _served_types(dist.get_backend_config(group))


def agree(values: Sequence[float], op, *, group=None, dtype=torch.int64) -> list:
    """``values`` (host numbers) reduced over the ranks by ``op``: one all-reduce of a tensor on the
    served device, one host read of its result."""
    t = torch.tensor(list(values), dtype=dtype, device=served_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_tensor(t: torch.Tensor, op=None, *, group=None) -> torch.Tensor:
    """``t`` reduced over the ranks (in place where the group serves its device; otherwise through a
    copy on the served device, the result copied back into ``t``); returns ``t``."""
    op = dist.ReduceOp.SUM if op is None else op
    if serves(group, t.device):
        dist.all_reduce(t, op=op, group=group)
        return t
    moved = t.to(served_device(group))
    dist.all_reduce(moved, op=op, group=group)
    t.copy_(moved)
    return t


__all__ = ["agree", "all_reduce_tensor", "served_device", "serves"]
