"""autograd: work after a backward pass (its engine's callback queue), whether a thread runs inside a
backward now, and the RNG states a re-run of a call must draw from (and whether a call drew)."""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

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

@dataclass(frozen=True)
class RngStates:
    """What a DiT call drew its random numbers from: the CPU generator's state and, once per device,
    the default generator's state of every accelerator device the call touched (its inputs' and its
    module's parameters' and buffers' devices). ``offsets``: each device's generator offset where
    its generator has one (CUDA's Philox), the cheap test of whether it drew (``rng_drawn``)."""

    cpu: torch.Tensor
    devices: tuple = ()          # ((torch.device, state), ...), one per device
    offsets: tuple = ()          # ((torch.device, offset or None), ...)


def accelerator_devices(module=None, *inputs) -> tuple:
    """The accelerator devices (not the CPU, not meta) of ``inputs``' tensors and of ``module``'s
    parameters and buffers, each once, in a fixed order: the devices whose generators a call of
    ``module`` on ``inputs`` may draw from. A module with parameters on a device its inputs are not
    on draws there too (a model split over devices, an input left on the CPU)."""
    tensors = [x for x in tree_flatten(list(inputs))[0] if isinstance(x, torch.Tensor)]
    if module is not None:
        tensors += list(module.parameters()) + list(module.buffers())
    return accelerator_devices_of(tensors)


def accelerator_devices_of(tensors) -> tuple:
    """``accelerator_devices`` of these tensors themselves (a module's listed parameters and buffers: no
    flattening), their devices read in C."""
    seen: dict = {}
    for device in set(map(_DEVICE, tensors)):
        if device.type in ("cpu", "meta"):
            continue
        if device.index is None:
            device = torch.device(device.type, _device_module(device.type).current_device())
        seen[device] = None
    return tuple(sorted(seen, key=lambda d: (d.type, d.index)))


_DEVICE = operator.attrgetter("device")


def _device_module(kind: str):
    return getattr(torch, kind)          # torch.cuda, torch.xpu, ...: get_rng_state(index) and the like


def _offset(device: torch.device):
    """The device generator's offset (CUDA's Philox: every draw advances it), None where its generator
    has none to read; reading it copies nothing (the state is 16 bytes on CUDA, read as such otherwise)."""
    generators = getattr(_device_module(device.type), "default_generators", ())
    if device.index < len(generators) and hasattr(generators[device.index], "get_offset"):
        try:
            return generators[device.index].get_offset()
        except RuntimeError:
            return None
    return None


def rng_states(*inputs, module=None, devices=()) -> RngStates:
    """The RNG states a call of ``module`` on ``inputs`` draws from now (``RngStates``): the CPU's and
    one per accelerator device, those of ``inputs``' tensors, of ``module``'s parameters and buffers and
    ``devices`` (``accelerator_devices(module)`` computed once by a caller that makes many calls of one
    module). No accelerator call where no accelerator device is involved (a CPU-only machine)."""
    found = accelerator_devices(module, *inputs)
    if devices:
        found = tuple(sorted(set(found) | set(devices), key=lambda d: (d.type, d.index)))
    states = tuple((d, _device_module(d.type).get_rng_state(d.index)) for d in found)
    return RngStates(torch.get_rng_state(), states, tuple((d, _offset(d)) for d in found))


def rng_drawn(before: RngStates) -> bool:
    """Whether any generator of ``before`` advanced since it was taken: the call made between drew
    random numbers (dropout through a module, ``F.dropout``, attention's ``dropout_p``, any sampling:
    whichever API drew). The CPU test reads the generator's state again and compares its bytes (about
    5 KB; a few microseconds); a CUDA device's compares its generator's offset."""
    if torch.get_rng_state().numpy().tobytes() != before.cpu.numpy().tobytes():
        return True
    for (device, state), (_, offset) in zip(before.devices, before.offsets):
        if offset is not None:
            if _offset(device) != offset:
                return True
        elif not torch.equal(_device_module(device.type).get_rng_state(device.index), state):
            return True
    return False


@contextlib.contextmanager
def rng_states_restored(states: RngStates | None):
    """Run the body drawing from ``states`` (``rng_states``: the CPU's and each device's), then give
    every generator its own stream back (``torch.random.fork_rng`` over the same devices). None: the
    body draws from the generators as they are."""
    if states is None:
        yield
        return
    kinds: dict = {}
    for device, _ in states.devices:
        kinds.setdefault(device.type, []).append(device.index)
    with contextlib.ExitStack() as stack:
        if not kinds:
            stack.enter_context(torch.random.fork_rng(devices=[]))
        for kind, indices in kinds.items():
            stack.enter_context(torch.random.fork_rng(devices=indices, device_type=kind))
        torch.set_rng_state(states.cpu)
        for device, state in states.devices:
            _device_module(device.type).set_rng_state(state, device.index)
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
