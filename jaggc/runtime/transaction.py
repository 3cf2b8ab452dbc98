"""``atomic_step``: a training step that fails leaves ``.grad`` exactly as it was.

A trainer accumulating gradients over micro-batches wants a micro-batch whose step raises (a bad
input refused late, out of memory, a hook raising) to be skippable. Forward-time failures and
failures before the first parameter's gradient is accumulated lose nothing on their own; a failure
inside the last DiT backward, or in per-window mode after a window's nested backward, leaves the
parameters' gradients partly accumulated. That is plain autograd (the uncompiled per-step loss
does the same): ``AccumulateGrad`` writes ``.grad`` in place as the backward goes.

jaggc cannot undo that from inside ``loss.backward()`` without changing what the user's backward
means: wrapping the loss so its backward runs the real one nested (and can catch the failure)
fires every parameter's post-accumulate-grad hooks twice and makes ``torch.autograd.grad`` and
``backward(inputs=...)`` on the loss fail (prototyped; see the issue-8 report). So the step is
made atomic where the user's code is: snapshot the gradients that exist before the step, restore
them if it raises. The cost is one copy of the already-accumulated gradients per step (nothing on
the first micro-batch after ``zero_grad(set_to_none=True)``).

Under DDP/FSDP the restore is local to the rank: a backward that fails on one rank leaves the
other ranks waiting in that step's all-reduce (and DDP's reducer mid-iteration); failures raised
before the backward (jaggc's refusals) can be skipped if every rank skips that micro-batch.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn


def _leaves(targets: Iterable[nn.Module | torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for target in targets:
        tensors = target.parameters() if isinstance(target, nn.Module) else [target]
        for t in tensors:
            if t.requires_grad:
                seen.setdefault(id(t), t)
    return list(seen.values())


@contextlib.contextmanager
def atomic_step(*targets: nn.Module | torch.Tensor) -> Iterator[None]:
    """Run a training step (forward and backward) so that if it raises, the ``.grad`` of every
    parameter of ``targets`` (modules or tensors) is restored bit for bit::

        with jaggc.atomic_step(model):
            loss = compiled_loss(model, batch)
            accelerator.backward(loss)

    The exception is re-raised; the trainer can skip the micro-batch and go on.
    """
    leaves = _leaves(targets)
    saved = [(t, None if t.grad is None else t.grad.detach().clone()) for t in leaves]
    try:
        yield
    except BaseException:
        for t, grad in saved:
            if grad is None:
                t.grad = None
            elif t.grad is None or t.grad.shape != grad.shape:
                t.grad = grad
            else:
                # in place: keeps the .grad object that DDP buckets and optimizers may hold views of
                t.grad.detach().copy_(grad)
        raise
