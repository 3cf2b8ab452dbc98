"""Parameters and buffers the loss reads outside the DiT stay graph values, never trace-time copies.

A loss may read the model's parameters itself: a weight-decay or adapter-norm regulariser
(``1e-3 * sum((p ** 2).sum() for p in dit.parameters())``), ``next(dit.parameters()).pow(2).sum()``,
``(dit.W1 ** 2).sum()``. The FX tracer binds the modules as concrete arguments, so such an op runs
on the real tensor while tracing and fx stores its *result* as a ``_tensor_constant``: the first
call is right, an optimizer step later the graph returns the stale value and its backward runs
through the first call's freed autograd graph.

``LiveTensors`` is a ``TorchFunctionMode`` active while the FX frontend runs the loss. A torch
function that takes a *live* tensor (a parameter, a buffer of a watched module, any tensor that
requires grad) is recorded as a graph node instead of running: the live tensor enters the graph as
``live_tensor(get_attr(module), "W1")`` (read from the module at run time, so a replaced or updated
parameter is seen) or, for a tensor no watched module owns, as a ``get_attr`` of the tensor object
itself. Metadata questions (``p.dtype``, ``p.shape``, ``p.numel()``) are answered from the real
tensor: the cache key holds the parameters' dtypes and devices and the module's identity. A value
question (``float(dit.scale)``) becomes a guarded read that re-checks the parameter's current value
on every call. A write into a live tensor (``p.mul_(0.99)``) is refused: the compiled graph would
order it arbitrarily against the DiT calls that read the parameter.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from .._compat import tree_map
from ..errors import JaggCaptureError
from ..graph_ops import live_tensor
from . import example_values

# answered from the real tensor: functions of metadata the cache key holds (or of identity)
_METADATA_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "data_ptr", "storage_offset", "get_device", "__len__",
    "__hash__", "__repr__", "__str__", "__format__", "has_names", "is_pinned", "is_shared",
    # module-state changes, not writes (peft's disable_adapter() flips requires_grad): the FX
    # frontend replays them as module states (runtime/module_state.py)
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook",
})
_IN_PLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__", "__delitem__"})


def _writes(name: str) -> bool:
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


class LiveTensors(TorchFunctionMode):
    """Records ops on live tensors as graph nodes while ``tracer`` traces (module docstring)."""

    def __init__(self, tracer: fx.Tracer, modules: list[nn.Module], where, attr_name):
        super().__init__()
        self.tracer = tracer
        self.where = where                   # () -> "file:line" of the user's frame (or "")
        self.attr_name = attr_name           # module -> its get_attr target in the trace (the tracer's rule)
        self.owned: dict[int, tuple[nn.Module, str]] = {}
        for m in modules:
            for path, t in list(m.named_parameters()) + list(m.named_buffers()):
                self.owned.setdefault(id(t), (m, path))
        self.proxies: dict[int, tuple[torch.Tensor, fx.Proxy]] = {}
        self._suspended = 0

    @contextlib.contextmanager
    def suspended(self):
        """The tracer's own tensor code (fake copies of the inputs, value reads) runs as written."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def is_live(self, x: Any) -> bool:
        return (isinstance(x, torch.Tensor) and not isinstance(x, fx.Proxy)
                and (isinstance(x, nn.Parameter) or id(x) in self.owned or x.requires_grad))

    def _any_live(self, args: tuple, kwargs: dict) -> bool:
        """A live tensor among a torch function's arguments (tensors, or lists of them: a scan, not
        a tree_flatten, since this runs for every op the trace makes)."""
        for x in itertools.chain(args, kwargs.values()):
            if isinstance(x, torch.Tensor):
                if self.is_live(x):
                    return True
            elif isinstance(x, (list, tuple)):
                if any(isinstance(y, torch.Tensor) and self.is_live(y) for y in x):
                    return True
        return False

    def proxy_of(self, x: torch.Tensor) -> fx.Proxy:
        """The one graph value of live tensor ``x`` in this trace."""
        known = self.proxies.get(id(x))
        if known is not None:
            return known[1]
        tracer = self.tracer
        with self.suspended():
            owner = self.owned.get(id(x))
            if owner is not None:
                module, path = owner
                module_proxy = tracer.create_proxy("get_attr", self.attr_name(module), (), {})
                proxy = tracer.create_proxy("call_function", live_tensor, (module_proxy, path), {})
            else:
                name = f"jagg_live_{sum(n.startswith('jagg_live_') for n in tracer.installed)}"
                tracer.installed[name] = x
                proxy = tracer.create_proxy("get_attr", name, (), {})
        self.proxies[id(x)] = (x, proxy)     # x held: its id must not be reused during the trace
        return proxy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._suspended or example_values.running():
            return func(*args, **kwargs)
        if not self._any_live(args, kwargs):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":            # a property: p.dtype, p.shape (metadata), p.data, p.T (values)
            value = func(*args, **kwargs)
            if not isinstance(value, torch.Tensor) or not self.is_live(args[0]):
                return value
            return getattr(self.proxy_of(args[0]), func.__self__.__name__)
        if name in _METADATA_METHODS and self.is_live(args[0] if args else None):
            return func(*args, **kwargs)
        written = args[0] if args else None
        out = kwargs.get("out")
        if (_writes(name) and self.is_live(written)) or self.is_live(out):
            raise JaggCaptureError(
                f"the loss writes in place ({name}) into a parameter or buffer of the model (or a tensor "
                f"that requires grad); the compiled graph could not order that write against the DiT calls that "
                f"read it. Write outside the loss (after the optimizer step), or let Dynamo capture the loss "
                f"(capture='dynamo')", path="fx", where=self.where())
        proxied_args, proxied_kwargs = tree_map(lambda x: self.proxy_of(x) if self.is_live(x) else x, (args, kwargs))
        if args and self.is_live(args[0]) and hasattr(torch.Tensor, name) and getattr(torch, name, None) is not func:
            # a Tensor method (p.pow(2), p ** 2, p[0]): call it on the proxy, which records it
            return getattr(proxied_args[0], name)(*proxied_args[1:], **proxied_kwargs)
        return func(*proxied_args, **proxied_kwargs)
