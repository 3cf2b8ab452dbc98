"""``jaggc_studies.loops.bookkeeping --direct``: jaggc's own time timed inside the loops, on a tiny run.

The measurement subtracts the time inside the DiT's forward and its backward passes from each loop's
process time; if it did not catch them (a forward not through the timed one, a nested backward missed),
the remainder would hold whole DiT passes. Checked here: both loops' remainders are well below one
trajectory's DiT passes (each is a few milliseconds of Python against the passes' tens), and the study
restores ``torch.autograd.backward``. No timing claim: the figures come from the study's command."""

from __future__ import annotations

import pytest
import torch

from jaggc_studies.loops import bookkeeping

pytestmark = pytest.mark.usefixtures("one_thread")


def test_direct_measurement_leaves_the_dit_passes_out(monkeypatch):
    monkeypatch.setattr(bookkeeping, "BATCH", 16)
    backward = torch.autograd.backward
    out = bookkeeping.direct(4, trajectories=3, rounds=1)
    assert torch.autograd.backward is backward
    assert out["tensors"] > 0 and out["loop_own_ms"] > 0 and out["jaggc_own_ms"] > 0
    # the passes of one trajectory: 2 (F + B) + 2 F of the digits DiT at batch 16, timed here alone
    dit, cond, zs, gs, sigmas = bookkeeping.problem(4)
    import time

    start = time.process_time()
    for _ in range(3):
        bookkeeping.passes(dit, cond, zs, gs, sigmas)
    passes_ms = 1e3 * (time.process_time() - start) / 3
    assert out["loop_own_ms"] < passes_ms / 2, (out, passes_ms)
