"""autograd: work after a backward pass (its engine's callback queue), whether a thread runs inside a
backward now, and the RNG states a re-run of a call must draw from."""

from __future__ import annotations

import contextlib

import torch

from .pytree import tree_flatten


# --- autograd: work after a backward pass ----------------------------------------------------

def queue_backward_callback(fn) -> None:
    """Run ``fn`` once the current backward pass has finished (called from inside a backward hook):
    what DDP uses to finish its reduction. autograd has no public end-of-backward hook."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def run_after_backward(fn) -> None:
    """Run ``fn()`` once the backward pass that is running now has finished, after every callback
    queued in it, also those queued later than this call (FSDP1 and FSDP2 queue their final
    callbacks, which write the sharded ``.grad``, from hooks that fire after the caller: the loss's
    node is the first one a backward runs). torch has no public end-of-backward hook; this is the
    engine queue FSDP itself uses. A queued callback may queue another, which runs after all those
    queued before it: ``fn`` goes in from the first one's turn."""
    queue_backward_callback(lambda: queue_backward_callback(fn))


# --- RNG: a re-run draws what its call drew --------------------------------------------------

def rng_states(*inputs):
    """The CPU RNG state and that of every accelerator device ``inputs`` live on: what a DiT call
    drew its dropout masks from. ``torch.utils.checkpoint``'s own device-state helpers (public
    functions of a module whose API is the checkpoint functions) do the accelerator part."""
    from torch.utils.checkpoint import get_device_states

    leaves = [x for x in tree_flatten(list(inputs))[0] if isinstance(x, torch.Tensor)]
    return torch.get_rng_state(), get_device_states(*leaves)


@contextlib.contextmanager
def rng_states_restored(states):
    """Run the body with the RNG states ``rng_states`` took, then give the caller's stream back."""
    from torch.utils.checkpoint import set_device_states

    cpu, (devices, device_states) = states
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        set_device_states(devices, device_states)
        yield


def backward_accumulates_everywhere() -> bool:
    """Inside a backward: whether the running backward is a plain ``backward()`` that accumulates
    into every leaf it reaches (not ``backward(inputs=...)`` nor ``torch.autograd.grad``, which
    give the engine a set of tensors to compute for). Reentrant checkpointing asks the same
    (``torch.autograd._is_checkpoint_valid``, no public name)."""
    return torch.autograd.Variable._execution_engine.is_checkpoint_valid()


def backward_task_id() -> int:
    """An id of the backward pass this thread runs inside now (-1 outside any): one end-of-backward
    callback per pass (``_current_graph_task_id``, no public name)."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward now (a checkpoint's recomputation, a
    backward hook): what FSDP2 asks torch too (``_current_graph_task_id``, no public name)."""
    return torch._C._current_graph_task_id() != -1
