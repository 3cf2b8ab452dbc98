"""The FX frontend: trace the loss with ``torch.fx`` (``fx.py``), keep one rewritten graph per
structure of the inputs (``fx_cache.py``), run it.

A trace bakes in what it read as Python: the constants of the loss's globals, the modules'
states, tensor metadata, the grad mode and autocast state it was entered in, and the values read
from tensors (``float(sigma)``). The first five make the cache key; the values read are checked by
each cached graph's guard, so a changed value selects (or traces) another graph, never a stale one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _compat
from ..runtime.autocast import current_autocast
from ..runtime.module_state import module_state
from .contract import Session, bind_loss
from .epilogue import check_ran, modes_restored, traced_aliasing
from .fx import capture_fx
from .fx_cache import FxEntry, FxGraphCache
from .fx_guards import constant_reads, is_constant, object_fingerprint


class FxFrontend:
    name = "fx"

    def __init__(self, session: Session, qualname: str):
        self.session = session
        self.qualname = qualname
        self.cache = FxGraphCache(qualname)
        self.reads = None     # the loss's constant reads (globals, closure cells): part of the key

    def reset(self) -> None:
        pass   # the cache is keyed by everything the traces depend on: nothing goes stale

    def cache_key(self, bound, candidates: list[nn.Module]) -> tuple:
        """What a trace depends on besides the guarded value reads (module docstring). The graph's
        mode switches are absolute, from the modes it was traced in, so another caller state (a
        whole-loss autocast) is another graph."""
        if self.reads is None:
            self.reads = constant_reads(self.session.fn)
        return (structure_key(bound.arguments), tuple(read.value() for read in self.reads), torch.is_grad_enabled(),
                current_autocast(), tuple(module_state(m, hooks=False) for m in candidates))

    def run(self, args: tuple, kwargs: dict) -> Any:
        bound = bind_loss(self.session.fn, args, kwargs, defaults=True)   # the trace bakes defaults in
        candidates = self.session.candidates(args, kwargs)
        key = self.cache_key(bound, candidates)
        values = tuple(bound.arguments.values())
        entry = self.cache.lookup(key, values)
        new = entry is None
        if new:
            captured = capture_fx(self.session.fn, args, kwargs, candidates)
            gm, report = self.session.rewrite(captured, self.name)
            report.guarded_reads = len(captured.guard) if captured.guard is not None else 0
            entry = FxEntry(gm, report, captured.guard, aliasing=traced_aliasing(gm, values))
            changed = self.cache.add(key, entry, values)
            if changed:
                report.notes.append("re-traced: values read as Python numbers changed: " + "; ".join(changed[:3]))
        self.session.show(entry.report)
        with modes_restored():
            out = entry.gm(*values)
        return check_ran(out, candidates, self.qualname, new_graph=new)


def structure_key(arguments: dict) -> tuple:
    """What the FX trace depends on in the (bound) arguments: tensor metadata, module identity
    and parameter dtypes/devices, constants by value, objects by everything they hold."""
    parts = []
    for name, value in arguments.items():
        leaves, spec = _compat.tree_flatten(value)
        parts.append((name, str(spec)))
        for x in leaves:
            if isinstance(x, torch.Tensor):
                parts.append(("T", tuple(x.shape), x.dtype, x.device.type, x.requires_grad))
            elif isinstance(x, nn.Module):
                # the FX trace answered the loss's dtype/device questions about the DiT's output (and
                # `next(dit.parameters()).dtype`) for these parameters: model.half() must retrace
                parts.append(("M", id(x), tuple(sorted({(str(p.dtype), str(p.device)) for p in x.parameters()}))))
            elif is_constant(x):
                parts.append(("C", type(x).__name__, x))
            else:
                parts.append(("O", object_fingerprint(x, name)))
    return tuple(parts)


__all__ = ["FxFrontend", "structure_key"]
