"""The rollout's passes: which recorded rows are one sample at its other timesteps.

Off-policy serving (first_order.py) corrects an interior step's recorded output by its window's knots'
change since the recording, so it needs, for each sample of a training call, the recording's rows of
the SAME sample at the knots' timesteps: their outputs then, and their inputs, to compute the knots'
outputs now before the loop reaches them. A sampler makes one pass per batch: T consecutive calls of
the DiT whose conditioning is the same tensors throughout and whose timesteps fall, row i of every
call being sample i. ``PassIndex`` rebuilds the passes from the recorded calls: a call continues the
latest pass with the same conditioning (every tensor input but the state and the timestep, by
identity, and every other argument by value) whose timestep is above its own, else starts a pass.
Rows of a training call are found by fingerprint (rollout_cache.py); the same sample at another
timestep is then the row at the same position of the pass's call at that timestep. Two passes of the
same conditioning interleaved (a call either could continue) are not linked at all.

What cannot be linked is not served: a row whose pass has no call at the knot's timestep, or two
calls of one pass at it (``knot_rows`` returns None, and the step runs its forward). The index holds
the recorded calls' inputs (references to the sampler's tensors, no copy): a pass of a batch of B
samples over T steps holds the T state tensors the sampler made, as many bytes as the trainer's own
stored trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import tree_flatten
from .calls import DitCall, get_time


@dataclass
class RecordedCall:
    call: DitCall            # the call as the sampler made it (its tensors referenced, not copied)
    first_row: int           # its first row's index in its table
    times: list[float]       # per row, the timestep
    pass_id: int


@dataclass
class PassIndex:
    """The passes of one table of recorded rows (module docstring)."""

    time_arg: str | int
    state_arg: str | int
    calls: list[RecordedCall] = field(default_factory=list)
    _open: dict = field(default_factory=dict)      # conditioning key -> {pass id: its last call's times}
    _passes: int = 0
    _ambiguous: set = field(default_factory=set)   # passes a call could not be told apart between

    def add(self, call: DitCall, first_row: int, batch: int) -> None:
        """Index a recorded call whose rows start at ``first_row`` (one host read of its timesteps)."""
        t = get_time(call, self.time_arg)
        times = (t.detach().reshape(-1).to(device="cpu", dtype=torch.float64).tolist()
                 if isinstance(t, torch.Tensor) else [float(t)])
        times = times * batch if len(times) == 1 else times
        key = self._conditioning(call)
        opened = self._open.setdefault(key, {})          # pass id -> its last call's times
        takers = [p for p, last in opened.items() if len(last) == len(times) and min(last) > max(times)]
        if not takers:
            pass_id, self._passes = self._passes, self._passes + 1
        else:
            pass_id = takers[-1]
            if len(takers) > 1:
                # two passes of one conditioning interleaved: which one this call continues is unknown
                self._ambiguous.update(takers)
        opened[pass_id] = times
        self.calls.append(RecordedCall(call, first_row, times, pass_id))

    def knot_rows(self, rows: list[int], knot_times: list[float], rtol: float = 1e-6) -> list[int] | None:
        """For each recorded row in ``rows`` (a training call's matched rows, in its order), the row of
        the same sample at ``knot_times[i]`` (that row's timestep at the knot), or None if any is not
        linked (module docstring)."""
        out = []
        for row, t in zip(rows, knot_times):
            found = self._locate(row)
            if found is None:
                return None
            recorded, position = found
            if recorded.pass_id in self._ambiguous:
                return None
            same = [c for c in self.calls if c.pass_id == recorded.pass_id and position < len(c.times)
                    and abs(c.times[position] - t) <= rtol * max(abs(t), 1e-3)]
            if len(same) != 1:
                return None
            out.append(same[0].first_row + position)
        return out

    def call_of_rows(self, rows: list[int], unbatched: tuple[str, ...]) -> DitCall | None:
        """One call whose row i is recorded row ``rows[i]``'s inputs (the rows stacked per argument;
        an unbatched argument, or one the rows share, taken once), or None if the rows' calls differ
        in structure."""
        located = [self._locate(r) for r in rows]
        if any(x is None for x in located):
            return None
        first = located[0][0].call
        flat0, spec = tree_flatten((first.args, first.kwargs))
        per_call = [tree_flatten((c.call.args, c.call.kwargs)) for c, _ in located]
        if any(s != spec for _, s in per_call):
            return None
        batch = len(located[0][0].times)
        names = [None] * len(flat0)
        if isinstance(first.kwargs, dict):
            # which flat slot is which keyword (for the unbatched names)
            for name, value in first.kwargs.items():
                for i, leaf in enumerate(flat0):
                    if leaf is value:
                        names[i] = name
        leaves = []
        for i, leaf in enumerate(flat0):
            rowwise = (isinstance(leaf, torch.Tensor) and leaf.ndim >= 1 and leaf.shape[0] == batch
                       and names[i] not in unbatched)
            if not rowwise:
                leaves.append(leaf)
                continue
            leaves.append(torch.stack([flat[i][pos] for (flat, _), (_, pos) in zip(per_call, located)]))
        args, kwargs = _unflatten(leaves, spec)
        return DitCall(tuple(args), dict(kwargs))

    def _locate(self, row: int) -> tuple[RecordedCall, int] | None:
        for c in reversed(self.calls):           # a row recorded again is found at its latest recording
            if c.first_row <= row < c.first_row + len(c.times):
                return c, row - c.first_row
        return None

    def _conditioning(self, call: DitCall) -> tuple:
        """The call's inputs but its state and timestep: tensors by identity, the rest by value."""
        parts = []
        for name, value in [*enumerate(call.args), *sorted(call.kwargs.items())]:
            if name in (self.time_arg, self.state_arg):
                continue
            for leaf in tree_flatten(value)[0]:
                parts.append((name, _leaf_key(leaf)))
        return tuple(parts)


#: a tensor input of at most this many elements is a pass's by value (a guidance scale or position ids
#: a sampler makes anew each step), a larger one by identity (the prompt embeddings it makes once)
SMALL = 1024


def _leaf_key(leaf) -> tuple:
    if not isinstance(leaf, torch.Tensor):
        return ("value", repr(leaf))
    if leaf.numel() <= SMALL:
        return ("small", leaf.dtype, tuple(leaf.shape), tuple(leaf.detach().reshape(-1).tolist()))
    return ("tensor", id(leaf))


def shifted_call(call: DitCall, shift: int) -> DitCall | None:
    """``call`` with each input that is one index of a stored tensor's step axis (``latents[:, j]``,
    ``timesteps[:, j]``: a view of its root along one axis) moved ``shift`` indices along it; the inputs
    that are no such view (the conditioning) kept. None where an input's axis is ambiguous or the index
    leaves the root. The loop's own call of the other step is then checked against it (its rows must be
    the ones this call found in the recording), so a loop that indexes its stored steps otherwise is
    caught, not served."""
    flat, spec = tree_flatten((call.args, call.kwargs))
    out = []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf._base is not None:
            leaf = _shifted_view(leaf, shift)
            if leaf is None:
                return None
        out.append(leaf)
    args, kwargs = _unflatten(out, spec)
    return DitCall(tuple(args), dict(kwargs))


def _shifted_view(view: torch.Tensor, shift: int) -> torch.Tensor | None:
    root = view._base
    if root.ndim != view.ndim + 1:
        return None
    delta = view.storage_offset() - root.storage_offset()
    axes = [d for d in range(root.ndim)
            if tuple(root.shape[:d] + root.shape[d + 1:]) == tuple(view.shape)
            and tuple(root.stride()[:d] + root.stride()[d + 1:]) == tuple(view.stride())
            and root.stride(d) > 0 and delta % root.stride(d) == 0 and 0 <= delta // root.stride(d) < root.shape[d]]
    if len(axes) != 1:
        return None
    d = axes[0]
    index = delta // root.stride(d) + shift
    if not 0 <= index < root.shape[d]:
        return None
    return root.select(d, index)


def _unflatten(leaves: list[Any], spec):
    from .._compat import tree_unflatten

    return tree_unflatten(leaves, spec)


__all__ = ["PassIndex", "RecordedCall", "shifted_call"]
