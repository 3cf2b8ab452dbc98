"""No fake tensor leaves a capture: the loss a compiled function returns and the gradients its
backward writes are real.

Captures learn shapes by running ops on fake tensors. A fake value that escapes (a fake cast of a
parameter left in autocast's weight-cast cache, a fake example value baked into a graph) computes
nothing: the loss is a ``FakeTensor``, the parameters' ``.grad`` fake, and the first ``float(loss)``
raises far from the cause. These checks turn such a jaggc bug into a ``JaggInternalError`` at the
boundary: on every call for the returned value (a few ``isinstance`` checks), and once per new
graph for the gradients (at the end of its first backward).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._compat import is_fake, queue_backward_callback, tree_flatten
from ..errors import JaggInternalError


def check_real_output(out: Any, where: str) -> None:
    """Refuse a returned value that holds a fake tensor."""
    if any(is_fake(x) for x in tree_flatten(out)[0]):
        raise JaggInternalError(
            f"{where} returned a FakeTensor: a fake value of the capture leaked into the compiled graph. This is "
            f"a jaggc bug; run the loss with capture='intercept' (or uncompiled) meanwhile")


def check_real_grads_after_backward(out: Any, params: Iterable[torch.nn.Parameter], where: str) -> None:
    """At the end of the next backward through ``out``, refuse fake ``.grad`` on ``params``."""
    roots = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
    if not roots:
        return
    params = list(params)

    def check() -> None:
        fake = [i for i, p in enumerate(params) if p.grad is not None and is_fake(p.grad)]
        if fake:
            raise JaggInternalError(
                f"the backward of {where} wrote FakeTensors into the .grad of {len(fake)} parameter(s) (the first: "
                f"parameter {fake[0]}): a fake value of the capture leaked into the compiled graph. This is a jaggc "
                f"bug; run the loss with capture='intercept' (or uncompiled) meanwhile")

    def on_grad(grad):
        queue_backward_callback(check)
        return grad

    # on this call's output only: a later call of the same graph returns another tensor
    roots[0].register_hook(on_grad)
