"""One Dynamo backend per set of DiT modules, shared by every compiled loss.

Dynamo keeps its compiled graphs on the loss function's code object and matches a cache entry
to the backend that compiled it by identity. A backend per ``jagg_compile`` made every compiled
loss of one function a new entry of that code: the 9th ``jagg_compile(loss)`` in a process hit
Dynamo's recompile limit ("BACKEND_MATCH"), and ``capture="auto"`` fell back to intercept.

So the backend object is shared: one per tuple of watched modules (a graph captured with one DiT
binds that module, so another module object must not reuse it). What Dynamo caches is the
*captured* graph (canonical ``dit_call`` form, independent of jaggc's options); at run time the
Dynamo frontend of the compiled loss that is running (``running_loss``) rewrites its own copy of it once, with its own
window, weights and backward mode, and runs that.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable

from torch import fx, nn

from .dynamo import canonicalize_dynamo_calls

_RUNNING: contextvars.ContextVar[Any] = contextvars.ContextVar("jaggc_running_loss", default=None)
_BACKENDS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], SharedBackend]]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def running_loss(frontend):
    """``frontend`` (a compiled loss's ``DynamoFrontend``) is the one whose rewrite a shared graph runs."""
    token = _RUNNING.set(frontend)
    try:
        yield
    finally:
        _RUNNING.reset(token)


class SharedBackend:
    """The Dynamo backend of every compiled loss over one set of modules (module docstring).

    The running frontend provides ``graph_for(pristine, own=None) -> callable``: its loss's rewrite
    of a captured graph (of ``own``, else of a copy of ``pristine``; made on first use, then cached
    under ``pristine``)."""

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        captured = canonicalize_dynamo_calls(gm)
        pristine = copy_graph_module(captured)      # what the other compiled losses rewrite
        # the compiling loss rewrites the capture itself, now: its refusals surface at compile time
        _RUNNING.get().graph_for(pristine, own=captured)

        def run_graph(*args):
            return _RUNNING.get().graph_for(pristine)(*args)

        return run_graph


def shared_backend(modules: list[nn.Module]) -> SharedBackend:
    by_modules = _BACKENDS.setdefault(modules[0], {})
    key = tuple(id(m) for m in modules)
    if key not in by_modules:
        by_modules[key] = SharedBackend()
    return by_modules[key]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph and node.meta dicts, sharing its submodules and
    attributes (the DiT is not copied): each compiled loss rewrites its own copy."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)
