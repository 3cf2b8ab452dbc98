"""The window runtime: JAGG on plain autograd through the normal ``dit(...)`` call."""

from .aggregate import KnotAggregate, aggregate_knots
from .calls import DitCall, concat_calls, split_output
from .counters import PassCounts, count_dit_passes
from .rollout_cache import RolloutCache
from .routing import Routing
from .trajectory import jagg_calls
from .transaction import atomic_step
from .weights import Basis, hat_matrix, lagrange_matrix, resolve_basis
from .window import WindowOptions, partition, run_exact, run_window

__all__ = [
    "atomic_step",
    "Basis", "DitCall", "KnotAggregate", "PassCounts", "RolloutCache", "Routing", "WindowOptions", "aggregate_knots", "concat_calls",
    "count_dit_passes", "hat_matrix", "jagg_calls", "lagrange_matrix", "partition", "resolve_basis",
    "run_exact", "run_window", "split_output",
]
