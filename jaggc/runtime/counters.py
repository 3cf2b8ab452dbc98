"""Count DiT forward and backward passes (and their batch sizes) with module hooks.

A DiT backward pass is counted when autograd computes the gradient of a grad-enabled DiT output,
i.e. when a backward enters the DiT's graph. This is what the tests and reports mean by
"one joint DiT backward per window".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .._compat import tree_flatten


@dataclass
class PassCounts:
    grad_forwards: int = 0
    nograd_forwards: int = 0
    backwards: int = 0
    grad_forward_batches: list[int] = field(default_factory=list)
    nograd_forward_batches: list[int] = field(default_factory=list)
    backward_batches: list[int] = field(default_factory=list)

    @property
    def backward_samples(self) -> int:
        return sum(self.backward_batches)


def _batch_of(output) -> int:
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.ndim > 0]
    return leaves[0].shape[0] if leaves else 0


@contextlib.contextmanager
def count_dit_passes(dit: nn.Module):
    """Yields a PassCounts that is filled while the context is open. On a module with
    ``jaggc.stepwise`` installed it sees the loop's calls, each step's output with grad and its
    backward, not the passes jaggc runs for them: ``jaggc.stepwise(module).counts`` has those."""
    counts = PassCounts()

    def on_forward(module, args, kwargs, output):
        b = _batch_of(output)
        grad_leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        if not grad_leaves:
            counts.nograd_forwards += 1
            counts.nograd_forward_batches.append(b)
            return
        counts.grad_forwards += 1
        counts.grad_forward_batches.append(b)
        fired = [False]

        def on_grad(grad):
            # several output leaves can belong to one pass: count the pass once
            if not fired[0]:
                fired[0] = True
                counts.backwards += 1
                counts.backward_batches.append(b)
            return grad

        for leaf in grad_leaves:
            leaf.register_hook(on_grad)

    on_forward._jaggc_observer = True   # module_state ignores it: it changes no output
    handle = dit.register_forward_hook(on_forward, with_kwargs=True)
    try:
        yield counts
    finally:
        handle.remove()
