"""What the FX capture's cache key adds for the constants a trace bakes in from outside its arguments.

torch.fx runs the loss's Python once and records only tensor ops: a module-level ``CLIP_RANGE``,
a closure's ``noise_level``, read while tracing, become literals of the graph. Dynamo guards such
reads; FX has no guards, so a changed constant would silently keep the old graph. This module
finds, statically, the constants the loss can read that way: the names its code (and the code of
the Python functions it calls by name: globals, ``module.function``, closure cells, recursively)
looks up in a function's globals, in an imported module, or in a closure cell, whose values are
numbers, strings, dtypes, devices or tuples of them. Their current values join the cache key, so
changing one re-traces. Constants reached through objects (``self.cfg.clip``) are not found;
they are arguments' attributes, and the README says to pass them as arguments or use Dynamo.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

_CONSTANT_TYPES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
# library code is not the user's: its constants do not change between calls of a loss
_LIBRARIES = ("torch", "diffusers", "transformers", "peft", "accelerate", "numpy", "jaggc.runtime",
              "jaggc.frontends", "jaggc.graph_ops")
_MISSING = object()


def _is_constant(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_is_constant(v) for v in value)
    return isinstance(value, _CONSTANT_TYPES)


def _is_user_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and not (value.__module__ or "").startswith(_LIBRARIES)


@dataclass(frozen=True)
class ConstantRead:
    """One constant the loss can read: ``namespace[name]`` (globals or a module's dict) or a cell."""

    where: str                     # "example_losses.CLIP_RANGE", for reports
    namespace: Any
    name: str | None = None        # None: ``namespace`` is a closure cell

    def value(self) -> tuple:
        if self.name is None:
            try:
                v = self.namespace.cell_contents
            except ValueError:     # an empty cell
                v = _MISSING
        else:
            v = self.namespace.get(self.name, _MISSING)
        # type first: 1, 1.0 and True are equal but trace differently
        return (type(v).__name__, v if _is_constant(v) else id(v))


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
            if _is_constant(value):
                reads.setdefault((id(f.__globals__), name), ConstantRead(f"{module}.{name}", f.__globals__, name))
            elif _is_user_function(value):
                pending.append(value)
            elif isinstance(value, types.ModuleType) and not value.__name__.startswith(_LIBRARIES):
                for attr in sorted(names):
                    inner = value.__dict__.get(attr, _MISSING)
                    if _is_constant(inner):
                        reads.setdefault((id(value.__dict__), attr),
                                         ConstantRead(f"{value.__name__}.{attr}", value.__dict__, attr))
                    elif _is_user_function(inner):
                        pending.append(inner)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if _is_constant(value):
                reads.setdefault((id(cell), None), ConstantRead(f"{f.__qualname__}.<closure {name}>", cell))
            elif _is_user_function(value):
                pending.append(value)
    return list(reads.values())
