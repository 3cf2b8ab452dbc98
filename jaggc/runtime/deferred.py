"""The per-window backward mode: a window's joint backward runs on its own, one window at a time.

In the default ("joint") mode a compiled loss keeps every window's knot activations alive until
``loss.backward()``: 2T/W sample-sets of DiT activations. Flow-GRPO-style trainers instead call
backward once per step so that only one step's activations are ever alive. The per-window mode
gets the same property for JAGG, the way activation checkpointing does:

  * forward: every step of the window runs without grad (batched, ``interior_chunk`` steps per
    call), so nothing of the DiT is saved; the outputs are tied to one ``DeferredWindow`` node;
  * backward: when autograd reaches that node it has the W upstream gradients; it forms the K
    composite gradients, re-runs the knot forward WITH grad and immediately runs its backward
    (a nested ``torch.autograd.backward``, as reentrant checkpointing does), then frees it.

The knot forward re-run inside the backward runs in the module state and autocast state the
window's forward ran in (``module_state.CallState``): ``loss.backward()`` is usually called outside
the trainer's autocast block, and after the loss returned, so after a ``dit.train()`` that gives the
module back at its end: the same numbers as the forward, never a silent fp32 or train-mode re-run
of a bf16 or eval-mode call.

And with the random draws of the forward. A DiT with live dropout (an ``nn.Dropout`` in train mode, a
peft ``lora_dropout``, ``F.dropout`` in a forward, attention's ``dropout_p``) draws a mask per call; the
re-run must draw the masks the values were computed with, or the gradient belongs to other masks.
Whether the window's forwards drew is read from the generators around them (``_compat.rng_drawn``: so
whichever API drew; a few microseconds). When they drew, the knots' values come from forwards of their
own, batched as the backward re-runs them (all knots in one, or one per knot with
``batch_knots=False``), each started from recorded RNG states (the CPU's and every accelerator device's
of the inputs and the module), and the re-run starts from the same states: the same masks, batched
or not. This costs one knot forward more in the window where jaggc first sees the module draw (in a
module state and autocast state: remembered per module), none after. Under a guard's probe the
interior steps' forwards are recorded so too (the probe re-runs them: guard_probe.py). A re-run that
draws where the forward drew nothing (its values came from the rollout cache) is refused.

Peak DiT activation memory: one knot batch (2B samples; B with ``batch_knots=False``), instead of
every window's. Cost: the knot forward runs twice (once without grad for the values, once with
grad in backward), so a window costs (W + 2) forwards + one joint backward instead of W + 2B.

The parameters are inputs of the window's autograd node, so that a backward asking for them
reaches it: a plain ``loss.backward()`` runs the nested backward, which accumulates into ``.grad``
as a plain backward does (and goes through DDP's and FSDP's hooks); ``loss.backward(inputs=[...])``
and ``torch.autograd.grad(loss, params)`` get the knots' parameter gradients returned through the
node instead (``torch.autograd.grad`` of the re-run knots), so autograd writes exactly the
``.grad`` asked for, or none. Under DDP and FSDP those two forms are refused: the reduction runs
in the wrapper's hooks of a plain backward.

Under DDP the nested backwards are the DDP backwards: each window's knot forward goes through the
DDP module. A ``BackwardGroup`` shared by the windows of one loss evaluation wraps every knot
forward but the last one to run in ``no_sync()``, so the gradients are all-reduced once per loss
(and not at all inside the user's own ``no_sync``/accumulation micro-steps, which we leave as is).
Under FSDP (1 and 2) each nested backward is a whole FSDP backward: it reduce-scatters its window's
gradient into the sharded ``.grad`` (once per FSDP unit or parameter group per window), so no rank
ever holds a full unsharded gradient; inside the user's own no-sync micro-steps FSDP keeps
unsharded gradients and communicates nothing, as it does for any backward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Sequence

import torch
from torch import nn

from .._compat import (accelerator_devices, backward_accumulates_everywhere, rng_drawn, rng_states,
                       rng_states_restored, tree_flatten, tree_unflatten)
from ..errors import JaggUnsupportedError
from .aggregate import knot_composites
from .calls import DitCall, concat_calls, split_output
from .engines import engine_of
from .forwards import nograd_outputs
from .module_state import CallState

# per module, the (module output state, autocast) in which its window forwards were seen drawing random
# numbers: there a window's knots run in replayable forwards straight away (module docstring)
_DRAWS: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()


class BackwardGroup:
    """The grad forwards of one loss evaluation's deferred windows; under DDP all but the last are
    no_sync'd. Not under FSDP1 (whose ``no_sync`` also has the method): there it would keep a full
    unsharded gradient per rank until the last window, which is what FSDP exists to avoid; each
    window's backward reduce-scatters its own gradient instead (one reduce-scatter per FSDP unit
    per window, into the sharded gradient)."""

    def __init__(self, num_grad_forwards: int):
        self.remaining = num_grad_forwards

    def sync_context(self, dit: nn.Module):
        self.remaining -= 1
        if self.remaining <= 0:
            return contextlib.nullcontext()
        return engine_of(dit).sync_skipped(dit)      # DDP's no_sync(); FSDP reduce-scatters per window


class DeferredWindow:
    """One window in per-window mode (module docstring): no-grad values now, knot backward later."""

    def __init__(self, dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int], *, time_arg,
                 batch: int, knots: Sequence[int], phi: torch.Tensor, interior_chunk: int | None,
                 batch_knots: bool, unbatched: Sequence[str], group: BackwardGroup | None, cache=None, probe=None):
        self.dit, self.calls, self.steps, self.cache = dit, list(calls), list(steps), cache
        self.probe = probe                          # a guard's probe of this window (guard_probe.py)
        self.time_arg, self.batch, self.knots, self.phi = time_arg, batch, tuple(knots), phi
        self.interior_chunk, self.batch_knots, self.unbatched = interior_chunk, batch_knots, unbatched
        self.group = group if group is not None else BackwardGroup(self.grad_forwards)
        self.diff_index: list[tuple[int, int]] = []  # (step position, leaf index) of each node output
        # the calls' module and autocast state, re-applied in the backward (module docstring)
        self.state = CallState.of(dit)
        # the RNG states each knot group's forward started from, keyed by its positions: where the
        # forwards drew random numbers (live dropout), the backward's re-run starts from them
        self.knot_rng: dict[tuple[int, ...], Any] | None = None

    @property
    def grad_forwards(self) -> int:
        return 1 if self.batch_knots else len(self.knots)

    def _batched_call(self, positions: Sequence[int]) -> DitCall:
        return concat_calls([self.calls[p] for p in positions], self.time_arg,
                            steps=[self.steps[p] for p in positions], unbatched=self.unbatched)

    def _knot_groups(self) -> list[list[int]]:
        """The knots (indices into ``knots``) of each grad forward the backward runs."""
        if self.batch_knots:
            return [list(range(len(self.knots)))]
        return [[j] for j in range(len(self.knots))]

    def _recorded_outputs(self, groups: Sequence[Sequence[int]]) -> tuple[dict[int, Any], list]:
        """No-grad outputs of each group of window positions, one batched forward per group, and the RNG
        states each forward started from: ``({position: output}, [(positions, states)])``."""
        outs, record = {}, []
        with torch.no_grad():
            for positions in groups:
                call = self._batched_call(positions)
                states = rng_states(call.args, call.kwargs, devices=self.devices)
                for p, o in zip(positions, split_output(call(self.dit), len(positions), self.batch)):
                    outs[p] = o
                record.append((tuple(positions), states))
        return outs, record

    def _forward_values(self) -> dict[int, Any]:
        """Every step's value without grad (module docstring): as one run of batched forwards, the
        rollout cache's where it has them (knots included: their grad forward runs again in the
        backward anyway), unless the forwards draw random numbers; then the knots' (and under a probe
        the interior steps') from forwards whose RNG states the re-runs start from."""
        key = (self.state.module.output_key(), self.state.autocast)
        self.devices = accelerator_devices(self.dit)
        outs = None
        if key not in _DRAWS.get(self.dit, ()):
            before = rng_states(*[(c.args, c.kwargs) for c in self.calls], devices=self.devices)
            outs = nograd_outputs(self.dit, self.calls, self.steps, time_arg=self.time_arg, batch=self.batch,
                                  chunk=self.interior_chunk, unbatched=self.unbatched, cache=self.cache)
            if not rng_drawn(before):
                return outs
            _DRAWS.setdefault(self.dit, set()).add(key)
        # live dropout: the values the re-runs can draw again
        knot_groups = [[self.knots[j] for j in group] for group in self._knot_groups()]
        interior = [p for p in range(len(self.calls)) if p not in self.knots]
        groups = list(knot_groups)
        if self.probe is not None:
            chunk = self.interior_chunk or max(len(interior), 1)
            groups += [interior[lo:lo + chunk] for lo in range(0, len(interior), chunk)]
        elif outs is None:
            # the interior steps' values only: their masks are needed by no gradient
            inner = nograd_outputs(self.dit, [self.calls[p] for p in interior], [self.steps[p] for p in interior],
                                   time_arg=self.time_arg, batch=self.batch, chunk=self.interior_chunk,
                                   unbatched=self.unbatched, cache=self.cache)
            outs = {interior[i]: o for i, o in inner.items()}
        recorded, record = self._recorded_outputs(groups)
        outs = {**(outs or {}), **recorded}
        self.knot_rng = dict(record[:len(knot_groups)])
        if self.probe is not None:
            self.probe.replay = record
        return outs

    def run(self) -> list[Any]:
        """Per-step outputs with exact values; their float leaves backpropagate through this window."""
        outs = self._forward_values()
        per_step = [outs[p] for p in range(len(self.calls))]
        flat = [tree_flatten(o) for o in per_step]
        values = []
        for s, (leaves, _) in enumerate(flat):
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    self.diff_index.append((s, i))
                    values.append(leaf)
        # the anchor makes the node's outputs require grad; the DiT's trainable parameters are its
        # inputs so that backward(inputs=...) and autograd.grad reach it (module docstring). A plain
        # backward gets their gradients from the nested backward, not through the outer graph
        anchor = torch.empty(0, requires_grad=True)
        self.params = [p for p in self.dit.parameters() if p.requires_grad]
        tied = _DeferredWindowFn.apply(anchor, self, values, *self.params)
        leaves_per_step = [list(leaves) for leaves, _ in flat]
        for (s, i), v in zip(self.diff_index, tied):
            leaves_per_step[s][i] = v
        return [tree_unflatten(leaves, spec) for leaves, (_, spec) in zip(leaves_per_step, flat)]

    def composites(self, grads: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """cat_j Γ_j (K·B, ...) per differentiable leaf index, Γ_j = Σ_s Φ[s, j] ⊙ g[s, leaf]."""
        per_leaf: dict[int, list] = {}
        for (s, i), g in zip(self.diff_index, grads):
            per_leaf.setdefault(i, [None] * len(self.calls))[s] = g
        out = {i: knot_composites(self.phi, gs) for i, gs in per_leaf.items()}
        return {i: c for i, c in out.items() if c is not None}

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Run the window's knot backward. A plain backward: nested, into ``.grad``; returns
        Nones. ``backward(inputs=...)`` / ``autograd.grad``: returns the parameter gradients."""
        returned = not backward_accumulates_everywhere()
        engine = engine_of(self.dit)
        if returned and engine.hooks_accumulators:
            raise JaggUnsupportedError(
                f"backward='per_window' under {engine.name} runs each window's knot backward through the wrapper's "
                "hooks of a plain loss.backward(); loss.backward(inputs=...) and torch.autograd.grad(loss, ...) "
                "would bypass its gradient reduction. Call loss.backward() or use backward='joint'")
        param_grads: list[torch.Tensor | None] = [None] * len(self.params)
        if self.probe is not None:
            per_leaf: dict[int, list] = {}
            for (s, i), g in zip(self.diff_index, grads):
                per_leaf.setdefault(i, [None] * len(self.calls))[s] = g
            self.probe.measure(per_leaf)       # re-runs the window with grad: 3W F (guard_probe.py)
        gamma = self.composites(grads)
        for group in self._knot_groups():
            positions = tuple(self.knots[j] for j in group)
            states = None if self.knot_rng is None else self.knot_rng[positions]
            before = rng_states(devices=self.devices) if states is None else None
            with self.group.sync_context(self.dit), torch.enable_grad():
                with self.state.applied(self.dit), rng_states_restored(states):
                    out = self._batched_call(positions)(self.dit)
                if before is not None and rng_drawn(before):
                    raise JaggUnsupportedError(
                        f"backward='per_window' re-ran the knots (steps {[self.steps[p] for p in positions]}) of a "
                        f"window whose values came from no forward that drew random numbers (the rollout cache served "
                        f"them), and the re-run drew some: the DiT has live dropout (a dropout module, F.dropout or "
                        f"attention's dropout_p in train mode), and the gradient would belong to other masks than the "
                        f"values'. Turn dropout off while training with JAGG (dit.eval(), p=0, lora_dropout=0), or the "
                        f"rollout cache off, or use backward='joint'")
                leaves = tree_flatten(out)[0]
                roots, root_grads = [], []
                for i, leaf in enumerate(leaves):
                    if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad or i not in gamma:
                        continue
                    b = self.batch
                    roots.append(leaf)
                    root_grads.append(torch.cat([gamma[i][j * b:(j + 1) * b] for j in group], 0).to(leaf.dtype))
                if not roots:
                    continue
                if not returned:
                    torch.autograd.backward(roots, root_grads)
                    continue
                parts = torch.autograd.grad(roots, self.params, root_grads, allow_unused=True)
                param_grads = [a if b is None else b if a is None else a + b for a, b in zip(param_grads, parts)]
        return param_grads


class _DeferredWindowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, window: DeferredWindow, values: list, *params):
        ctx.window = window
        # split_output's slices are views of the batched output; own storage keeps autograd's
        # view tracking out of the way (W*B output samples: negligible next to a forward)
        return tuple(v.clone() if v._base is not None else v for v in values)

    @staticmethod
    def backward(ctx, *grads):
        window, ctx.window = ctx.window, None  # free the window's inputs once its backward ran
        if window is None:
            raise JaggUnsupportedError(
                "a per-window-mode JAGG window was backpropagated twice (retain_graph=True): its knot "
                "activations are rebuilt and freed inside the first backward. Use backward='joint' to "
                "backpropagate the same loss more than once")
        return (None, None, None, *window.backward(grads))
