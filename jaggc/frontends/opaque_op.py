"""The opaque DiT call as a ``torch.library`` custom op: the cheap capture path.

Dynamo keeps a ``nonstrict_trace``d call opaque by symbolically running pytree over its arguments
and outputs: ≈ 0.15 s of tracing per DiT call, most of a long loss's capture. A custom op costs
Dynamo one node. So when a DiT call has the common shape (every argument a tensor or a plain
constant, ``return_dict=False`` so the output is a tuple of tensors), the call slot sends it through
``jaggc::opaque_dit(tensors, handle)`` instead: the tensors are the op's inputs, and everything else
(which module, which slot, the argument names and constants) is a *call site* registered under an
int ``handle``, computed at trace time by ``site_handle`` (``assume_constant_result``: Dynamo calls
it and records the int as a constant). The op's fake implementation rebuilds the call and runs
the module's fake run (``frontends.dynamo``: placement conforming, the fake-output cache, the
distributed real run). ``canonicalize_dynamo_calls`` turns every op node into ``dit_call``; the op
itself never runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import _compat
from ..errors import JaggGraphError

_CONSTANTS = (bool, int, float, str)


@dataclass(frozen=True)
class CallSite:
    module: "weakref.ref[nn.Module]"
    via_call: bool                       # reached through Module.__call__ (False: through .forward)
    num_args: int
    names: tuple[str, ...]               # keyword names, in call order
    constants: tuple                     # per argument: (False, None) for a tensor, (True, value)

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        """(args, kwargs) with ``tensors`` (values or graph nodes) in the tensor positions."""
        it = iter(tensors)
        values = [value if is_const else next(it) for is_const, value in self.constants]
        return tuple(values[:self.num_args]), dict(zip(self.names, values[self.num_args:]))


_SITES: dict[int, CallSite] = {}
_OUTPUT_KINDS: dict[int, str] = {}       # handle -> "tensor" | "tuple" | "list", set by the fake run
_HANDLES: dict[tuple, int] = {}
_MODULES: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_FAKE_RUNS: "weakref.WeakKeyDictionary[nn.Module, tuple[Callable, Callable]]" = weakref.WeakKeyDictionary()


def register_module(module: nn.Module, fake_call: Callable, fake_forward: Callable) -> int:
    """An int the call slots of ``module`` close over; ``fake_call`` / ``fake_forward`` run the
    module on the trace's fake tensors (through ``__call__`` / ``forward``)."""
    _MODULES[id(module)] = module
    _FAKE_RUNS[module] = (fake_call, fake_forward)
    return id(module)


@_compat.assume_constant_result
def site_handle(module_key: int, via_call: bool, num_args: int, names: tuple, constants: tuple) -> int:
    key = (module_key, via_call, num_args, names, constants)
    module = _MODULES[module_key]
    handle = _HANDLES.get(key)
    # module_key is an id(): a new module may reuse a collected one's id, and must get its own site
    if handle is None or _SITES[handle].module() is not module:
        handle = _HANDLES[key] = len(_SITES)
        _SITES[handle] = CallSite(weakref.ref(module), via_call, num_args, names, constants)
    return handle


@torch.library.custom_op("jaggc::opaque_dit", mutates_args=())
def opaque_dit(tensors: list[torch.Tensor], handle: int) -> list[torch.Tensor]:
    raise JaggGraphError("internal error: a jaggc opaque DiT call was executed; canonicalize_dynamo_calls "
                         "replaces every one of them before the graph runs")


@opaque_dit.register_fake
def _opaque_dit_fake(tensors, handle):
    site = _SITES[handle]
    module = site.module()
    args, kwargs = site.rebuild(tensors)
    with _compat.fake_mode_accepts_real_tensors():
        out = _FAKE_RUNS[module][0 if site.via_call else 1](*args, **kwargs)
    if isinstance(out, torch.Tensor):
        _OUTPUT_KINDS[handle] = "tensor"
        return [out]
    if not isinstance(out, (tuple, list)) or not all(isinstance(x, torch.Tensor) for x in out):
        raise JaggGraphError(f"the DiT ({type(module).__name__}) called with return_dict=False returned "
                             f"{type(out).__name__}; jaggc's capture expects a tensor or a tuple of tensors")
    _OUTPUT_KINDS[handle] = type(out).__name__
    return list(out)


@_compat.assume_constant_result
def output_kind(handle: int) -> str:
    """How the op's flat output is handed back (known once the op's fake run has happened)."""
    return _OUTPUT_KINDS[handle]


def fast_call(module_key: int, via_call: bool, args: tuple, kwargs: dict):
    """The call slot's fast path (inlined by Dynamo; graph nodes are named after ``dit_arg``)."""
    values = args + tuple(kwargs.values())
    tensors = [dit_arg for dit_arg in values if isinstance(dit_arg, torch.Tensor)]
    constants = tuple((False, None) if isinstance(dit_arg, torch.Tensor) else (True, dit_arg) for dit_arg in values)
    handle = site_handle(module_key, via_call, len(args), tuple(kwargs), constants)
    outs = torch.ops.jaggc.opaque_dit(tensors, handle)
    kind = output_kind(handle)
    if kind == "tensor":
        return outs[0]
    return list(outs) if kind == "list" else tuple(outs)


def takes_fast_path(args: tuple, kwargs: dict) -> bool:
    """Only in code Dynamo traces symbolically (``is_dynamo_compiling`` is False in eager code, which
    includes the fake and real runs made during a trace and the rewritten graph's own DiT calls),
    and only for every argument a tensor or a plain constant and a tuple output
    (``return_dict=False``)."""
    if not torch.compiler.is_dynamo_compiling() or kwargs.get("return_dict", True) is not False:
        return False
    return all(v is None or isinstance(v, (torch.Tensor,) + _CONSTANTS) for v in args + tuple(kwargs.values()))


def is_opaque_op_node(node) -> bool:
    return node.op == "call_function" and node.target in (torch.ops.jaggc.opaque_dit,
                                                         torch.ops.jaggc.opaque_dit.default)


def site_of(node) -> CallSite:
    return _SITES[node.args[1]]


def call_of(node) -> tuple[nn.Module, tuple, dict, bool]:
    """(module, args, kwargs with graph nodes, via_call) of an opaque op node."""
    site = site_of(node)
    module = site.module()
    if module is None:
        raise JaggGraphError(f"node {node.name}: the DiT module of this call no longer exists")
    args, kwargs = site.rebuild(node.args[0])
    return module, args, kwargs, site.via_call


__all__ = ["CallSite", "call_of", "fast_call", "is_opaque_op_node", "register_module", "takes_fast_path"]
