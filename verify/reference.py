"""A reference JAGG gradient computed by hand from an eager run, independently of jaggc.

The oracle for "does the compiled loss compute JAGG?": it shares no code with the window runtime
or the passes (only the guard against silently dropped parameter gradients, runtime/param_grads.py). The loss runs eagerly; a forward hook on the DiT keeps every grad-enabled call's
output and timestep; autograd gives each step's upstream gradient g_k; the knots' composites are
formed here, and the gradient flows through the eager run's own graph of the knot outputs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def reference_jagg(loss_fn: Callable, args: tuple, dit: nn.Module, window: int, *, weights: str = "t",
                   time_arg: str | int = "timestep", time_of: Callable | None = None,
                   streams: int = 1, exact_below: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, flat parameter gradient) of plain JAGG computed by hand, independently of jaggc.

    The loss runs eagerly; a forward hook on ``dit`` keeps every grad-enabled call's output and
    per-sample timestep. g_k = dL/dv_k comes from autograd; trained calls are cut into windows of
    ``window`` (a shorter tail is its own window); each window's two knots (first and last call)
    get G_a = sum (1 - a_k) g_k and G_b = sum a_k g_k, a_k by timestep (or step index), and the
    gradient is J_a^T G_a + J_b^T G_b through the eager run's own graph of the knot outputs.
    ``time_of(t)`` turns a call's timestep argument into per-sample times (default: as given).
    ``streams``: the loss makes this many grad-enabled calls per sampling step (two-call CFG); call
    k belongs to stream k % streams and windows are cut per stream. ``exact_below``: σ-aware
    placement, a window whose noise level σ (the timestep if all of the window's are in [0, 1],
    else timestep / 1000) falls below it anywhere is exact: every call its own knot."""
    outs, times = [], []

    def keep(module, a, kw, output):
        if torch.is_grad_enabled():
            v = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
            outs.append(v)
            t = kw[time_arg] if isinstance(time_arg, str) else a[time_arg]
            t = time_of(t) if time_of is not None else torch.as_tensor(t).reshape(-1)
            times.append(t.to(torch.float64).expand(v.shape[0]))

    handle = dit.register_forward_hook(keep, with_kwargs=True)
    try:
        loss = loss_fn(*args)
    finally:
        handle.remove()
    upstream = torch.autograd.grad(loss, outs, retain_graph=True, allow_unused=True)
    upstream = [torch.zeros_like(v) if g is None else g for v, g in zip(outs, upstream)]
    knots, composites = [], []
    windows = []
    for stream in range(streams):
        members = list(range(stream, len(outs), streams))
        windows += [members[start:start + window] for start in range(0, len(members), window)]
    for idx in windows:
        scale = 1.0 if max(float(times[k].max()) for k in idx) <= 1.0 else 1000.0
        low_noise = exact_below is not None and any(bool((times[k] / scale < exact_below).any()) for k in idx)
        if len(idx) == 1 or low_noise:
            knots += [outs[k] for k in idx]
            composites += [upstream[k] for k in idx]
            continue
        a, b = idx[0], idx[-1]
        # summed in float64 and rounded once to the knot output's dtype: under bf16 autocast a sum
        # accumulated in bf16 would differ from the exact composite by several bf16 roundings
        g_a = torch.zeros_like(upstream[a], dtype=torch.float64)
        g_b = torch.zeros_like(upstream[b], dtype=torch.float64)
        for pos, k in enumerate(idx):
            if weights == "t":
                alpha = (times[k] - times[a]) / (times[b] - times[a])
                alpha = alpha.reshape(-1, *([1] * (upstream[k].ndim - 1)))
            else:
                alpha = pos / (len(idx) - 1)
            g_a = g_a + (1 - alpha) * upstream[k].double()
            g_b = g_b + alpha * upstream[k].double()
        knots += [outs[a], outs[b]]
        composites += [g_a.to(upstream[a].dtype), g_b.to(upstream[b].dtype)]
    params = [p for p in dit.parameters() if p.requires_grad]
    # a None is an unused parameter, never one the graph reached through a stand-in (FSDP's
    # gathered copies, a swapped weight): that guard, not JAGG math, is the one jaggc code used here
    from jaggc.runtime.param_grads import parameter_grads

    parts = parameter_grads(knots, params, composites, what="reference_jagg")
    by_param = {id(p): g for p, g in zip(params, parts)}
    flat = torch.cat([(by_param.get(id(p)) if by_param.get(id(p)) is not None else torch.zeros_like(p)).reshape(-1)
                      for p in dit.parameters()])
    return loss.detach(), flat
