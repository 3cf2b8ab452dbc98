"""The CFG slice: a step's DiT call runs with grad only on the row blocks that carry gradient.

Flow-GRPO trains with classifier-free guidance as ONE DiT call on ``[uncond; cond]`` (batch 2B)
and detaches the uncond half of the output: that half's cotangent is exactly zero, yet the call's
backward (and its saved activations) covers both halves. The whole-loss path sees the ``.detach()``
in the graph (passes/split_batch.py); a per-step loop shows jaggc nothing but the call, so the
slice is learned from the cotangents themselves:

* a call whose batch is ``count`` >= 2 times the declared batch (``plan.match`` tiles the
  declaration the same way) has ``count`` row blocks of the declared batch each;
* every step's upstream gradient is observed per block (``SliceLearner.observe``: one elementwise
  test on the device; the blocks' flags are read once, when the trajectory ends);
* a block whose cotangent was exactly zero at every observed step of the last trajectory runs
  without grad from the next trajectory on (``rule``): a knot's and an exact step's call becomes
  a no-grad call on those rows (which the rollout cache may serve) and a call with grad on the
  others, whose outputs are put back together in row order (``assemble``), so the loop sees the
  output of the whole batch; only the rows with grad are held and backpropagated;
* a cotangent that later arrives nonzero on a block run without grad is recovered exactly: the
  block re-runs with grad inside the step's (or window's) backward (run.py), counted and warned
  once; the observation of that trajectory then turns the rule off.

A DiT never mixes samples across the batch, so the rows' values are the unsplit call's up to the
roundoff a smaller batch may bring (different kernel blocking), and the gradient is the same: the
rows run without grad had a zero cotangent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .._compat import tree_flatten, tree_unflatten
from ..runtime.calls import DitCall, batch_size

Runs = tuple[tuple[int, int], ...]          # (start, stop) row ranges, in row order


@dataclass(frozen=True)
class RowSlice:
    """Which row blocks of a call of ``block * count`` rows run with grad."""

    block: int                     # rows per block (the declared batch)
    count: int                     # blocks per call
    no_grad: tuple[int, ...]       # the blocks that run without grad

    @property
    def batch(self) -> int:
        return self.block * self.count

    def runs(self, grad: bool) -> Runs:
        """Contiguous row ranges of the blocks with (``grad``) or without gradient."""
        blocks = [i for i in range(self.count) if (i in self.no_grad) != grad]
        out: list[list[int]] = []
        for i in blocks:
            if out and out[-1][1] == i * self.block:
                out[-1][1] = (i + 1) * self.block
            else:
                out.append([i * self.block, (i + 1) * self.block])
        return tuple((a, b) for a, b in out)

    def describe(self) -> str:
        kept = [i for i in range(self.count) if i not in self.no_grad]
        return (f"calls of batch {self.batch}: row block(s) {list(self.no_grad)} of {self.count} without grad, "
                f"{kept} with grad")


def take_rows(x: Any, runs: Runs, batch: int) -> Any:
    """``x`` (a tensor) restricted to ``runs`` along dim 0 if it is batched (leading dim ``batch``);
    anything else as it is. One run is a view."""
    if not (isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == batch):
        return x
    parts = [x[a:b] for a, b in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def call_rows(call: DitCall, runs: Runs, unbatched: Sequence[str] = ()) -> DitCall:
    """The call on the rows in ``runs``: every batched tensor input sliced (a tensor named in
    ``unbatched``, Flux's position ids, is shared and kept)."""
    batch = batch_size(call)
    kwargs = {k: v if k in unbatched else take_rows(v, runs, batch) for k, v in call.kwargs.items()}
    return DitCall(tuple(take_rows(a, runs, batch) for a in call.args), kwargs)


def assemble(pieces: Sequence[tuple[Runs, Any]]) -> Any:
    """One output of ``batch`` rows from outputs of calls on row ranges (``(runs, output)``; the
    runs together cover every row once): each batched leaf put back in row order."""
    flats = [(runs, *tree_flatten(out)) for runs, out in pieces]
    spec = flats[0][2]
    rows = sum(b - a for a, b in flats[0][0])
    leaves = []
    for i, first in enumerate(flats[0][1]):
        if not isinstance(first, torch.Tensor) or first.ndim == 0 or first.shape[0] != rows:
            leaves.append(first)        # not batched (a shared output): every piece's is the same
            continue
        chunks = []
        for runs, flat, _ in flats:
            offset = 0
            for a, b in runs:
                chunks.append((a, flat[i][offset:offset + b - a]))
                offset += b - a
        leaves.append(torch.cat([c for _, c in sorted(chunks, key=lambda c: c[0])]))
    return tree_unflatten(leaves, spec)


def block_flags(grad: torch.Tensor, block: int, count: int) -> torch.Tensor:
    """(count,) bool on the gradient's device: whether each row block has a nonzero (or NaN) entry."""
    return (grad.reshape(count, block, -1) != 0).flatten(1).any(1)


@dataclass
class _Observation:
    nonzero: torch.Tensor | None = None       # (count,) bool, OR over the observed steps
    steps: int = 0
    sliceable: bool = True                    # every observed leaf carried the batch first


@dataclass
class SliceLearner:
    """Learns, per call batch, which row blocks carry no gradient (module docstring)."""

    rules: dict[tuple[int, int], RowSlice] = field(default_factory=dict)     # (call batch, declared) -> slice
    declared: int = 0                          # the batch the running trajectory declared
    _seen: dict[int, _Observation] = field(default_factory=dict)

    def begin(self, declared_batch: int) -> None:
        """A trajectory with ``declared_batch`` samples starts: its observations start empty."""
        self.declared = declared_batch
        self._seen = {}

    def rule(self, call_batch: int) -> RowSlice | None:
        """The slice a call of ``call_batch`` rows runs with in this trajectory, or None."""
        return self.rules.get((call_batch, self.declared))

    def observe(self, call_batch: int, grad: torch.Tensor | None) -> None:
        """One output leaf's upstream gradient of a call of ``call_batch`` rows (None: zero)."""
        declared = self.declared
        if declared < 1 or call_batch % declared or call_batch // declared < 2:
            return
        seen = self._seen.setdefault(call_batch, _Observation())
        if grad is None:
            return
        if grad.ndim == 0 or grad.shape[0] != call_batch:
            seen.sliceable = False
            return
        flags = block_flags(grad.detach(), declared, call_batch // declared)
        seen.nonzero = flags if seen.nonzero is None else seen.nonzero | flags
        seen.steps += 1

    def end(self) -> None:
        """The trajectory ended with every observed step's gradient: learn its rules (one host
        read per call batch)."""
        for call_batch, seen in self._seen.items():
            key = (call_batch, self.declared)
            count = call_batch // self.declared
            zero = () if seen.nonzero is None else tuple(i for i, f in enumerate(seen.nonzero.tolist()) if not f)
            if not seen.sliceable or seen.steps == 0 or not zero or len(zero) == count:
                self.rules.pop(key, None)       # nothing to save, or no block trains at all
            else:
                self.rules[key] = RowSlice(self.declared, count, zero)
        self._seen = {}

    def discard(self) -> None:
        """The trajectory was dropped: what it showed is not evidence."""
        self._seen = {}


__all__ = ["RowSlice", "SliceLearner", "assemble", "block_flags", "call_rows", "take_rows"]
