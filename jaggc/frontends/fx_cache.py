"""The FX captures of one compiled loss, keyed by what each trace depends on.

A trace depends on (a) the arguments' structure, tensor metadata and constants, the constants the
loss reads from globals and closures, the caller's grad mode and the DiT's module state: the
*key*, compared by equality; and (b) the tensor values it read as Python values (a schedule entry
under ``math.sqrt``, a step index from ``nonzero().item()``): checked by each capture's *guard*,
which re-runs those reads. A key holds several captures when only read values differ (DanceGRPO
trains a fresh subset of steps per sample: one capture per subset), most recently used first.

The cache is bounded (``MAX_ENTRIES``, least recently used dropped first) and counts traces per
key: a loss that keeps re-tracing because a value it reads keeps changing is reported once, with
the reads that changed, instead of silently paying a trace per call.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from .epilogue import aliasing_holds
from .value_reads import Guard

MAX_ENTRIES = 64
RETRACE_WARNING = 8     # traces of one key before the loss is reported as re-tracing


@dataclass
class FxEntry:
    gm: fx.GraphModule
    report: Any
    guard: Guard | None
    aliasing: tuple | None = None      # a graph that writes into its inputs: their traced storage sharing


@dataclass
class _Key:
    entries: list[FxEntry] = field(default_factory=list)
    traces: int = 0
    reasons: list[str] = field(default_factory=list)


class FxGraphCache:
    def __init__(self, name: str):
        self.name = name
        self._keys: "OrderedDict[Any, _Key]" = OrderedDict()
        self.warned = False

    def __len__(self) -> int:
        return sum(len(k.entries) for k in self._keys.values())

    def lookup(self, key, args: tuple) -> FxEntry | None:
        slot = self._keys.get(key)
        if slot is None:
            return None
        self._keys.move_to_end(key)
        for i, entry in enumerate(slot.entries):
            if not aliasing_holds(entry.aliasing, args):
                continue    # the inputs share storage otherwise than traced (aliasing.py): trace again
            if entry.guard is None or entry.guard.check(*args):
                if i:
                    slot.entries.insert(0, slot.entries.pop(i))
                return entry
        return None

    def add(self, key, entry: FxEntry, args: tuple) -> list[str]:
        """Store a new capture; returns the reads that changed if ``key`` was traced before."""
        slot = self._keys.setdefault(key, _Key())
        self._keys.move_to_end(key)
        changed = slot.entries[0].guard.changed(*args) if slot.entries and slot.entries[0].guard else []
        slot.entries.insert(0, entry)
        slot.traces += 1
        if changed:
            slot.reasons = changed
        while len(self) > MAX_ENTRIES:
            oldest = next(iter(self._keys.values()))
            oldest.entries.pop()
            if not oldest.entries:
                self._keys.popitem(last=False)
        if slot.traces == RETRACE_WARNING and not self.warned:
            self.warned = True
            shown = "; ".join(slot.reasons[:3]) + (f" (and {len(slot.reasons) - 3} more)" if len(slot.reasons) > 3 else "")
            warnings.warn(
                f"jaggc: {self.name} was traced {slot.traces} times for inputs of one shape because tensor values "
                f"it reads as Python numbers changed (latest: {shown}). Each new value costs one FX trace (see "
                f"report.traces). Expected for a new subset of steps per sample (DanceGRPO); otherwise compute "
                f"the value with tensor ops or pass it in as a Python number", stacklevel=4)
        return changed
