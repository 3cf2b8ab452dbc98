"""The autocast state a DiT call (or any op) runs under, and how to put it back.

Autocast is a thread-local mode, like grad mode: ``with torch.autocast("cuda", torch.bfloat16):``
around a trainer's DiT call changes which dtype every matmul of that call computes in, so the same
inputs give other numbers. The trainers write exactly that (DanceGRPO, MixGRPO and the JAGG author
open a CUDA bf16 block around the transformer call in every step), and accelerate's
``accelerator.autocast()`` wraps whole steps. Whatever reorders, batches, defers or replays DiT
calls (a rewritten graph, a window's knot forward, a per-window backward that re-runs the knot
forward inside ``loss.backward()``, the intercept fallback that runs windows after the loss) must run
each call in the autocast state it was written in. ``AutocastState`` is that state as a hashable
value, ``current_autocast()`` reads it, ``autocast_applied(state)`` runs a block in it, and
``set_autocast(state)`` is the switch a compiled graph calls between nodes.

The weight-cast cache of autocast (one cast copy of each parameter per outermost region) is keyed
by the parameter's identity: a cast made on fake tensors (a trace's shape propagation) would be
handed to the next real op of the same region. ``autocast_cache_disabled()`` keeps fake runs out of
it. The cache also decides how a bf16 parameter gradient accumulates: calls that share one cast
copy sum their weight gradients in bf16 before the cast back, calls with their own copies sum them
in fp32. The trainers open one block per step around one DiT call, so no two steps share a copy;
a region jaggc enters to put a call back in its block's state (a window running several steps, the
intercept fallback running a window after the loss) would make them share one. So every DiT call
jaggc runs inside a region it entered itself starts from an empty cache (``fresh_cast_cache``):
each step's call casts for itself, as in the trainer's loop. Inside the caller's own region (a
whole-loss ``accelerator.autocast()``) jaggc enters nothing and the calls share the caller's cache,
as they do without jaggc.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

# the devices whose autocast state is read and replayed ("cuda" is read on a CPU-only build too:
# torch.is_autocast_enabled("cuda") is False there, so it never appears in a state)
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


class AutocastState(tuple):
    """The autocast state of the current thread: one ``(device, dtype)`` per device with autocast
    enabled, in ``AUTOCAST_DEVICES`` order (a disabled device's dtype changes nothing). The empty
    state is "autocast off". A tuple, so it is hashable, comparable and prints as a graph constant."""

    __slots__ = ()

    def describe(self) -> str:
        return ", ".join(f"{device} {str(dtype).replace('torch.', '')}" for device, dtype in self) or "off"


AUTOCAST_OFF = AutocastState()


def _available(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device) is not None
    except RuntimeError:   # a device type this build does not know
        return False


_DEVICES = tuple(d for d in AUTOCAST_DEVICES if _available(d))


def current_autocast() -> AutocastState:
    """The thread's autocast state now."""
    return AutocastState((d, torch.get_autocast_dtype(d)) for d in _DEVICES if torch.is_autocast_enabled(d))


def _contexts_to(state: AutocastState) -> list:
    """The ``torch.autocast`` contexts that, entered now, turn the current state into ``state``."""
    wanted = dict(state)
    out = []
    for device in _DEVICES:
        enabled = torch.is_autocast_enabled(device)
        if device in wanted:
            if not enabled or torch.get_autocast_dtype(device) != wanted[device]:
                out.append(torch.autocast(device, dtype=wanted[device]))
        elif enabled:
            out.append(torch.autocast(device, enabled=False))
    return out


_OWN = threading.local()       # .depth: autocast_applied blocks that entered contexts, on this thread


@contextlib.contextmanager
def autocast_applied(state: AutocastState | None) -> Iterator[None]:
    """Run the body in autocast ``state`` (None: as it is), restoring the caller's state after.
    Real ``torch.autocast`` contexts are entered, so nesting and the weight-cast cache behave as
    in the user's own code."""
    if state is None or state == current_autocast():
        yield
        return
    with contextlib.ExitStack() as stack:
        for ctx in _contexts_to(state):
            stack.enter_context(ctx)
        _OWN.depth = getattr(_OWN, "depth", 0) + 1
        try:
            yield
        finally:
            _OWN.depth -= 1


def fresh_cast_cache() -> None:
    """Before a DiT call: in an autocast region jaggc entered itself, drop the cast copies earlier
    calls made (module docstring: each step's call casts for itself, as in the trainer's loop)."""
    if (_entered() or getattr(_OWN, "depth", 0)) and torch.is_autocast_cache_enabled():
        torch.clear_autocast_cache()


@contextlib.contextmanager
def autocast_cache_disabled() -> Iterator[None]:
    """Keep the body's casts out of autocast's weight-cast cache (module docstring): a fake run
    under the user's autocast would otherwise leave fake bf16 copies of the real parameters there."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


# ---------------------------------------------------------------------------------------------
# the switch a compiled graph runs: absolute states, exception-safe through reset_graph_autocast

_GRAPH = threading.local()


def _entered() -> list:
    stack = getattr(_GRAPH, "stack", None)
    if stack is None:
        stack = _GRAPH.stack = []
    return stack


def set_autocast(state: AutocastState) -> None:
    """Put the thread in autocast ``state`` for the graph nodes that follow.

    The contexts a previous switch entered are exited first (back to the state the graph was
    entered in), then those that reach ``state`` are entered: switches never nest, and a graph
    that ends in its entry state (the mode pass puts a switch before the output) leaves nothing
    entered. ``reset_graph_autocast`` exits whatever a graph that raised left entered."""
    reset_graph_autocast()
    stack = _entered()
    for ctx in _contexts_to(state):
        ctx.__enter__()
        stack.append(ctx)


def reset_graph_autocast() -> None:
    """Exit every context the graph switches entered on this thread (innermost first)."""
    stack = _entered()
    while stack:
        stack.pop().__exit__(None, None, None)
