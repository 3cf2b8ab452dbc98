"""The node a step's DiT output reaches the user's loss through: its values, and its gradient to jaggc.

A JAGG step hands the loop the DiT's output values (a knot's from its own forward with grad, an
interior step's from a no-grad forward), each floating leaf as an output of one ``StepTap`` node.
When the step's ``backward()`` reaches the node, it has the step's upstream gradients g_k (one
per leaf); it hands them to the step's sink and stops there: the DiT's own graph is not entered,
so the step costs no DiT backward. The sink runs the window's joint backward once every step of
the window has its g_k (``run.py``).

The node's input is an empty "anchor" that requires grad, only so that its outputs require grad;
the outputs own their storage (a loss may write into the DiT's output in place). Its other input,
where no DDP/FSDP wrapper hooks the parameters' gradient accumulators, is the trajectory's
``ParametersAnchor``: an empty tensor whose node has the DiT's trainable parameters as inputs. Their
gradient is None in a ``backward()``, but ``torch.autograd.grad(loss, params)`` and
``backward(inputs=params)`` then reach the tap too (without it the parameters are not in the loss's
graph, and ``allow_unused=True`` would hand back None with no word), so that jaggc can refuse them
by name: the step's gradient reaches ``.grad`` only through its window's joint backward. One such
node per trajectory, not the parameters as every tap's inputs: a custom function's call costs per
input (~0.3 ms per step at 122 parameter tensors, the largest part of jaggc's per-step work).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .._compat import tree_flatten, tree_unflatten


class StepTap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, sink, count, *values_and_parameters_anchor):
        ctx.sink, ctx.extra = sink, len(values_and_parameters_anchor) - count
        ctx.set_materialize_grads(False)     # a leaf the loss does not use gets None, not zeros
        return tuple(v.clone() for v in values_and_parameters_anchor[:count])

    @staticmethod
    def backward(ctx, *grads):
        ctx.sink(grads)
        return (None, None, None) + (None,) * (len(grads) + ctx.extra)


class ParametersAnchor(torch.autograd.Function):
    """An empty tensor whose node's inputs are the trainable parameters (module docstring); its
    gradient is always None, and so is what it hands them."""

    @staticmethod
    def forward(ctx, *params):
        ctx.count = len(params)
        ctx.set_materialize_grads(False)
        return params[0].new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * ctx.count


def parameters_anchor(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A ``ParametersAnchor`` of ``params``, None without any."""
    return ParametersAnchor.apply(*params) if params else None


def float_leaves(output: Any) -> tuple[list, Any, list[int]]:
    """(leaves, spec, indices of the floating tensor leaves) of a DiT output."""
    leaves, spec = tree_flatten(output)
    index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return leaves, spec, index


def tap_output(output: Any, sink: Callable[[Sequence[torch.Tensor | None]], None],
               params: torch.Tensor | None = None) -> tuple[Any, list[int]]:
    """``output`` with its floating leaves replaced by ``StepTap`` outputs (values unchanged,
    detached from the DiT's graph), and the indices of those leaves; ``params``: the trajectory's
    ``parameters_anchor`` (module docstring)."""
    leaves, spec, index = float_leaves(output)
    if not index:
        return output, index
    anchor = torch.empty(0, requires_grad=True)
    tapped = StepTap.apply(anchor, sink, len(index), *[leaves[i].detach() for i in index],
                           *(() if params is None else (params,)))
    leaves = list(leaves)
    for i, v in zip(index, tapped):
        leaves[i] = v
    return tree_unflatten(leaves, spec), index


__all__ = ["ParametersAnchor", "StepTap", "float_leaves", "parameters_anchor", "tap_output"]
