"""The batched DiT forwards a window runs, shared by the joint, per-window and routed modes.

``forward_batched`` runs several steps as one call on their batch-concatenated inputs;
``nograd_outputs`` gives the no-grad outputs of a window's steps, ``chunk`` steps per forward,
taking each step from the rollout cache first when one is given (the on-policy fast path), so
every mode that needs no-grad values gets the cache the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from ..errors import JaggInputError
from .calls import DitCall, concat_calls, split_output

if TYPE_CHECKING:
    from .rollout_cache import RolloutCache


def forward_batched(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int], time_arg,
                    unbatched: Sequence[str]) -> Any:
    return concat_calls(calls, time_arg, steps=steps, unbatched=unbatched)(dit)


def nograd_outputs(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int], *, time_arg, batch: int,
                   chunk: int | None, unbatched: Sequence[str], cache: RolloutCache | None = None) -> dict[int, Any]:
    """No-grad outputs of ``calls``, keyed by position: from ``cache`` where it has them, the rest
    in batched forwards of at most ``chunk`` steps (None: all at once)."""
    positions = list(range(len(calls)))
    chunk = chunk or max(len(positions), 1)
    if chunk < 1:
        raise JaggInputError(f"interior_chunk={chunk} must be a positive number of steps")
    outs: dict[int, Any] = {}
    if cache is not None:
        for p in positions:
            cached = cache.lookup(calls[p])
            if cached is not None:
                outs[p] = cached
        positions = [p for p in positions if p not in outs]
    with torch.no_grad():
        outs.update(chunked_outputs(dit, calls, steps, positions, time_arg=time_arg, batch=batch, chunk=chunk,
                                    unbatched=unbatched))
    return outs


def chunked_outputs(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int], positions: Sequence[int], *,
                    time_arg, batch: int, chunk: int, unbatched: Sequence[str]) -> dict[int, Any]:
    """Outputs of the calls at ``positions`` in batched forwards of ``chunk`` steps, in the grad
    mode in force (the no-grad interior forwards; the guard's probe runs the same with grad)."""
    outs: dict[int, Any] = {}
    for lo in range(0, len(positions), chunk):
        pos = positions[lo:lo + chunk]
        out = forward_batched(dit, [calls[p] for p in pos], [steps[p] for p in pos], time_arg, unbatched)
        for p, o in zip(pos, split_output(out, len(pos), batch)):
            outs[p] = o
    return outs
