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
product and squared norm is a sum over the ranks' shards (``ShardedSum``). A probe's scalars are ONE
float64 all-reduce of a fixed layout over the fixed σ range table (``Block._reduce``: zero where this
rank has nothing), the same on every rank whatever windows each rank trained, with the probe's index
in it so that ranks reducing different probes are named (a JaggInputError), never averaged; every
rank computes the same figures and takes the same decision. Elsewhere the sum is the identity. The
agreement collectives before a probe's (guard_ranks.py) make a rank that
probes alone, or holds another number of windows, an error instead of a hang (docs/guard.md).

Dot products and norms accumulate in float64 whatever the gradients' dtype (``local_dot``).

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

from .flat_buffers import FlatBuffers


def sigma_ranges(edges: tuple[float, ...]) -> list[tuple[float, float]]:
    """[(0, e_0), (e_0, e_1), ..., (e_k, 1)] from increasing interior edges in (0, 1)."""
    bounds = (0.0,) + tuple(edges) + (1.0,)
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def range_of(sigma: float, edges: tuple[float, ...]) -> int:
    """Index of the σ range holding ``sigma`` (ranges are [lo, hi), the last one closed)."""
    return bisect.bisect_right(edges, sigma)


def range_label(r: tuple[float, float]) -> str:
    return f"σ∈[{r[0]:g},{r[1]:g}{']' if r[1] >= 1 else ')'}"


class LocalSum:
    """The sum over ranks of a per-rank partial sum, where every rank holds the whole vector: itself."""

    world = 1

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t


local_sum = LocalSum()


class ShardedSum:
    """The sum over the ranks of ``group`` of a per-rank partial sum (each rank holds a shard)."""

    def __init__(self, group=None):
        self.group = group

    @property
    def world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(group=self.group)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        from .collectives import all_reduce_tensor

        return all_reduce_tensor(t.detach().clone(), group=self.group)


#: elements per float64 chunk of a dot product, by device type: on the CPU a 512 KiB chunk stays in
#: cache, and converting it costs about what float32's own dot does (1M-element chunks were 20x
#: slower: page faults and cache misses); an accelerator wants few, large kernels (32 MiB copies)
DOT_CHUNK = {"cpu": 1 << 16}
DOT_CHUNK_ACCELERATOR = 1 << 22
#: the CPU's chunk when a held scratch matrix takes the float64 copies (``local_dots``)
WIDE_CHUNK = {"cpu": 1 << 18}


def dot_chunk(device) -> int:
    return DOT_CHUNK.get(torch.device(device).type, DOT_CHUNK_ACCELERATOR)


def local_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """This rank's a·b, a 0-d float64 tensor accumulated in float64 whatever the vectors' dtype
    (float32's own accumulation loses ~1e-5 of a cosine at a few million parameters: issue 48);
    chunked (``dot_chunk``), so that the float64 copies stay small and, on the CPU, in cache."""
    if a.dtype == torch.float64 and b.dtype == torch.float64:
        return torch.dot(a, b)
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    step = dot_chunk(a.device)
    for i in range(0, a.numel(), step):
        total += torch.dot(a[i:i + step].double(), b[i:i + step].double())
    return total


def local_dots(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]], device,
               buffers: FlatBuffers | None = None) -> torch.Tensor:
    """``[local_dot(a, b) for a, b in pairs]`` (None: zero) as one float64 vector, in ONE chunked pass:
    each vector's chunk converted to float64 once, however many products it takes part in (a probe's
    figures take ~10 products of a few vectors: converting per product was most of their cost), a
    product asked for twice (one σ range's error is the probe's whole error) taken once. With
    ``buffers`` the float64 chunks go into one held scratch matrix, so they can be 4x longer on the
    CPU (WIDE_CHUNK: fewer, longer kernels) without each costing its page faults."""
    out = torch.zeros(len(pairs), dtype=torch.float64, device=device)
    vectors: dict[int, torch.Tensor] = {}
    products: dict[tuple[int, int], list[int]] = {}
    for k, (a, b) in enumerate(pairs):
        if a is None or b is None:
            continue
        vectors.setdefault(id(a), a)
        vectors.setdefault(id(b), b)
        products.setdefault((id(a), id(b)), []).append(k)
    if not products:
        return out
    row = {key: i for i, key in enumerate(vectors)}
    numel = next(iter(vectors.values())).numel()
    wide_step = WIDE_CHUNK.get(torch.device(device).type)
    step = min(wide_step if buffers is not None and wide_step else dot_chunk(device), numel)
    if buffers is not None:
        scratch = buffers.empty(len(vectors) * step, torch.float64, device).view(len(vectors), step)
    for i in range(0, numel, step):
        m = min(step, numel - i)
        if buffers is not None:
            for key, v in vectors.items():
                scratch[row[key], :m].copy_(v[i:i + m])
            wide = {key: scratch[row[key], :m] for key in vectors}
        else:
            wide = {key: v[i:i + m].to(device=device, dtype=torch.float64) for key, v in vectors.items()}
        for (a, b), ks in products.items():
            out[ks[0]] += torch.dot(wide[a], wide[b])
    for ks in products.values():
        for k in ks[1:]:
            out[k] = out[ks[0]]
    return out


def dot(a: torch.Tensor, b: torch.Tensor, reduce=local_sum) -> float:
    return float(reduce(local_dot(a, b)))


def norm(v: torch.Tensor, reduce=local_sum) -> float:
    return math.sqrt(max(dot(v, v, reduce), 0.0))


def _check_same_probe(index: float, index_sq: float, reduce, what: str) -> None:
    """Σ i and Σ i² over the ranks are world·i and world·i² only if every rank's i is the same i (a zero
    variance): ranks that pair one probe's reduction with another's are named, not averaged."""
    world = reduce.world
    if world <= 1:
        return
    mean = index / world
    if abs(index_sq / world - mean * mean) > 1e-6:
        from ..errors import JaggInputError

        raise JaggInputError(
            f"jaggc guard: the ranks reduced {what} of different probes (probe indices averaging {mean:g}): every rank "
            f"must probe the same trajectories and calls (the same Guard(every=...) and as many guarded trajectories). "
            f"Build the guard alike on every rank and load each rank's own guard state on resume")


def total_error(errors: dict[int, torch.Tensor], like: torch.Tensor, buffers: FlatBuffers | None = None) -> torch.Tensor:
    """Σ_r e_r, or zeros. One range's own vector when it is the only one (nothing writes a probe's
    errors once it is finished), else a new vector (from ``buffers`` if given): the ranges' stay as
    they are."""
    parts = list(errors.values())
    if not parts:
        return torch.zeros_like(like)
    if len(parts) == 1:
        return parts[0]
    total = buffers.clone(parts[0]) if buffers is not None else parts[0].clone()
    for e in parts[1:]:
        total.add_(e)
    return total


def exact_gradient(jagg: torch.Tensor, error: torch.Tensor, buffers: FlatBuffers | None = None) -> torch.Tensor:
    """X_p = J_p − e_p as a new vector (from ``buffers`` if given)."""
    return torch.sub(jagg, error, out=buffers.like(jagg)) if buffers is not None else jagg - error


def reduce_norms(windows: list[tuple[int, float, torch.Tensor]], reduce, device) -> list[tuple[int, float, float]]:
    """(position, lowest σ, |e_w|) from (position, lowest σ, this rank's |e_w|² as a 0-d tensor): one
    reduction of all of them (the ranks' positions agree: ``agree_on_windows``); the norms of one
    position's parts (several output leaves) add, as one window's."""
    if not windows:
        return []
    total = reduce(torch.stack([sq.to(device=device, dtype=torch.float64) for _, _, sq in windows])).tolist()
    out: dict[int, list] = {}
    for (position, sigma, _), sq in zip(windows, total):
        entry = out.setdefault(position, [position, sigma, 0.0])
        entry[2] += math.sqrt(max(sq, 0.0))
    return [tuple(v) for v in out.values()]


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
    # the probe's reduced scalars (J·X, |J|², |X|², |e|²), set by the first reduction (``measure`` or
    # the block's): every later read is a lookup, never a collective (a logger on one rank only is safe)
    scalars: tuple[float, float, float, float] | None = field(default=None, repr=False, compare=False)
    # e_p as the probe measured it (Σ_w e_w, of which X_p = J_p − e_p was made): no second vector
    measured_error: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def error(self) -> torch.Tensor:
        """e_p = J_p − X_p: the measured error where the probe gave it, else computed once."""
        if self.measured_error is None:
            self.measured_error = self.jagg - self.exact
        return self.measured_error

    def scalar_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The products |J|², J·e, |e|² (``local_dots``) that J·X, |J|², |X|², |e|² follow from
        (``scalars_of``): X = J − e is never read, one vector fewer to convert to float64."""
        e = self.error
        return [(self.jagg, self.jagg), (self.jagg, e), (e, e)]

    @staticmethod
    def scalars_of(jj: float, je: float, ee: float) -> tuple[float, float, float, float]:
        """(J·X, |J|², |X|², |e|²) with X = J − e. Each product of two float32 numbers is exact in
        float64 and the sums are float64's (error at most n u Σ|terms|, n u ≈ 1e-9 at 10M
        parameters), so |X|² = |J|² − 2 J·e + |e|² is off by at most ~1e-9 (|J| + |e|)²: relative to
        |X|² above 1e-6 only once JAGG's error is more than ~15 times the exact gradient."""
        return jj - je, jj, jj - 2 * je + ee, ee

    def measure(self) -> None:
        """The probe's scalars in one reduction (float64), unless a block has reduced them already."""
        if self.scalars is None:
            device = self.jagg.device
            head = torch.tensor([float(self.index), float(self.index) ** 2], dtype=torch.float64, device=device)
            total = self.reduce(torch.cat([head, local_dots(self.scalar_pairs(), device)])).tolist()
            _check_same_probe(total[0], total[1], self.reduce, "the figures")
            self.scalars = self.scalars_of(*total[2:5])

    def norm(self, v: torch.Tensor) -> float:
        return norm(v, self.reduce)

    @property
    def exact_norm(self) -> float:
        self.measure()
        return math.sqrt(max(self.scalars[2], 0.0))

    @property
    def cosine(self) -> float:
        self.measure()
        jx, jj, xx, _ = self.scalars
        return jx / max(math.sqrt(max(jj, 0.0)) * math.sqrt(max(xx, 0.0)), 1e-300)

    @property
    def rel_error(self) -> float:
        self.measure()
        return math.sqrt(max(self.scalars[3], 0.0)) / max(self.exact_norm, 1e-300)


def _clone(t: torch.Tensor, buffers: FlatBuffers | None) -> torch.Tensor:
    return buffers.clone(t) if buffers is not None and t.dim() == 1 else t.clone()


class ErrorMoments:
    """Σ e and Σ |e|² of one error series; the count is the block's (absent probes add zero).
    ``sum_sq`` is |Σ e|², reduced over the ranks by the block with its other scalars."""

    def __init__(self, reduce=local_sum, buffers: FlatBuffers | None = None):
        self.sum: torch.Tensor | None = None
        self.sq = 0.0
        self.sum_sq = 0.0
        self.reduce = reduce
        self.buffers = buffers

    def add(self, e: torch.Tensor) -> None:
        # a block loaded from a checkpoint may hold its sums on the CPU (accelerate loads them there)
        self.sum = _clone(e, self.buffers) if self.sum is None else self.sum.to(e.device).add_(e)


    def bias_and_floor(self, n: int, mean_exact_norm: float) -> tuple[float, float]:
        """(|ē|, floor), both over |X̄|, as calibrate's ErrorStats.bias (floor inf below 2 probes)."""
        if n == 0:
            return 0.0, math.inf
        mean_err2 = self.sum_sq / n ** 2
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
    """The running statistics of up to ``size`` consecutive probes (module docstring).

    Every probe's scalars are ONE float64 reduction of a fixed layout over the fixed σ range table
    (``_reduce``): the same length and order on every rank whatever windows each rank trained, so
    that the ranks never mispair a collective and all compute the same figures."""

    def __init__(self, edges: tuple[float, ...], size: int, reduce=local_sum, buffers: FlatBuffers | None = None):
        self.edges, self.size, self.reduce, self.buffers = edges, size, reduce, buffers
        self.n = 0
        self.cosines: list[float] = []
        self.rel_errors: list[float] = []
        self.whole = ErrorMoments(reduce, buffers)
        self.ranges = [ErrorMoments(reduce, buffers) for _ in sigma_ranges(edges)]
        self.seen = [False for _ in self.ranges]      # the ranges any rank had a window in (agreed)
        self.range_rel: list[list[float]] = [[] for _ in self.ranges]
        self.exact_sum: torch.Tensor | None = None
        self.exact_sum_sq = 0.0                       # |Σ X|², reduced
        self.windows: dict[int, dict] = {}     # position -> {"sigma": lowest σ seen, "rel": [...]}

    @property
    def full(self) -> bool:
        return self.n >= self.size

    def add(self, probe: ProbeResult) -> None:
        # the probe says how its vectors are held (whole, or this rank's shard); a block loaded from
        # a checkpoint learns it here too
        self.reduce = probe.reduce
        for m in [self.whole, *self.ranges]:
            m.reduce = probe.reduce
        for r in probe.range_errors:
            if not 0 <= r < len(self.ranges):
                raise ValueError(f"a guard probe filed an error under σ range {r}; the block has {len(self.ranges)}")
        self.n += 1
        self.whole.add(probe.error)
        self.exact_sum = (_clone(probe.exact, self.buffers) if self.exact_sum is None
                          else self.exact_sum.to(probe.exact.device).add_(probe.exact))
        for r, moments in enumerate(self.ranges):
            e = probe.range_errors.get(r)
            if e is not None:
                moments.add(e)
        scalars, present, range_sq = self._reduce(probe)
        probe.scalars = scalars
        exact_norm = probe.exact_norm
        self.cosines.append(probe.cosine)
        self.rel_errors.append(probe.rel_error)
        self.whole.sq += scalars[3]
        for r, moments in enumerate(self.ranges):
            self.seen[r] = self.seen[r] or present[r]
            moments.sq += range_sq[r]
            self.range_rel[r].append(math.sqrt(max(range_sq[r], 0.0)) / max(exact_norm, 1e-300))
        for position, sigma, norm_ in probe.windows:
            w = self.windows.setdefault(position, {"sigma": sigma, "rel": []})
            w["sigma"] = min(w["sigma"], sigma)
            w["rel"].append(norm_ / max(exact_norm, 1e-300))

    def _reduce(self, probe: ProbeResult) -> tuple[tuple[float, ...], list[bool], list[float]]:
        """One reduction: [i, i², |J|², J·e, |e|², |Σe|², |Σ X|², then per σ range of the table: present,
        |e_r|², |Σ e_r|²] (i the probe's index: the ranks' check that they reduce the same probe)."""
        device = probe.jagg.device
        pairs = probe.scalar_pairs() + [(self.whole.sum, self.whole.sum), (self.exact_sum, self.exact_sum)]
        present = []
        for r, moments in enumerate(self.ranges):
            e = probe.range_errors.get(r)
            present.append(float(e is not None))
            pairs += [(e, e), (moments.sum, moments.sum)]
        dots = local_dots(pairs, device, self.buffers)
        head = torch.tensor([float(probe.index), float(probe.index) ** 2], dtype=torch.float64, device=device)
        flags = torch.tensor(present, dtype=torch.float64, device=device)
        # the layout: [i, i², |J|², J·e, |e|², |Σe|², |ΣX|²] + per range [present, |e_r|², |Σe_r|²]
        per_range = torch.stack([flags, dots[5::2], dots[6::2]], 1).reshape(-1)
        parts = torch.cat([head, dots[:5], per_range])
        total = self.reduce(parts).tolist()
        _check_same_probe(total[0], total[1], self.reduce, "the block's statistics")
        self.whole.sum_sq, self.exact_sum_sq = total[5], total[6]
        per_range = total[7:]
        for r, moments in enumerate(self.ranges):
            moments.sum_sq = per_range[3 * r + 2]
        return (ProbeResult.scalars_of(*total[2:5]), [per_range[3 * r] > 0 for r in range(len(self.ranges))],
                [per_range[3 * r + 1] for r in range(len(self.ranges))])

    def state_dict(self) -> dict:
        """What a resumed run needs to continue the block (tensors as they are: under FSDP this rank's
        shards, so every rank saves its own; the reduced scalars as every rank has them)."""
        moments = [(m.sum, m.sq) for m in [self.whole, *self.ranges]]
        return dict(edges=self.edges, size=self.size, n=self.n, cosines=list(self.cosines),
                    rel_errors=list(self.rel_errors), moments=moments, range_rel=[list(r) for r in self.range_rel],
                    exact_sum=self.exact_sum, windows={k: dict(v, rel=list(v["rel"])) for k, v in self.windows.items()},
                    sum_sq=[m.sum_sq for m in [self.whole, *self.ranges]], exact_sum_sq=self.exact_sum_sq,
                    seen=list(self.seen))

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["edges"]) != tuple(self.edges) or len(state["moments"]) != 1 + len(self.ranges):
            raise ValueError(f"a guard block of σ edges {tuple(state['edges'])} cannot continue one of {self.edges}")
        self.n, self.cosines, self.rel_errors = state["n"], list(state["cosines"]), list(state["rel_errors"])
        for m, (total, sq) in zip([self.whole, *self.ranges], state["moments"]):
            m.sum, m.sq = (None if total is None else total.clone()), sq
        self.range_rel = [list(r) for r in state["range_rel"]]
        self.exact_sum = None if state["exact_sum"] is None else state["exact_sum"].clone()
        self.windows = {k: dict(v, rel=list(v["rel"])) for k, v in state["windows"].items()}
        if "sum_sq" in state:
            for m, v in zip([self.whole, *self.ranges], state["sum_sq"]):
                m.sum_sq = v
            self.exact_sum_sq, self.seen = state["exact_sum_sq"], list(state["seen"])
        else:      # a state saved before the scalars were kept (one process's: its vectors are whole)
            for m in [self.whole, *self.ranges]:
                m.sum_sq = 0.0 if m.sum is None else float(local_dot(m.sum, m.sum))
            self.exact_sum_sq = 0.0 if self.exact_sum is None else float(local_dot(self.exact_sum, self.exact_sum))
            self.seen = [m.sum is not None for m in self.ranges]

    def figures(self) -> dict:
        """The block's figures: whole-gradient cosine / relative error / bias, per σ range and per
        window position (the ranges any rank saw in this block only). No collective: the scalars
        were reduced as each probe came in."""
        n = self.n
        mean_exact = math.sqrt(max(self.exact_sum_sq, 0.0)) / n if n else 0.0
        bias, floor = self.whole.bias_and_floor(n, mean_exact)
        out = dict(probes=n, cosine_mean=_mean(self.cosines), cosine_min=min(self.cosines, default=math.nan),
                   rel_error_mean=_mean(self.rel_errors), bias=bias, floor=floor,
                   bias_over_floor=_ratio(bias, floor), ranges={}, windows={})
        for r, (bounds, moments) in enumerate(zip(sigma_ranges(self.edges), self.ranges)):
            if not self.seen[r]:
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
