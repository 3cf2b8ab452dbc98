"""The guard's measure of off-policy serving (``rollout_cache="first_order"``) in a probed trajectory.

A probed trajectory is never served: its interior steps run their forwards (the probe needs their
graphs, or under FSDP their true outputs), so the loop sees the true outputs v_k(θ + δ). There the
probe measures what serving would have given, at no extra forward: for each interior step the
cache could have served, the formula's output (runtime/first_order.py) from the recorded rows and the
knots' outputs the loop computed, against the true output, once the trajectory ends:

* ``rel_error`` = |served − true| / |true| over the served steps' outputs (root of summed squares);
* ``change_error`` = |served − true| / |true − recorded|: the share of the change since the recording
  the formula mispredicts (1: no better than the stale recorded output).

Under DDP/FSDP/DeepSpeed the sums are the ranks' (one all-reduce), so every rank sees the same figures
and takes the same decision. With ``Guard(on_drift="adapt")`` or ``"exact"``, a probe whose
``rel_error`` exceeds ``FirstOrder(max_served_error=...)`` stops the serving (announced): the interior
steps forward from then on. The cosine of the loss's upstream gradients at served against true outputs
(the figure the studies report) needs a second pass of the loop's step on the served outputs, which
the per-step path does not have: it is measured by ``python -m jaggc_studies.digits.first_order_fidelity``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import tree_flatten
from ..runtime.first_order import serve_output


@dataclass(frozen=True)
class ServedFigures:
    """One probe's measure of serving (module docstring)."""

    trajectory: int
    steps: int              # interior steps measured (over the ranks)
    rel_error: float
    change_error: float


class ServedProbe:
    """The interior steps of one probed trajectory that serving would have served, and their figures."""

    def __init__(self):
        self.pending: list[tuple[Any, Any, tuple, Any]] = []     # (window, visit, terms, true output)

    def note(self, win, visit, terms: tuple, true_output: Any) -> None:
        self.pending.append((win, visit, terms, true_output))

    def figures(self, run, index: int) -> ServedFigures:
        """The figures of the trajectory ``run`` (steps/run.py), over the ranks where it is distributed:
        every rank calls this at its probe's end (one all-reduce)."""
        sums = [0.0, 0.0, 0.0, 0.0]          # |served − true|², |true|², |true − recorded|², steps
        for win, visit, (table, rows, knots, weights), true in self.pending:
            if not all(run.knot_output_known(win, step, knot_rows) for step, _, knot_rows in knots):
                continue                       # a knot the loop never reached, or reached on other rows
            recorded = table.output(rows)
            served = serve_output(recorded, [table.output(r) for _, _, r in knots],
                                  [win.visits[step].now for step, _, _ in knots], weights, len(rows))
            for s, t, r in zip(*(tree_flatten(x)[0] for x in (served, true, recorded))):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t = t.detach().double()
                    sums[0] += float((s.double() - t).pow(2).sum())
                    sums[1] += float(t.pow(2).sum())
                    sums[2] += float((t - r.double()).pow(2).sum())
            sums[3] += 1
        self.pending = []
        if run.owner.distributed:
            import torch.distributed as dist

            from ..runtime.collectives import agree

            sums = agree(sums, dist.ReduceOp.SUM, group=run.owner.engine.process_group(), dtype=torch.float64)
        diff, true, change, steps = sums
        return ServedFigures(index, int(steps), math.sqrt(diff / true) if true > 0 else 0.0,
                             math.sqrt(diff / change) if change > 0 else 0.0)


__all__ = ["ServedFigures", "ServedProbe"]
