"""The low-memory backward mode: each window's joint backward runs as soon as its upstream
gradients are known, during the loss's forward, so at most one window's knot activations live.

Trainers call backward once per step and hold one step's activations. The joint mode keeps every
window's knot activations until ``loss.backward()``; the per-window mode re-runs each knot forward
inside the backward ((W+6)F per window). This mode keeps the joint mode's (W+4)F and the memory of
one window, for losses that are a sum of per-step terms (``passes/lowmem_terms.py`` proves it):

  * a window runs its interior steps without grad and its knots in one forward with grad, and hands
    the loss each step's output as a fresh leaf;
  * each term of the loss (Flow-GRPO's per-step PPO loss, its KL term) depends on one step's output;
    as soon as it is computed, its gradient with respect to that output, times the term's constant
    coefficient in the loss, is that step's upstream gradient g_k (autograd on the term's own glue);
  * when a window has all its g_k, its composites go through its knot outputs into a gradient buffer
    (``torch.autograd.grad``: ``.grad`` is not touched) and the window's activations are freed;
  * the last window keeps its knot graph, and the loss returned carries both: its backward (with any
    ``grad_output``: a GradScaler's scale, an accumulation factor) hands ``grad_output * buffer`` to
    the parameters and ``grad_output * composites`` to the last window's knot outputs, through
    ordinary autograd. Under DDP every knot forward but the last runs in ``no_sync()``, so the one
    backward all-reduces once, with every window's gradient;
  * under FSDP (1 or 2) autograd never sees the parameters FSDP registers, and FSDP's hooks must
    gather, recompute and reduce-scatter: a window's backward runs through FSDP instead, into a
    buffer sharded like the gradient, added to FSDP's ``.grad`` times ``grad_output`` once
    ``loss.backward()`` has finished (``sharded_grads.py``).

Buffer memory: one gradient per trainable parameter (tiny for LoRA, one gradient copy for full
fine-tuning; under FSDP the rank's shard of it), reported by ``LowMemRun.buffer_bytes``. Every
parameter gradient is checked never to be dropped silently (``param_grads.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .._compat import tree_flatten, tree_unflatten
from ..errors import JaggGraphError
from .aggregate import knot_composites
from .calls import DitCall, split_output
from .deferred import BackwardGroup
from .engines import engine_of
from .memory import storage_bytes
from .param_grads import parameter_grads
from .sharded_grads import ShardedGradBuffer


def trainable_parameters(dit: nn.Module) -> list[nn.Parameter]:
    return [p for p in dit.parameters() if p.requires_grad]


class _Window:
    def __init__(self, knot_out, knots, phi, leaves, terms: dict[int, int], last: bool, probe=None):
        self.knot_out, self.knots, self.phi = knot_out, knots, phi
        self.probe = probe                        # a guard's probe of this window (guard_probe.py)
        self.leaves = leaves                      # per step: the float leaves handed to the loss
        self.upstream: dict[tuple[int, int], torch.Tensor] = {}
        self.terms_left = dict(terms)             # per step position: terms of the loss still to come
        self.last = last


class LowMemRun:
    """One execution of a low-memory loss (module docstring)."""

    def __init__(self, dit: nn.Module, num_windows: int):
        self.dit = dit
        # under FSDP the windows' backward runs through FSDP and the buffer is sharded like the
        # gradient (sharded_grads.py); otherwise it is autograd.grad into one gradient per parameter
        self.sharded = ShardedGradBuffer(dit) if engine_of(dit).sharded else None
        self.params = trainable_parameters(dit) if self.sharded is None else []
        self.names = {id(p): n for n, p in dit.named_parameters()} if self.sharded is None else {}
        self.buffer: list[torch.Tensor | None] = [None] * len(self.params)
        self.group = BackwardGroup(num_windows)     # DDP: every knot forward but the last in no_sync
        self.windows: dict[int, _Window] = {}
        self.last: _Window | None = None

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the gradient buffer this rank holds (storage sizes, FSDP's padding included)."""
        if self.sharded is not None:
            return self.sharded.buffer_bytes
        return storage_bytes(self.buffer)

    # --- a window --------------------------------------------------------------------------------
    def run_window(self, index: int, calls: Sequence[DitCall], steps: Sequence[int], options, *, exact: bool,
                   terms: dict[int, int], last: bool) -> list[Any]:
        from .window import prepare_window, prepare_exact_window

        with self.group.sync_context(self.dit):
            prepared = (prepare_exact_window if exact else prepare_window)(self.dit, calls, steps, options)
        knot_parts = split_output(prepared.knot_out, len(prepared.knots), prepared.batch)
        outputs, leaves = [], []
        for p in range(len(calls)):
            value = knot_parts[prepared.knots.index(p)] if p in prepared.knots else prepared.interior_out[p]
            flat, spec = tree_flatten(value)
            step_leaves = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
                           else x for x in flat]
            leaves.append([x if isinstance(x, torch.Tensor) and x.requires_grad else None for x in step_leaves])
            outputs.append(tree_unflatten(step_leaves, spec))
        window = _Window(prepared.knot_out, prepared.knots, prepared.phi, leaves, terms, last, probe=prepared.probe)
        self.windows[index] = window
        if not any(terms.values()):          # nothing of the loss depends on this window's outputs
            self._finish(index)
        return outputs

    # --- a term of the loss ----------------------------------------------------------------------
    def add_term(self, index: int, position: int, term: torch.Tensor, coef: float, name: str) -> torch.Tensor:
        window = self.windows[index]
        if not isinstance(term, torch.Tensor) or term.numel() != 1:
            raise JaggGraphError(
                f"node {name}: backward='lowmem' needs each per-step term of the loss to be a scalar, got "
                f"{tuple(term.shape) if isinstance(term, torch.Tensor) else type(term).__name__}; reduce it "
                f"(.mean()) before adding it to the loss, or use backward='joint'")
        inputs = [(i, leaf) for i, leaf in enumerate(window.leaves[position]) if leaf is not None]
        window.terms_left[position] -= 1
        if term.requires_grad and inputs:
            # a step's terms may share glue (Flow-GRPO's policy and KL terms share the step mean)
            grads = torch.autograd.grad(term, [leaf for _, leaf in inputs], allow_unused=True,
                                        retain_graph=window.terms_left[position] > 0)
            for (i, _), g in zip(inputs, grads):
                if g is not None:
                    key = (position, i)
                    g = g * coef
                    window.upstream[key] = g if key not in window.upstream else window.upstream[key] + g
        if not any(window.terms_left.values()):
            self._finish(index)
        return term.detach()

    def _finish(self, index: int) -> None:
        """The window's upstream gradients are complete: its composites go through its knots."""
        window = self.windows.pop(index)
        knot_leaves = tree_flatten(window.knot_out)[0]
        num_steps = len(window.leaves)
        if window.probe is not None:
            window.probe.measure({i: [window.upstream.get((s, i)) for s in range(num_steps)]
                                  for i, leaf in enumerate(knot_leaves) if isinstance(leaf, torch.Tensor)})
        roots, root_grads = [], []
        for i, leaf in enumerate(knot_leaves):
            if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad):
                continue
            gamma = knot_composites(window.phi, [window.upstream.get((s, i)) for s in range(num_steps)])
            if gamma is not None:
                roots.append(leaf)
                root_grads.append(gamma.to(leaf.dtype))
        if window.last:
            self.last = (roots, root_grads)
            return
        if not roots:
            return
        if self.sharded is not None:
            self.sharded.backward(roots, root_grads, what=f"backward='lowmem' under FSDP, window {index}")
            return
        if self.params:
            grads = parameter_grads(roots, self.params, root_grads, names=self.names,
                                    what=f"backward='lowmem', window {index}")
            for j, g in enumerate(grads):
                if g is not None:
                    self.buffer[j] = g if self.buffer[j] is None else self.buffer[j].add_(g)

    # --- the loss --------------------------------------------------------------------------------
    def output(self, loss: torch.Tensor) -> torch.Tensor:
        if self.windows:
            raise JaggGraphError(f"internal: windows {sorted(self.windows)} still wait for terms of the loss")
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            raise JaggGraphError(
                "backward='lowmem': the loss has a gradient path that does not go through a DiT output (a "
                "trainable tensor or module outside the DiT); it cannot be split into per-step terms. Use "
                "backward='joint'")
        roots, root_grads = self.last if self.last is not None else ([], [])
        with_buffer = [(p, b) for p, b in zip(self.params, self.buffer) if b is not None]
        if self.sharded is not None and not roots and self.sharded.buffer_bytes:
            # the last window's outputs carry no gradient: an anchor makes the loss differentiable,
            # so that loss.backward() still adds the buffer (on the loss's device: its gradient is
            # multiplied by the loss's grad_output in _Inject.backward)
            device = loss.device if isinstance(loss, torch.Tensor) else None
            roots, root_grads = [torch.empty(0, requires_grad=True, device=device)], [torch.empty(0, device=device)]
        return _Inject.apply(loss, len(roots), root_grads, [b for _, b in with_buffer], self.sharded, *roots,
                             *[p for p, _ in with_buffer])


class _Inject(torch.autograd.Function):
    """Returns the loss value; its backward hands grad_output x composites to the last window's knot
    outputs and grad_output x buffer to the parameters, or under FSDP to FSDP's gradient storage
    once the backward has finished (module docstring)."""

    @staticmethod
    def forward(ctx, loss, num_roots, root_grads, buffers, sharded, *roots_and_params):
        ctx.num_roots, ctx.root_grads, ctx.buffers, ctx.sharded = num_roots, root_grads, buffers, sharded
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_output):
        scale = grad_output.sum()   # a scalar loss; a broadcast one adds up its elements' gradients
        if ctx.sharded is not None:
            ctx.sharded.add_after_backward(scale)
        grads = [g * scale for g in ctx.root_grads] + [b * scale for b in ctx.buffers]
        return (None, None, None, None, None, *grads)
