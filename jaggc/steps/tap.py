"""The node a step's DiT output reaches the user's loss through: its values, and its gradient to jaggc.

A JAGG step hands the loop the DiT's output values (a knot's from its own forward with grad, an
interior step's from a no-grad forward), each floating leaf as an output of one ``StepTap`` node.
When the step's ``backward()`` reaches the node, it has the step's upstream gradients g_k (one
per leaf); it hands them to the step's sink and stops there: the DiT's own graph is not entered,
so the step costs no DiT backward. The sink runs the window's joint backward once every step of
the window has its g_k (``run.py``).

The node's input is an empty "anchor" that requires grad, only so that its outputs require grad;
the outputs own their storage (a loss may write into the DiT's output in place). Its other inputs
are the DiT's trainable parameters where no DDP/FSDP wrapper hooks their gradient accumulators
(``params``): their gradient is None in a ``backward()``, but ``torch.autograd.grad(loss, params)``
and ``backward(inputs=params)`` then reach the node too (without them the parameters are not in
the loss's graph, and torch refuses before jaggc sees the call), so that jaggc can refuse them by
name: the step's gradient reaches ``.grad`` only through its window's joint backward.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .._compat import tree_flatten, tree_unflatten


class StepTap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, sink, count, *values_and_params):
        ctx.sink, ctx.params = sink, len(values_and_params) - count
        ctx.set_materialize_grads(False)     # a leaf the loss does not use gets None, not zeros
        return tuple(v.clone() for v in values_and_params[:count])

    @staticmethod
    def backward(ctx, *grads):
        ctx.sink(grads)
        return (None, None, None) + (None,) * (len(grads) + ctx.params)


def float_leaves(output: Any) -> tuple[list, Any, list[int]]:
    """(leaves, spec, indices of the floating tensor leaves) of a DiT output."""
    leaves, spec = tree_flatten(output)
    index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return leaves, spec, index


def tap_output(output: Any, sink: Callable[[Sequence[torch.Tensor | None]], None],
               params: Sequence[torch.Tensor] = ()) -> tuple[Any, list[int]]:
    """``output`` with its floating leaves replaced by ``StepTap`` outputs (values unchanged,
    detached from the DiT's graph), and the indices of those leaves; ``params``: the node's other
    inputs (module docstring)."""
    leaves, spec, index = float_leaves(output)
    if not index:
        return output, index
    anchor = torch.empty(0, requires_grad=True)
    tapped = StepTap.apply(anchor, sink, len(index), *[leaves[i].detach() for i in index], *params)
    leaves = list(leaves)
    for i, v in zip(index, tapped):
        leaves[i] = v
    return tree_unflatten(leaves, spec), index


__all__ = ["StepTap", "float_leaves", "tap_output"]
