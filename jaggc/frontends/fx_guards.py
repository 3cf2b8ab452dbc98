"""What the FX capture's cache key adds for the constants a trace bakes in from outside its arguments.

torch.fx runs the loss's Python once and records only tensor ops: a module-level ``CLIP_RANGE``,
a closure's ``noise_level``, read while tracing, become literals of the graph. Dynamo guards such
reads; FX has no guards, so a changed constant would silently keep the old graph. This module
finds, statically, the constants the loss can read that way: the names its code (and the code of
the Python functions it calls by name: globals, ``module.function``, closure cells, recursively)
looks up in a function's globals, in an imported module, or in a closure cell, whose values are
numbers, strings, dtypes, devices or tuples of them. Their current values join the cache key, so
changing one re-traces.

An argument that is an object (a trainer's config, ``cfg.clip_range`` read in the loss) joins the
key by what it holds (``object_fingerprint``): every number, string, dtype, device it reaches
through attributes, dict entries and list items, and the identity and metadata of the tensors
and modules it holds, so changing ``cfg.clip_range`` re-traces. So does an object in a closure cell
of the loss or of a function it calls. An argument holding more than ``MAX_OBJECT_VALUES`` values
is refused (guarding it would cost more than the capture saves); such an object in a closure is
keyed by identity only, as are objects in module globals (``CONFIG.clip``).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import JaggUnsupportedError

_CONSTANT_TYPES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
# library code is not the user's: its constants do not change between calls of a loss
_LIBRARIES = ("torch", "diffusers", "transformers", "peft", "accelerate", "numpy", "jaggc.runtime",
              "jaggc.frontends", "jaggc.graph_ops", "_pytest", "pluggy")
_MISSING = object()
MAX_OBJECT_VALUES = 512
# keyed by identity: their contents are code, not values a trace reads
_IDENTITY_TYPES = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)


def is_constant(value: Any) -> bool:
    """A value a trace bakes in as a literal: a number, string, dtype, device or tuple of them."""
    if isinstance(value, tuple):
        return all(is_constant(v) for v in value)
    return isinstance(value, _CONSTANT_TYPES)


def _is_user_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and not (value.__module__ or "").startswith(_LIBRARIES)


@dataclass(frozen=True)
class ConstantRead:
    """One constant the loss can read: ``namespace[name]`` (globals or a module's dict) or a cell."""

    where: str                     # "example_losses.CLIP_RANGE", for reports
    namespace: Any
    name: str | None = None        # None: ``namespace`` is a closure cell
    holds_object: bool = False     # a closure's object (a config): keyed by what it holds

    def value(self) -> tuple:
        if self.name is None:
            try:
                v = self.namespace.cell_contents
            except ValueError:     # an empty cell
                v = _MISSING
        else:
            v = self.namespace.get(self.name, _MISSING)
        if self.holds_object and v is not _MISSING and not is_constant(v):
            try:
                return ("object", object_fingerprint(v, self.where))
            except JaggUnsupportedError:
                return ("object", type(v).__name__, id(v))    # too big to key by content: by identity
        # type first: 1, 1.0 and True are equal but trace differently
        return (type(v).__name__, v if is_constant(v) else id(v))


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def constant_reads(fn: Callable) -> list[ConstantRead]:
    """The constants ``fn`` and the user functions it names can read (module docstring)."""
    reads: dict[tuple, ConstantRead] = {}
    pending, seen = [fn], set()
    while pending:
        f = pending.pop()
        f = getattr(f, "__wrapped__", f)
        if not isinstance(f, types.FunctionType) or f.__code__ in seen:
            continue
        seen.add(f.__code__)
        names = {n for code in _codes(f.__code__) for n in code.co_names}
        module = f.__module__ or "?"
        for name in sorted(names):
            value = f.__globals__.get(name, _MISSING)
            if is_constant(value):
                reads.setdefault((id(f.__globals__), name), ConstantRead(f"{module}.{name}", f.__globals__, name))
            elif _is_user_function(value):
                pending.append(value)
            elif isinstance(value, types.ModuleType) and not value.__name__.startswith(_LIBRARIES):
                for attr in sorted(names):
                    inner = value.__dict__.get(attr, _MISSING)
                    if is_constant(inner):
                        reads.setdefault((id(value.__dict__), attr),
                                         ConstantRead(f"{value.__name__}.{attr}", value.__dict__, attr))
                    elif _is_user_function(inner):
                        pending.append(inner)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if _is_user_function(value):
                pending.append(value)
            elif not isinstance(value, (nn.Module, torch.Tensor) + _IDENTITY_TYPES):
                reads.setdefault((id(cell), None), ConstantRead(f"{f.__qualname__}.<closure {name}>", cell,
                                                                holds_object=not is_constant(value)))
    return list(reads.values())


def _children(value: Any):
    """(name, child) pairs of a container or an object's state; None for an opaque value."""
    if isinstance(value, dict):
        return [(repr(k), v) for k, v in value.items()]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [(f"[{i}]", v) for i, v in enumerate(items)]
    if dataclasses.is_dataclass(value):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    state = getattr(value, "__dict__", None)
    slots = [n for cls in type(value).__mro__ for n in getattr(cls, "__slots__", ()) if hasattr(value, n)]
    if state is None and not slots:
        return None
    return list((state or {}).items()) + [(n, getattr(value, n)) for n in slots]


def object_fingerprint(value: Any, name: str) -> tuple:
    """What the FX trace may have read from the argument ``name`` (module docstring)."""
    out: list[tuple] = []
    stack, seen = [(name, value)], set()
    while stack:
        path, v = stack.pop()
        if is_constant(v):
            out.append((path, type(v).__name__, v))
        elif isinstance(v, torch.Tensor):
            out.append((path, "tensor", id(v), tuple(v.shape), v.dtype, v.device))
        elif isinstance(v, nn.Module) or isinstance(v, _IDENTITY_TYPES) or id(v) in seen:
            out.append((path, "id", id(v)))
        else:
            seen.add(id(v))
            children = _children(v)
            if children is None:
                out.append((path, type(v).__name__, id(v)))
            else:
                out.append((path, type(v).__name__, len(children)))
                stack.extend((f"{path}.{k}", c) for k, c in reversed(children))
        if len(out) > MAX_OBJECT_VALUES:
            raise JaggUnsupportedError(
                f"argument {name!r} ({type(value).__name__}) holds more than {MAX_OBJECT_VALUES} values; the FX "
                f"capture keys its graph on every value an argument object holds (the trace may have baked any "
                f"of them in). Pass the values the loss reads as arguments, or use capture='dynamo'")
    return tuple(out)
