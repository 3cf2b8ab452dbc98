"""The low-memory mode's gradient buffer under FSDP: sharded like the gradient, filled by FSDP.

``backward="lowmem"`` runs every window's joint backward but the last inside the loss's forward
(lowmem.py). Without FSDP that backward is ``torch.autograd.grad`` over the DiT's parameters, into
a buffer of one gradient. Under FSDP it cannot be: autograd never sees the parameters FSDP
registers (FSDP2's sharded DTensors, FSDP1's original parameters with ``use_orig_params=True``;
it sees the gathered copies), and FSDP's own hooks must run (they gather the parameters again,
recompute checkpointed blocks and reduce-scatter). So a finished window here is

  1. ``stash``: every gradient FSDP holds (the user's, from earlier micro-steps) is set aside;
  2. ``torch.autograd.backward(knot outputs, composites)``: FSDP's normal backward, which leaves
     this window's gradient reduce-scattered in FSDP's own storage (its rank's shard);
  3. ``take`` that gradient into the buffer (added to the earlier windows'), ``restore`` the user's.

When ``loss.backward()`` has finished (FSDP's final callbacks included), ``grad_output`` times the
buffer is added to what FSDP holds: the last window's gradient and the user's. GradScaler scales
and accumulation factors apply to every window, and ``.grad`` is touched only by that backward.

Per rank: the buffer is one shard of the gradient (1/world of it, with FSDP's padding), and each
window reduce-scatters once per FSDP unit (FSDP1) or parameter group (FSDP2): a gradient summed
over windows before the reduce-scatter would be a full unsharded gradient per rank, which is what
FSDP exists to avoid. Inside the user's own ``no_sync()`` / ``set_requires_gradient_sync(False)``
micro-steps FSDP keeps unsharded gradients and communicates nothing, and so does this buffer.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .._compat import GradSlot, run_after_backward
from ..errors import JaggUnsupportedError
from .engines import engine_of
from .memory import storage_bytes
from .param_grads import check_graph_leaves

_FIX = ("Under FSDP every trainable parameter of the DiT must be managed by FSDP: wrap the root module "
        "too (FullyShardedDataParallel(model, auto_wrap_policy=...) / fully_shard(model) after the blocks)")


class ShardedGradBuffer:
    """The windows' gradients, per FSDP gradient storage, until ``loss.backward()`` (module
    docstring)."""

    def __init__(self, dit: nn.Module):
        self.slots: list[GradSlot] = engine_of(dit).gradient_slots(dit)
        self.buffer: list[torch.Tensor | None] = [None] * len(self.slots)
        self.added = False

    @property
    def buffer_bytes(self) -> int:
        return storage_bytes(self.buffer)

    def backward(self, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], *, what: str) -> None:
        """One window's backward through FSDP, its gradient added to the buffer."""
        # every trainable tensor the graph reaches must be one FSDP accumulates into: a gradient
        # outside FSDP's storage would be written to .grad now, unscaled (or dropped, for a stand-in)
        check_graph_leaves(roots, [slot.graph_leaf() for slot in self.slots], what=what, fix=_FIX)
        stashed = [slot.stash() for slot in self.slots]
        try:
            torch.autograd.backward(list(roots), list(grads))
            for j, slot in enumerate(self.slots):
                g = slot.take()
                if g is not None:
                    self.buffer[j] = g if self.buffer[j] is None else self.buffer[j].add_(g)
        finally:
            for slot, saved in zip(self.slots, stashed):
                slot.restore(saved)

    def add_after_backward(self, scale: torch.Tensor) -> None:
        """From inside ``loss.backward()``: add ``scale`` x buffer once it has finished, then free
        the buffer (so a second backward of the same loss is refused: it would find it gone)."""
        if self.added:
            raise JaggUnsupportedError(
                "a backward='lowmem' loss under FSDP was backpropagated twice (retain_graph=True): its windows' "
                "gradients were added to FSDP's gradients by the first backward and freed. Use backward='joint' "
                "to backpropagate the same loss more than once")
        self.added = True
        if not any(b is not None for b in self.buffer):
            return

        def add():
            alpha = float(scale)   # one host sync per loss
            for slot, b in zip(self.slots, self.buffer):
                if b is not None:
                    slot.add(b, alpha)
            self.buffer = [None] * len(self.slots)

        run_after_backward(add)
