"""The guard's agreement between ranks: before a probe's collectives, every rank must make them.

A probe's reductions (guard_stats.py) and, under FSDP, its windows' backward passes are collectives;
a rank that makes one its peers do not make hangs them, or pairs its figures with another probe's.
These small all-reduces run first and turn such a mismatch into a JaggInputError naming it
(docs/guard.md, "What every rank agrees on"): whether a unit is probed (``agree_on_probe``),
whether every rank kept its probe (``agree_all``), and, under FSDP, the number of windows and each
window's lowest σ over the ranks (``agree_on_windows``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import agree


def agree_on_probe(probed: bool, index: int, *, group=None, what: str) -> None:
    """Every rank probes the same trajectories: one small all-reduce per guarded unit (probed or not)
    before any of a probe's collectives, so that a rank that probes alone (another ``Guard(every=...)``,
    a guard state loaded on one rank only, a rank with more guarded trajectories) is a JaggInputError
    naming it, never a collective another rank does not join."""
    flags = agree([int(probed), -int(probed), index, -index], dist.ReduceOp.MAX, group=group)
    if int(flags[0]) != -int(flags[1]) or int(flags[2]) != -int(flags[3]):
        from ..errors import JaggInputError

        raise JaggInputError(
            f"{what}: the ranks' guards disagree on this unit (this rank: probed={probed}, guarded unit {index}; over "
            f"the ranks: probed {bool(-int(flags[1]))}..{bool(int(flags[0]))}, units {-int(flags[3])}..{int(flags[2])}). "
            f"A probe's collectives need every rank: build the Guard alike on every rank (the same every=...), guard "
            f"as many trajectories on each, and on resume load each rank's own guard state")


def agree_all(flag: bool, *, group=None) -> bool:
    """True if ``flag`` holds on every rank (one small all-reduce)."""
    return bool(agree([int(flag)], dist.ReduceOp.MIN, group=group)[0])


def agree_on_windows(sigmas: list[float], *, group=None, what: str) -> list[float]:
    """Under FSDP, where each window's error is a shard of the ranks' average: every rank's probe must
    measure as many windows (each a collective backward), and files each under the σ range of its
    lowest σ over the ranks (one window of the ranks' joint trajectory). Two small all-reduces; a
    rank with another number of windows is a JaggInputError naming the counts, not a hang."""
    n = len(sigmas)
    sizes = agree([n, -n], dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != -int(sizes[1]):
        from ..errors import JaggInputError

        raise JaggInputError(
            f"{what}: the ranks' probes hold different numbers of JAGG windows ({-int(sizes[1])} to {int(sizes[0])}; "
            f"this rank {n}), and under FSDP each window's error is measured by a collective backward. Every rank "
            f"must train as many steps per trajectory, in as many windows (the same window, basis and guard)")
    if n == 0:
        return []
    return agree(sigmas, dist.ReduceOp.MIN, group=group, dtype=torch.float64)


__all__ = ["agree_all", "agree_on_probe", "agree_on_windows"]
