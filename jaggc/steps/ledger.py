"""What jaggc must notice between a trainer's steps: parameters and ``.grad`` changed by someone else.

A window's joint backward runs when its last step's gradient arrives; until then its earlier steps
have contributed nothing to ``.grad``, and its knot graphs hold the parameters they were computed
with. So between two steps of an open window nothing may change the parameters (a knot's graph
would backpropagate through other values than its forward saw, an interior step re-run would
compute another function) or ``.grad`` (a ``zero_grad`` drops the earlier steps' gradient in the
unchanged loop; a ``clip_grad_norm_`` or a GradScaler's ``unscale_`` reads a gradient that lacks
them). The ledger keeps the state both were in after the last thing jaggc saw, and says what
changed since:

* parameters: each one's in-place version and storage (an optimizer step, ``p.add_``,
  ``load_state_dict``). A write through ``p.data`` bumps no version and is not seen;
* ``.grad``: each trainable parameter's gradient tensor identity and version. Gradients that all
  became None (``zero_grad()``, torch's default ``set_to_none=True``) or were all zeroed in place
  (``set_to_none=False``) are a ``zero_grad``; any other change is a foreign write (a clip or a
  GradScaler's unscale scales every gradient in place, another tensor put in a ``.grad``). A backward of a step jaggc runs exactly (its own
  DiT graph, ``mark_exact_backward``) also writes ``.grad``: until the next snapshot nothing is
  concluded from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._compat import version_counter


@dataclass(frozen=True)
class GradChange:
    """What happened to ``.grad`` since the last snapshot: ``reset`` (a zero_grad) or ``written``
    (an in-place write that is no zero_grad), with the first parameter it was seen on."""

    kind: str
    name: str


class Ledger:
    def __init__(self, module: nn.Module):
        self.named = list(module.named_parameters())
        self.trainable = [(n, p) for n, p in self.named if p.requires_grad]
        self.params = self._param_state()
        self.grads = self._grad_state()
        self.exact_backward = False       # a step's own DiT backward may have written .grad since

    def _param_state(self):
        return [(version_counter(p), _local(p).data_ptr()) for _, p in self.named]

    def _grad_state(self):
        return [None if p.grad is None else (id(p.grad), version_counter(p.grad)) for _, p in self.trainable]

    def snapshot(self) -> None:
        """Accept the parameters and gradients as they are now."""
        self.params = self._param_state()
        self.grads = self._grad_state()
        self.exact_backward = False

    def snapshot_grads(self) -> None:
        self.grads = self._grad_state()
        self.exact_backward = False

    def mark_exact_backward(self) -> None:
        self.exact_backward = True

    def changed_parameter(self) -> str | None:
        """The name of the first parameter written since the snapshot, or None."""
        now = self._param_state()
        return next((n for (n, _), a, b in zip(self.named, self.params, now) if a != b), None)

    def grad_change(self) -> GradChange | None:
        """How ``.grad`` changed since the snapshot (module docstring), or None; None also when a
        step's own backward may have written it (nothing can be concluded then). A ``zero_grad``
        empties every gradient it touches; anything else that wrote one (a clip scales them all,
        zero ones included) is a foreign write."""
        if self.exact_backward:
            return None
        changed = []
        for (name, p), before in zip(self.trainable, self.grads):
            now = None if p.grad is None else (id(p.grad), version_counter(p.grad))
            if now != before:
                changed.append((name, p, before, now))
        if not changed:
            return None
        for name, p, before, now in changed:
            emptied = now is None or (before is not None and now[0] == before[0] and not bool(_local(p.grad).any()))
            if not emptied:
                return GradChange("written", name)
        return GradChange("reset", changed[0][0])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's sharded parameters and gradients) local shard, else the tensor: each
    rank checks its own shard, with no collective."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


__all__ = ["GradChange", "Ledger"]
