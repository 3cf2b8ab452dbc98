"""Parameter gradients that are never silently dropped.

``torch.autograd.grad(outputs, params, allow_unused=True)`` returns None for a parameter the graph
does not reach, and a caller reads None as "unused". That is right for a parameter the DiT does not
use, and silently wrong when the graph reaches a *different* trainable tensor standing in for it:
FSDP2's gathered copies of its sharded parameters, FSDP1's FlatParameter behind the original
parameters with ``use_orig_params=True``, a weight swapped by a hook or a parametrization. The
gradient that belongs to the parameter then goes to the stand-in, which nobody asked for.

The rule here: the trainable leaves of the graph (its AccumulateGrad nodes) must all be tensors the
caller accounts for. ``check_graph_leaves`` walks the graph from the outputs and raises, naming the
stand-ins and the parameters left without a gradient; ``parameter_grads`` is ``torch.autograd.grad``
with that check. For the outputs of DiT calls every trainable leaf is the DiT's (its inputs are
detached stored data), so the check runs on every call (a walk over the graph's nodes, small next
to the backward it precedes); for a loss, which may also read other trainable tensors, only when
some parameter got None. The guard's probes take the second rule for their DiT outputs too: a
stand-in takes its parameter's gradient, so that parameter gets None and the walk runs; a probe
would otherwise walk every window's graph in Python, on every probed trajectory.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..errors import JaggUnsupportedError


def graph_leaves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable leaves the graph of ``outputs`` reaches (its AccumulateGrad nodes' tensors)."""
    leaves = [t for t in outputs if t.grad_fn is None and t.requires_grad]
    seen, stack = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)     # what an AccumulateGrad node accumulates into
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(fn for fn, _ in node.next_functions)
    return leaves


def check_graph_leaves(outputs: Sequence[torch.Tensor], accounted: Iterable[torch.Tensor], *, what: str,
                       missing: Sequence[str] = (), fix: str = "") -> None:
    """Raise if the graph of ``outputs`` has a trainable leaf outside ``accounted`` (module
    docstring). ``missing``: names of the parameters that got no gradient, for the message."""
    known = {id(t) for t in accounted}
    stand_ins = [t for t in graph_leaves(outputs) if id(t) not in known]
    if not stand_ins:
        return
    shapes = sorted({tuple(t.shape) for t in stand_ins})
    lost = (f"; {len(missing)} trainable parameter(s) get no gradient ({', '.join(missing[:5])}"
            f"{' and more' if len(missing) > 5 else ''})" if missing else "")
    raise JaggUnsupportedError(
        f"{what}: the graph computes with {len(stand_ins)} trainable tensor(s) that are not the DiT's "
        f"parameters (shapes {shapes[:4]}{' ...' if len(shapes) > 4 else ''}){lost}: a wrapper or hook "
        f"substitutes them for the parameters (a swapped weight, a parametrization, FSDP's gathered "
        f"copies), so their gradient would be dropped instead of reaching .grad. "
        + (fix or "Call the DiT so that it computes with its registered parameters"))


def parameter_grads(outputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                    grad_outputs: Sequence[torch.Tensor] | None = None, *, what: str,
                    names: dict | None = None, dit_outputs: bool = True, retain_graph: bool | None = None,
                    fix: str = "") -> tuple:
    """``torch.autograd.grad(outputs, params, grad_outputs)`` where None means "not used by the
    graph", never "used through a stand-in" (module docstring). ``dit_outputs``: the outputs are
    DiT outputs (check every leaf), else a loss (check when some parameter got None). ``names``:
    id(param) -> name, for the message."""
    outputs, params = list(outputs), list(params)
    grads = torch.autograd.grad(outputs, params, grad_outputs, allow_unused=True, retain_graph=retain_graph)
    missing = [p for p, g in zip(params, grads) if g is None]
    if dit_outputs or missing:
        # the graph's nodes outlive its backward (only their saved tensors are freed): walk it now
        names = names or {}
        check_graph_leaves(outputs, params, what=what, fix=fix,
                           missing=[names.get(id(p), f"a {tuple(p.shape)} parameter") for p in missing])
    return grads
