"""The roles the pieces of ``jaggc.stepwise`` play for each other, as the types they share.

``stepwise.py``'s ``Stepwise`` owns each trajectory's ``TrajectoryRun`` (run.py), its ``Safety`` rules
(safety.py) and its re-runs (rerun.py); those read back what the owner holds. They name it by the
protocol ``StepwiseOwner`` (and a re-run names its trajectory by ``RunOfSteps``) instead of importing
the owner's module, so no two modules of the package import each other. ``StepVisit``, one step's
call as jaggc ran it, lives here because the run records it and the re-run replays it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ContextManager, Protocol

import torch
from torch import nn

from .._compat import tree_flatten, version_counter
from ..backward_modes import BackwardMode
from ..runtime.calls import DitCall
from ..runtime.module_state import CallState, StateReader
from .plan import PlannedWindow


@dataclass
class StepVisit:
    """One step's call as jaggc ran it, and what its window's backward needs of it."""

    step: int
    call: DitCall
    state: CallState
    rng: Any                               # the RNG states the call ran with (_compat.RngStates: a re-run draws the same)
    inputs: list                           # (tensor, version) of its tensor inputs: a re-run needs them unchanged
    where: str                             # the user's file:line of the call
    index: list[int] = field(default_factory=list)     # the tapped (floating) output leaves
    held: Any = None                       # the DiT's output with its graph (a held knot; its rows with grad)
    grads: list | None = None              # g_k per tapped leaf, once the step's backward ran
    exact: bool = False                    # ran as written (its own DiT backward)
    rows: Any = None                       # slicing.RowSlice: only these rows run with grad (the CFG slice)
    probe_graph: Any = None                # an interior step's output with grad in a probed trajectory (probe.py)
    now: Any = None                        # first-order serving: a knot's visible output, detached
    recorded_rows: list | None = None      # first-order serving: a knot's rows in the recording
    drew: bool = False                     # its forward drew random numbers (dropout of any kind: module,
                                           # F.dropout, attention's dropout_p): it re-runs alone, from ``rng``


def detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def input_versions(call: DitCall) -> list:
    """(tensor, version) of ``call``'s tensor inputs (``StepVisit.inputs``)."""
    return [(x, version_counter(x)) for x in tree_flatten((call.args, call.kwargs))[0] if isinstance(x, torch.Tensor)]


class WindowRun:
    """One planned window of a trajectory at run time: its steps' visits, and what serving it needs."""

    def __init__(self, planned: PlannedWindow):
        self.planned = planned
        self.visits: dict[int, StepVisit] = {}
        self.exact = planned.exact
        self.done = False
        self.dropped: set[int] = set()     # steps a zero_grad wiped before the window completed
        self.jagg = False                  # its backward sends knot composites (window_entries)
        self.prefetched: dict = {}     # knots forwarded before their step (serving.py's Prefetched)
        self.linked: dict[int, tuple] = {}            # a knot's (call, recorded rows) for first-order serving
        self.interior_ahead: dict = {}     # interior steps forwarded together before their step (serving.py)

    @property
    def open(self) -> bool:
        """Visited steps still waiting to contribute to ``.grad``."""
        return not self.done and any(not v.exact for v in self.visits.values())

    def pending(self) -> list[StepVisit]:
        return [v for v in self.visits.values() if not v.exact]


class StepwiseOwner(Protocol):
    """What a trajectory's run, its re-runs and its safety rules read of the ``Stepwise`` that owns
    them (stepwise.py)."""

    module: nn.Module
    options: Any            # jaggc.Options
    backward: BackwardMode
    basis: Any              # runtime.weights.Basis
    counts: Any             # stepwise.StepwiseCounts
    slicer: Any             # slicing.SliceLearner, or None (the CFG slice off)
    cache: Any              # runtime.rollout_cache.RolloutCache, or None (no rollout cache)
    ledger: Any             # ledger.Ledger
    safety: Any             # safety.Safety
    ddp: nn.Module | None
    fsdp: int
    fsdp1: bool             # FSDP1: its forward hands the parameters new views of its flat gradient
    distributed: bool
    notes: list[str]

    def holds_graphs(self, run: Any) -> bool: ...

    def left_order(self, run: Any) -> None: ...

    def passing_through(self) -> ContextManager: ...

    def drop(self, run: Any) -> None: ...


class RunOfSteps(Protocol):
    """What a re-run reads of the trajectory it re-runs calls of (run.py's ``TrajectoryRun``)."""

    owner: StepwiseOwner
    latest: StepVisit | None
    dropouts: list[nn.Module]
    states: StateReader
    devices: tuple


__all__ = ["RunOfSteps", "StepVisit", "StepwiseOwner", "WindowRun", "detached", "input_versions"]
