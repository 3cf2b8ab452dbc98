"""The intercept path runs the loss twice; the first run's side effects are undone before the second.

``InterceptedLoss`` records the DiT calls by running the loss once, then replays it. A loss that
writes in place into its inputs (``batch["latents"].mul_(0.9)``, ``z.add_(...)`` on a stored state,
``x[i] = ...``) or mutates an argument container (``batch["kl"] = kl``) would see its own writes
twice: the replay reads states the recording already wrote (wrong values and gradients), and a
recorded call's input that is a view of written storage changes after it was recorded, so the
"same inputs on both runs" check compares two views of the same, twice-written storage.

``RecordingRun`` wraps the recording run in a dispatch mode that sees every aten op that writes a
tensor. Before the first write into the storage of an input tensor of the loss, that input is
saved; before any write into the storage of a recorded DiT call's input, that input is replaced by
a copy (copy on write), so each recorded call keeps the values it was called with. On exit the
saved inputs are written back (again protecting the recorded calls) and the argument containers
get their entries back. The replay then runs once on the caller's inputs, exactly as the
undecorated loss would: its writes happen once, with the window outputs' values.

The DiT's module state (train/eval, requires_grad, adapter switches) is put back as the loss was
entered with: a loss that calls ``dit.eval()`` at step k leaves the module in eval mode after the
recording, and a replay starting there would run the calls before step k in eval mode.

A write into a parameter or buffer of the DiT inside the loss is refused: the windows run between
the two runs, so no order of the DiT's reads around it would be the loss's.

A write, after a DiT call, into the storage of that call's input is a loss eager PyTorch rejects
when the DiT saved the input for backward (every view of a storage shares one version counter:
``z = latents[:, j]; v = dit(z, t); latents[:, j + 1].add_(...)`` raises "a variable needed for
gradient computation has been modified by an inplace operation" at ``backward``). The intercept path
never runs the DiT with grad on the loss's own tensors, so it would return a gradient where eager
raises. ``refuse_writes_into_saved_inputs`` asks the DiT itself (one grad-mode forward of the call
on its recorded copy, under ``saved_tensors_hooks``) whether it saves the written input, and refuses
the loss naming the step and the write's line if it does (under autocast a DiT saves its casts, not
the input, and eager runs: so does jaggc).

Nothing is copied when the loss writes nothing: the cost is one Python check per aten op of the
recording run (also inside the DiT's recording forward).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .. import _compat
from .._compat import tree_flatten, tree_unflatten
from ..errors import JaggCaptureError, JaggGraphError
from ..runtime.calls import DitCall
from ..runtime.guard_probe import local_module
from ..runtime.module_state import CallState, applicable, module_state, set_state
from ..source import frame_location, user_frame
from .aliasing import storage_of


class _WriteWatch(_compat.dispatch_mode_base()):
    # torch runs __torch_dispatch__ with the mode popped: the copies made here are not watched
    def __init__(self, run: "RecordingRun"):
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.run.in_dit:
            for t in _compat.written_arguments(func, args, kwargs):
                self.run.before_write(t, func)
        return func(*args, **kwargs)


class RecordingRun:
    """Context manager around the recording run (module docstring). ``recorded``: the list the
    recording appends its ``DitCall``s to (entries are replaced by protected copies)."""

    def __init__(self, arguments: dict[str, Any], dit: nn.Module, recorded: list[DitCall]):
        self.recorded = recorded
        self.by_storage: dict[Any, set[int]] = {}   # storage -> recorded calls with an input in it
        self.in_dit = False                         # the DiT's own forward writes only its activations
        self.inputs: dict[Any, list[torch.Tensor]] = {}
        for x in tree_flatten(list(arguments.values()))[0]:
            if isinstance(x, torch.Tensor):
                self.inputs.setdefault(storage_of(x), []).append(x)
        self.model = {storage_of(t): name for name, t in list(dit.named_parameters()) + list(dit.named_buffers())}
        self.saved: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # recorded call -> (its input leaves the loss wrote into after the call, the op, the line)
        self.written_after: dict[int, tuple[list[int], str, str]] = {}
        self.containers = _container_snapshot(list(arguments.values()))
        self.watch = _WriteWatch(self)
        self.dit = dit
        self.entry_state = module_state(dit)        # put back before the replay (module docstring)

    def before_write(self, t: torch.Tensor, func) -> None:
        storage = storage_of(t)
        if storage in self.model:
            raise JaggCaptureError(
                f"step {len(self.recorded)}: the loss writes in place ({func}) into {self.model[storage]!r} of the DiT "
                f"(before its DiT call {len(self.recorded)}); the intercept path runs its windows between two runs of "
                f"the loss, so the DiT calls would not see the parameter as the loss left it at each call. Change "
                f"parameters outside the loss", path="intercept")
        for k, leaves in self._protect_recorded(storage).items():
            if k not in self.written_after:
                self.written_after[k] = (leaves, str(func), frame_location(user_frame()))
        if storage in self.inputs and storage not in self.saved:
            self.saved[storage] = [(x, x.detach().clone()) for x in self.inputs[storage]]

    def add_call(self, call: DitCall) -> None:
        """Record a DiT call (its inputs are watched from now on)."""
        self.recorded.append(call)
        for x in tree_flatten((call.args, call.kwargs))[0]:
            if isinstance(x, torch.Tensor):
                self.by_storage.setdefault(storage_of(x), set()).add(len(self.recorded) - 1)

    @contextlib.contextmanager
    def dit_forward(self):
        self.in_dit = True
        try:
            yield
        finally:
            self.in_dit = False

    def _protect_recorded(self, storage) -> dict[int, list[int]]:
        """Copy every recorded call input that lives in ``storage`` (before it is written); for each
        call copied, the positions of its copied leaves."""
        copied = {}
        for k in sorted(self.by_storage.pop(storage, ())):
            call = self.recorded[k]
            leaves, spec = tree_flatten((call.args, call.kwargs))
            hit = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and storage_of(x) == storage]
            leaves = [x.detach().clone() if i in hit else x for i, x in enumerate(leaves)]
            args, kwargs = tree_unflatten(leaves, spec)
            self.recorded[k] = DitCall(tuple(args), dict(kwargs))
            copied[k] = hit
        return copied

    @property
    def wrote(self) -> bool:
        return bool(self.saved) or any(c.changed() for c in self.containers)

    def __enter__(self):
        self.watch.__enter__()
        return self

    def __exit__(self, *exc):
        self.watch.__exit__(*exc)
        for storage, pairs in self.saved.items():
            self._protect_recorded(storage)
            with torch.no_grad():
                for x, before in pairs:
                    x.copy_(before)
        for c in self.containers:
            c.restore()
        now = module_state(self.dit)
        if now != self.entry_state and applicable(now, self.entry_state):
            # ``dit.eval()`` at step k: the replay must start in the entry state, as the loss's
            # single eager run does, or the calls before step k would run in eval mode (a hook
            # the loss leaves registered cannot be undone: the replay's state check refuses it)
            set_state(self.dit, self.entry_state)
        return False


def refuse_writes_into_saved_inputs(dit: nn.Module, run: RecordingRun, states: list[CallState]) -> None:
    """Refuse the loss if it wrote in place, after a DiT call, into an input the DiT saves for
    backward (module docstring): eager raises at ``backward`` there. One probe forward per written
    call, in the call's module and autocast state, until one saves the written input."""
    for k in sorted(run.written_after):
        positions, op, line = run.written_after[k]
        call = run.recorded[k]
        leaves = tree_flatten((call.args, call.kwargs))[0]
        watched = {storage_of(leaves[i]) for i in positions}
        saved = []

        def pack(t: torch.Tensor):
            if storage_of(t) in watched:
                saved.append(True)
            return t

        # on DDP's wrapped module: a forward the reducer never sees a backward of is not its business
        with torch.enable_grad(), states[k].applied(dit), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call(local_module(dit))
        if saved:
            raise JaggGraphError(
                f"the loss writes in place ({op}) into the storage of the "
                f"input of its DiT call at step {k} after that call, and the DiT saves that input for backward: "
                f"eager PyTorch raises 'one of the variables needed for gradient computation has been modified "
                f"by an inplace operation' at backward (every view of a tensor shares its version counter). "
                f"Call the DiT on a copy (`z = latents[:, j].clone()`) or write out of place",
                where=f"step {k}{f' ({line})' if line else ''}")


class _Container:
    """A dict or list among the arguments, with its entries as the loss was called with."""

    def __init__(self, obj):
        self.obj = obj
        self.items = dict(obj) if isinstance(obj, dict) else list(obj)

    def changed(self) -> bool:
        now = dict(self.obj) if isinstance(self.obj, dict) else list(self.obj)
        if isinstance(now, dict):
            return now.keys() != self.items.keys() or any(now[k] is not self.items[k] for k in now)
        return len(now) != len(self.items) or any(a is not b for a, b in zip(now, self.items))

    def restore(self) -> None:
        if not self.changed():
            return
        if isinstance(self.obj, dict):
            self.obj.clear()
            self.obj.update(self.items)
        else:
            self.obj[:] = self.items


def _container_snapshot(values: list) -> list[_Container]:
    out, stack, seen = [], list(values), set()
    while stack:
        v = stack.pop()
        if id(v) in seen or not isinstance(v, (dict, list, tuple)):
            continue
        seen.add(id(v))
        if isinstance(v, (dict, list)):
            out.append(_Container(v))
        stack.extend(v.values() if isinstance(v, dict) else v)
    return out
