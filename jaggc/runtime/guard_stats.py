"""The guard's running statistics: cosine, relative error and bias against its noise floor.

The definitions are ``jaggc.calibrate``'s (``jaggc.fidelity.calibrate.ErrorStats``), so that a guard
and an offline calibration of the same batches report the same figures (tests/runtime/test_guard.py):

  * per probe p: J_p the compiled loss's gradient (what its backward put into ``.grad``), X_p the
    exact gradient of the same batch, e_p = J_p − X_p; cosine cos(J_p, X_p), relative error
    |e_p| / |X_p|;
  * over the N probes of a block: bias = |ē| / |X̄| against the noise floor sqrt(tr Cov(e) / N) / |X̄|
    (tr Cov with the N − 1 correction): the |mean error| an unbiased estimator with the same spread
    would show. bias / floor ≈ 1 for an unbiased estimator; a coherent error makes it grow as √N.

Under FSDP the flat vectors are this rank's shards of the gradients (guard_probe.py): every dot
product and squared norm is a sum over the ranks' shards (``ShardedSum``, one all-reduce), so every
rank computes the same figures and takes the same decision. Elsewhere the sum is the identity.

A block is ``probes`` consecutive probes (the "recent probes"): a tumbling window, so that the
statistics hold one running error sum per σ range instead of N stored gradients. The per-range
series e_{p,r} is the part of e_p made by windows whose lowest σ lies in range r (zero in a probe
with no such window), so the ranges' errors add up to the whole.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable

import torch


def sigma_ranges(edges: tuple[float, ...]) -> list[tuple[float, float]]:
    """[(0, e_0), (e_0, e_1), ..., (e_k, 1)] from increasing interior edges in (0, 1)."""
    bounds = (0.0,) + tuple(edges) + (1.0,)
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def range_of(sigma: float, edges: tuple[float, ...]) -> int:
    """Index of the σ range holding ``sigma`` (ranges are [lo, hi), the last one closed)."""
    return bisect.bisect_right(edges, sigma)


def range_label(r: tuple[float, float]) -> str:
    return f"σ∈[{r[0]:g},{r[1]:g}{']' if r[1] >= 1 else ')'}"


def local_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a per-rank partial sum, where every rank holds the whole vector."""
    return t


class ShardedSum:
    """The sum over the ranks of ``group`` of a per-rank partial sum (each rank holds a shard)."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t


def dot(a: torch.Tensor, b: torch.Tensor, reduce=local_sum) -> float:
    return float(reduce(torch.dot(a, b)))


@dataclass
class ProbeResult:
    """One probe: the flat gradients of one batch and the error per σ range and window position.
    Under FSDP the vectors are this rank's shards and ``reduce`` sums over the ranks."""

    index: int                          # which guarded call (0-based) was probed
    jagg: torch.Tensor                  # J_p, flat
    exact: torch.Tensor                 # X_p, flat
    range_errors: dict[int, torch.Tensor]          # σ range -> e_{p,r}
    windows: list[tuple[int, float, float]] = field(default_factory=list)   # (position, lowest σ, |e_w|)
    reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=local_sum, repr=False, compare=False)

    @property
    def error(self) -> torch.Tensor:
        return self.jagg - self.exact

    def norm(self, v: torch.Tensor) -> float:
        return math.sqrt(max(dot(v, v, self.reduce), 0.0))

    @property
    def cosine(self) -> float:
        return dot(self.jagg, self.exact, self.reduce) / max(self.norm(self.jagg) * self.norm(self.exact), 1e-300)

    @property
    def rel_error(self) -> float:
        return self.norm(self.error) / max(self.norm(self.exact), 1e-300)


class ErrorMoments:
    """Σ e and Σ |e|² of one error series; the count is the block's (absent probes add zero)."""

    def __init__(self, reduce=local_sum):
        self.sum: torch.Tensor | None = None
        self.sq = 0.0
        self.reduce = reduce

    def add(self, e: torch.Tensor) -> None:
        # a block loaded from a checkpoint may hold its sums on the CPU (accelerate loads them there)
        self.sum = e.clone() if self.sum is None else self.sum.to(e.device).add_(e)
        self.sq += dot(e, e, self.reduce)

    def bias_and_floor(self, n: int, mean_exact_norm: float) -> tuple[float, float]:
        """(|ē|, floor), both over |X̄|, as calibrate's ErrorStats.bias (floor inf below 2 probes)."""
        if self.sum is None or n == 0:
            return 0.0, math.inf
        mean_err2 = dot(self.sum, self.sum, self.reduce) / n ** 2
        scale = max(mean_exact_norm, 1e-300)
        if n < 2:
            return math.sqrt(mean_err2) / scale, math.inf
        trcov = max(self.sq / n - mean_err2, 0.0) * n / (n - 1)
        return math.sqrt(mean_err2) / scale, math.sqrt(trcov / n) / scale


def _ratio(bias: float, floor: float) -> float:
    if math.isinf(floor):
        return math.nan
    return bias / floor if floor > 0 else (math.inf if bias > 0 else math.nan)


class Block:
    """The running statistics of up to ``size`` consecutive probes (module docstring)."""

    def __init__(self, edges: tuple[float, ...], size: int, reduce=local_sum):
        self.edges, self.size, self.reduce = edges, size, reduce
        self.n = 0
        self.cosines: list[float] = []
        self.rel_errors: list[float] = []
        self.whole = ErrorMoments(reduce)
        self.ranges = [ErrorMoments(reduce) for _ in sigma_ranges(edges)]
        self.range_rel: list[list[float]] = [[] for _ in self.ranges]
        self.exact_sum: torch.Tensor | None = None
        self.windows: dict[int, dict] = {}     # position -> {"sigma": lowest σ seen, "rel": [...]}

    @property
    def full(self) -> bool:
        return self.n >= self.size

    def add(self, probe: ProbeResult) -> None:
        if self.n == 0 and probe.reduce is not self.reduce:
            # the first probe says how its vectors are held (whole, or this rank's shard)
            self.reduce = probe.reduce
            for m in [self.whole, *self.ranges]:
                m.reduce = probe.reduce
        self.n += 1
        exact_norm = probe.norm(probe.exact)
        self.cosines.append(probe.cosine)
        self.rel_errors.append(probe.rel_error)
        self.whole.add(probe.error)
        self.exact_sum = (probe.exact.clone() if self.exact_sum is None
                          else self.exact_sum.to(probe.exact.device).add_(probe.exact))
        for r, moments in enumerate(self.ranges):
            e = probe.range_errors.get(r)
            if e is not None:
                moments.add(e)
            self.range_rel[r].append(0.0 if e is None else probe.norm(e) / max(exact_norm, 1e-300))
        for position, sigma, norm in probe.windows:
            w = self.windows.setdefault(position, {"sigma": sigma, "rel": []})
            w["sigma"] = min(w["sigma"], sigma)
            w["rel"].append(norm / max(exact_norm, 1e-300))

    def state_dict(self) -> dict:
        """What a resumed run needs to continue the block (tensors as they are: under FSDP this rank's
        shards, so every rank saves its own)."""
        moments = [(m.sum, m.sq) for m in [self.whole, *self.ranges]]
        return dict(edges=self.edges, size=self.size, n=self.n, cosines=list(self.cosines),
                    rel_errors=list(self.rel_errors), moments=moments, range_rel=[list(r) for r in self.range_rel],
                    exact_sum=self.exact_sum, windows={k: dict(v, rel=list(v["rel"])) for k, v in self.windows.items()})

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["edges"]) != tuple(self.edges) or len(state["moments"]) != 1 + len(self.ranges):
            raise ValueError(f"a guard block of σ edges {tuple(state['edges'])} cannot continue one of {self.edges}")
        self.n, self.cosines, self.rel_errors = state["n"], list(state["cosines"]), list(state["rel_errors"])
        for m, (total, sq) in zip([self.whole, *self.ranges], state["moments"]):
            m.sum, m.sq = (None if total is None else total.clone()), sq
        self.range_rel = [list(r) for r in state["range_rel"]]
        self.exact_sum = None if state["exact_sum"] is None else state["exact_sum"].clone()
        self.windows = {k: dict(v, rel=list(v["rel"])) for k, v in state["windows"].items()}

    def figures(self) -> dict:
        """The block's figures: whole-gradient cosine / relative error / bias, per σ range and per
        window position (the ranges seen in this block only)."""
        n = self.n
        mean_exact = math.sqrt(max(dot(self.exact_sum, self.exact_sum, self.reduce), 0.0)) / n if n else 0.0
        bias, floor = self.whole.bias_and_floor(n, mean_exact)
        out = dict(probes=n, cosine_mean=_mean(self.cosines), cosine_min=min(self.cosines, default=math.nan),
                   rel_error_mean=_mean(self.rel_errors), bias=bias, floor=floor,
                   bias_over_floor=_ratio(bias, floor), ranges={}, windows={})
        for r, (bounds, moments) in enumerate(zip(sigma_ranges(self.edges), self.ranges)):
            if moments.sum is None:
                continue
            b, f = moments.bias_and_floor(n, mean_exact)
            out["ranges"][r] = dict(label=range_label(bounds), range=bounds, bias=b, floor=f,
                                    bias_over_floor=_ratio(b, f), rel_error_mean=_mean(self.range_rel[r]))
        for position in sorted(self.windows):
            w = self.windows[position]
            out["windows"][position] = dict(sigma_min=w["sigma"], rel_error_mean=_mean(w["rel"]))
        return out


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else math.nan
