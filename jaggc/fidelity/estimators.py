"""Flat gradient estimators of a GRPO loss on one stored batch, for measuring JAGG's fidelity.

Every estimator here is a linear combination of vector-Jacobian products ``J(z, t)ᵀ c`` at a few
*knot* inputs (arXiv 2607.17572; the variants and their measurements: docs/default.md and
docs/fidelity.md, "Variants selectable in @jagg_compile, measured"), computed from the SAME
per-step upstream gradients
``g_k = ∂L/∂v_k`` that the exact gradient uses:

    exact          Σ_k J_kᵀ g_k                                    (1 backward per trained step)
    jagg           windows of W, knots z_a, z_b, weights (1-α, α) by t or by index   (2 / window)
    causal         every step of a window uses J(z_a) (Basis "constant")             (1 / window)
    lagrange       three knots per window, Lagrange weights                          (3 / window)
    hat            one block, knots every ``spacing`` steps, shared endpoints        (#knots)
    denoised       knots z_a and z*_r = z_a + Σ_{k=a}^{r-1}(μ_k − z_k), r = a+n, at t_r:
                   the right knot is the end state minus the window's own injected noise
                   (z_{k+1} − μ_k), so no knot contains the noise ε_k paired with g_k (2 / window)
    random3        jagg plus a third knot at one uniformly drawn interior step k*, the composites
                   corrected so that E_{k*}[estimate] = exact (unbiased; 3 / window)
    control        jagg, and with probability p per window the control-variate correction
                   (exact − jagg) / p (Basis("control"): unbiased; 2 + p (W − 2) / window);
                   per="step": each interior step corrected on its own with probability p
    subsample      K of a window's n steps drawn uniformly without replacement, scaled n/K
                   (unbiased baseline at the same backward budget; a fractional K draws floor(K)
                   or floor(K) + 1 per window, matching a fractional budget in expectation)

Any estimator takes ``exact_windows`` (window indices run per step, exactly): the σ-aware hybrid is
``exact_windows=windows_below(rec, W, t0)``, fractional routing is ``routed_exact_windows``.
Windows of ≤ 2 steps run exact (as in the runtime); random3 and lagrange need ≥ 4 / ≥ 4 steps to
save anything (≤ 3 steps: exact).

Backward fraction = DiT backward passes of a batch-B sample (one per knot, one per exact step) /
trained steps: what an implementation of that estimator costs, counted from its structure (the
VJPs below are batched across knots for speed, which does not change the count).

``record`` runs the user's loss once with a proxy DiT that returns the real outputs as leaves, so
the upstream gradients come from the unmodified loss code (the JAGG premise: DiT calls are
gradient-independent, the loss is a function of their outputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .._compat import tree_flatten, tree_unflatten
from ..errors import JaggInputError
from ..frontends.intercept import DitProxy
from ..runtime import Basis, DitCall, WindowOptions, jagg_calls
from ..runtime.grouping import group_calls, runs, structure
from ..runtime.calls import concat_calls, per_sample_time, primary_input, resolve_time_arg, set_time
from ..runtime.param_grads import parameter_grads

VARIANTS = ("exact", "jagg", "causal", "lagrange", "hat", "extrapolate", "denoised", "random3", "control",
            "subsample")
RANDOM_VARIANTS = ("subsample", "random3", "control")     # averaged over draws per batch


# ---------------------------------------------------------------------------------------------
# recording the loss's DiT calls and upstream gradients


@dataclass
class Recording:
    """The DiT calls of one loss evaluation, their outputs v_k and upstream gradients g_k."""

    calls: list[DitCall]
    outputs: list[torch.Tensor]
    upstream: list[torch.Tensor]
    times: torch.Tensor              # (S, B) float64, the timestep argument per step and sample
    loss: float
    time_arg: str | int
    extra: dict = field(default_factory=dict)   # e.g. step means / end time for ``denoised``
    windows: dict = field(default_factory=dict, repr=False)   # window size -> windows_of's answer

    @property
    def num_steps(self) -> int:
        return len(self.calls)


def _first_float_leaf(out) -> int:
    leaves, _ = tree_flatten(out)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return i
    raise JaggInputError("the DiT returned no floating-point tensor")


def _recording_proxy(dit: nn.Module, calls: list, leaves: list) -> DitProxy:
    """The intercept path's DiT stand-in, recording: each grad-mode call runs the DiT without grad
    and returns its output with the primary tensor replaced by a fresh leaf that requires grad."""
    def on_call(call: DitCall):
        with torch.no_grad():
            out = call(dit)
        flat, spec = tree_flatten(out)
        i = _first_float_leaf(out)
        flat[i] = flat[i].detach().requires_grad_(True)
        calls.append(call)
        leaves.append(flat[i])
        return tree_unflatten(flat, spec)

    return DitProxy(dit, on_call)


def _replaying_proxy(dit: nn.Module, outs: Sequence[Any]) -> DitProxy:
    """The same stand-in, replaying: the k-th grad-mode call returns ``outs[k]``."""
    served = iter(outs)
    return DitProxy(dit, lambda call: next(served))


def _scalar_loss(result) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def record(loss_fn: Callable, dit: nn.Module, batch: Any, *, time_arg: str | int | None = None) -> Recording:
    """Run ``loss_fn(dit, batch)`` once; return its DiT calls, outputs and ∂loss/∂output."""
    calls, leaves = [], []
    with torch.enable_grad():
        loss = _scalar_loss(loss_fn(_recording_proxy(dit, calls, leaves), batch))
        if not calls:
            raise JaggInputError("the loss made no DiT call")
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    upstream = [torch.zeros_like(v) if g is None else g.detach() for v, g in zip(leaves, grads)]
    targ = resolve_time_arg(calls[0], time_arg)
    times = torch.stack([per_sample_time(c, targ, s).to(torch.float64) for s, c in enumerate(calls)])
    return Recording(calls, [v.detach() for v in leaves], upstream, times, float(loss.detach()), targ)


def runtime_gradient(loss_fn: Callable, dit: nn.Module, batch: Any, *, window: int,
                     weights: str | Basis = "t", exact_windows: Sequence[int] = ()) -> torch.Tensor:
    """The flat gradient of ``loss_fn`` with its DiT calls run through ``jaggc.runtime.jagg_calls``
    (the JAGG runtime itself), by recording the calls and replaying the runtime's outputs into the
    loss. The estimators below must agree with it (tests/fidelity/test_fidelity.py)."""
    rec = record(loss_fn, dit, batch)
    params = trainable(dit)
    outs = jagg_calls(dit, rec.calls, window=window, options=WindowOptions(weights=weights),
                      exact_windows=tuple(exact_windows))
    loss = _scalar_loss(loss_fn(_replaying_proxy(dit, outs), batch))
    grads = parameter_grads([loss], params, what="runtime_gradient", dit_outputs=False)
    return _flat(grads, params)


# ---------------------------------------------------------------------------------------------
# VJPs at knots


def trainable(dit: nn.Module) -> list[torch.Tensor]:
    return [p for p in dit.parameters() if p.requires_grad]


def _flat(grads, params) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def with_state(call: DitCall, state: torch.Tensor, time: torch.Tensor, time_arg) -> DitCall:
    """``call`` with its state (hidden_states / first tensor) and timestep replaced."""
    if isinstance(call.kwargs.get("hidden_states"), torch.Tensor):
        call = DitCall(call.args, {**call.kwargs, "hidden_states": state})
    else:
        args = list(call.args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                args[i] = state
                break
        call = DitCall(tuple(args), call.kwargs)
    from ..runtime.calls import get_time

    old = get_time(call, time_arg)
    dtype = old.dtype if isinstance(old, torch.Tensor) else time.dtype
    return set_time(call, time_arg, time.to(dtype))


def vjp_sum(dit: nn.Module, pairs: Sequence[tuple[DitCall, torch.Tensor]], time_arg, *, chunk: int = 16,
            params: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Σ_i J(call_i)ᵀ c_i as one flat vector (consecutive calls of one argument structure batched
    ``chunk`` at a time)."""
    params = params if params is not None else trainable(dit)
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64, device=params[0].device)
    pairs = [(c, g) for c, g in pairs if g is not None and bool(torch.any(g != 0))]
    parts = [[pairs[k] for k in run[lo:lo + chunk]]
             for run in runs(range(len(pairs)), lambda k: structure(pairs[k][0])) for lo in range(0, len(run), chunk)]
    for part in parts:
        call = concat_calls([c for c, _ in part], time_arg)
        with torch.enable_grad():
            out = call(dit)
            leaves, _ = tree_flatten(out)
            v = leaves[_first_float_leaf(out)]
            cot = torch.cat([g.to(v.dtype) for _, g in part], 0)
            grads = parameter_grads([v], params, [cot], what="vjp_sum")
        total += _flat(grads, params).to(torch.float64)
    return total


# ---------------------------------------------------------------------------------------------
# estimates


@dataclass
class Estimate:
    name: str
    grad: torch.Tensor          # flat, float64
    backward_passes: int        # batch-B DiT backward passes an implementation needs
    trained_steps: int

    @property
    def backward_fraction(self) -> float:
        return self.backward_passes / self.trained_steps


def _bcast(w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sample weights (B,) broadcast against a (B, ...) tensor."""
    return w.to(like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


class _Plan:
    """Collects (call, cotangent) pairs and the backward count of one estimate."""

    def __init__(self, rec: Recording):
        self.rec = rec
        self.pairs: list[tuple[DitCall, torch.Tensor]] = []
        self.passes = 0

    def exact_steps(self, idx: Sequence[int], scale: float = 1.0):
        for k in idx:
            g = self.rec.upstream[k]
            self.pairs.append((self.rec.calls[k], g if scale == 1.0 else g * scale))
        self.passes += len(idx)

    def knot(self, call: DitCall, cot: torch.Tensor):
        self.pairs.append((call, cot))
        self.passes += 1

    def basis_window(self, idx: Sequence[int], basis: Basis):
        rec = self.rec
        knots, phi = basis.sample(rec.times[list(idx)])     # (S, K, B); a random basis draws here
        for j, kp in enumerate(knots):
            cot = sum(_bcast(phi[s, j], rec.upstream[k]) * rec.upstream[k] for s, k in enumerate(idx))
            self.knot(rec.calls[idx[kp]], cot)

    def run(self, dit, name: str) -> Estimate:
        grad = vjp_sum(dit, self.pairs, self.rec.time_arg)
        return Estimate(name, grad, self.passes, self.rec.num_steps)


def exact(rec: Recording, dit: nn.Module) -> Estimate:
    plan = _Plan(rec)
    plan.exact_steps(range(rec.num_steps))
    return plan.run(dit, "exact")


def windows_of(rec: Recording, window: int) -> list[list[int]]:
    """The recorded calls' windows by jaggc's one grouping rule (runtime/grouping.py), so that every
    estimator, ``exact_windows`` index and ``runtime_gradient`` see the windows the runtime runs."""
    if window not in rec.windows:
        rec.windows[window] = group_calls(rec.calls, window, time_arg=rec.time_arg).windows
    return rec.windows[window]


def basis_estimate(rec: Recording, dit: nn.Module, *, window: int, basis: Basis | str = "t",
                   exact_windows: Sequence[int] = (), name: str | None = None) -> Estimate:
    """Windows of ``window`` steps with a runtime Basis: plain JAGG ("t"/"index"), causal left knot
    (Basis("constant")), Lagrange (Basis("lagrange")). Same weights as ``jaggc.runtime``."""
    basis = Basis("linear", basis) if isinstance(basis, str) else basis
    plan = _Plan(rec)
    for w, idx in enumerate(windows_of(rec, window)):
        if w in exact_windows or len(idx) <= 2 or len(basis.knot_positions(len(idx))) >= len(idx):
            plan.exact_steps(idx)
        else:
            plan.basis_window(idx, basis)
    return plan.run(dit, name or f"{basis.kind}-{basis.by}")


def jagg(rec, dit, *, window: int, weights: str = "t", exact_windows=()) -> Estimate:
    return basis_estimate(rec, dit, window=window, basis=Basis("linear", weights), exact_windows=exact_windows,
                          name=f"jagg-{weights}")


def causal(rec, dit, *, window: int, weights: str = "t", exact_windows=()) -> Estimate:
    return basis_estimate(rec, dit, window=window, basis=Basis("constant", weights), exact_windows=exact_windows,
                          name="causal")


def lagrange(rec, dit, *, window: int, weights: str = "t", exact_windows=()) -> Estimate:
    return basis_estimate(rec, dit, window=window, basis=Basis("lagrange", weights), exact_windows=exact_windows,
                          name=f"lagrange-{weights}")


def hat(rec, dit, *, spacing: int, weights: str = "t", exact_steps_from: int | None = None) -> Estimate:
    """Shared-endpoint hat basis: one block over steps 0..E-1 (E = ``exact_steps_from`` or all),
    knots every ``spacing`` steps plus the block's last step; steps ≥ E exact."""
    end = rec.num_steps if exact_steps_from is None else exact_steps_from
    plan = _Plan(rec)
    if end >= 3:
        knots = tuple(sorted(set(list(range(0, end, spacing)) + [end - 1])))
        if len(knots) < end:
            plan.basis_window(list(range(end)), Basis("linear", weights, knots=knots))
        else:
            plan.exact_steps(range(end))
    else:
        plan.exact_steps(range(end))
    plan.exact_steps(range(end, rec.num_steps))
    return plan.run(dit, f"hat-{spacing}")


def extrapolate(rec, dit, *, spacing: int, weights: str = "t", exact_steps_from: int | None = None) -> Estimate:
    """Causal linear extrapolation with shared knots (docs/default.md: a variant free of noise
    leakage): knots every ``spacing`` steps
    over steps 0..E-1 (one backward each); a step after knot k_j uses the line through the
    Jacobians at k_{j-1} and k_j, steps before the second knot the first one; steps ≥ E exact.
    ``@jagg_compile(window=T, weights=Basis("extrapolate", knots=...))``."""
    end = rec.num_steps if exact_steps_from is None else exact_steps_from
    plan = _Plan(rec)
    knots = tuple(range(0, end, spacing))
    if end >= 2 and len(knots) < end:
        plan.basis_window(list(range(end)), Basis("extrapolate", weights, knots=knots))
    else:
        plan.exact_steps(range(end))
    plan.exact_steps(range(end, rec.num_steps))
    return plan.run(dit, f"extrapolate-{spacing}")


def denoised(rec: Recording, dit: nn.Module, *, window: int, weights: str = "t", exact_windows=(),
             means: Sequence[torch.Tensor] | None = None, end_time: torch.Tensor | None = None) -> Estimate:
    """Denoised right knot (docs/default.md: a variant free of noise leakage): window [a, r),
    knots z_a at t_a and
    z*_r = z_a + Σ_{k=a}^{r-1} (μ_k − z_k) at t_r. ``means`` μ_k (the SDE step means at the
    evaluating parameters) and ``end_time`` (t of the state after the last trained step) default
    to ``rec.extra`` (``jaggc_studies.fidelity.flow_grpo.flow_grpo_extras`` fills them for the digits trainer's batches)."""
    means = means if means is not None else rec.extra.get("means")
    end_time = end_time if end_time is not None else rec.extra.get("end_time")
    if means is None or end_time is None:
        raise JaggInputError("denoised needs the step means μ_k and the end time (fill rec.extra['means'] and rec.extra['end_time'])")
    plan = _Plan(rec)
    for w, idx in enumerate(windows_of(rec, window)):
        if w in exact_windows or len(idx) <= 2:
            plan.exact_steps(idx)
            continue
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise JaggInputError(f"denoised needs each window's steps consecutive in the recording; window {w} holds "
                                 f"calls {idx} (two-call guidance): record one call per step")
        a, r = idx[0], idx[-1] + 1
        z_a = primary_input(rec.calls[a])
        z_star = z_a + sum(means[k] - primary_input(rec.calls[k]) for k in idx)
        t_a = rec.times[a]
        t_r = rec.times[r] if r < rec.num_steps else end_time.to(torch.float64).expand_as(t_a)
        ga = 0
        gr = 0
        for s, k in enumerate(idx):
            alpha = (rec.times[k] - t_a) / (t_r - t_a) if weights == "t" else torch.full_like(t_a, s / len(idx))
            g = rec.upstream[k]
            ga = ga + _bcast(1 - alpha, g) * g
            gr = gr + _bcast(alpha, g) * g
        plan.knot(rec.calls[a], ga)
        plan.knot(with_state(rec.calls[a], z_star.to(z_a.dtype), t_r, rec.time_arg), gr)
    return plan.run(dit, f"denoised-{weights}")


def random3(rec: Recording, dit: nn.Module, *, window: int, weights: str = "t", exact_windows=(),
            generator: torch.Generator | None = None, picks: dict[int, int] | None = None) -> Estimate:
    """Plain JAGG plus a third knot at one uniformly drawn interior step k* per window, corrected:
    Γ_a −= m(1−α*) g*, Γ_b −= m α* g*, J_{k*}ᵀ (m g*), m = #interior steps. E_{k*} = exact.
    ``picks`` {window index: interior position} overrides the draw (for enumerating k*)."""
    basis = Basis("linear", weights)
    plan = _Plan(rec)
    for w, idx in enumerate(windows_of(rec, window)):
        if w in exact_windows or len(idx) <= 3:
            plan.exact_steps(idx)
            continue
        m = len(idx) - 2
        pos = picks[w] if picks is not None else 1 + int(torch.randint(m, (1,), generator=generator))
        phi = basis.matrix(rec.times[list(idx)])      # (S, 2, B)
        cots = []
        for j in range(2):
            cots.append(sum(_bcast(phi[s, j], rec.upstream[k]) * rec.upstream[k] for s, k in enumerate(idx)))
        g_star = rec.upstream[idx[pos]]
        cots[0] = cots[0] - m * _bcast(phi[pos, 0], g_star) * g_star
        cots[1] = cots[1] - m * _bcast(phi[pos, 1], g_star) * g_star
        plan.knot(rec.calls[idx[0]], cots[0])
        plan.knot(rec.calls[idx[-1]], cots[1])
        plan.knot(rec.calls[idx[pos]], m * g_star)
    return plan.run(dit, f"random3-{weights}")


def subsample(rec: Recording, dit: nn.Module, *, window: int, k: float = 2, exact_windows=(),
              generator: torch.Generator | None = None, picks: dict[int, Sequence[int]] | None = None) -> Estimate:
    """Baseline: in every non-exact window of n > k steps, k steps drawn uniformly without
    replacement, each scaled n/k (unbiased). A fractional k draws floor(k) + Bernoulli(frac) steps
    per window (each draw unbiased, the expected count k). ``picks`` {window: positions} overrides."""
    plan = _Plan(rec)
    for w, idx in enumerate(windows_of(rec, window)):
        n = len(idx)
        if w in exact_windows or n <= k or n <= 2:
            plan.exact_steps(idx)
            continue
        kw = int(k) + int(float(torch.rand((), generator=generator)) < k - int(k)) if k != int(k) else int(k)
        chosen = picks[w] if picks is not None else torch.randperm(n, generator=generator)[:kw].tolist()
        plan.exact_steps([idx[p] for p in chosen], scale=n / kw)
    return plan.run(dit, f"subsample-{k:g}")


# ---------------------------------------------------------------------------------------------
# window selection: σ-aware hybrid and score routing (docs/fidelity.md, "Does the routing score
# predict the window's fidelity?")


def windows_below(rec: Recording, window: int, t0: float) -> tuple[int, ...]:
    """Windows with any timestep < t0 (in the DiT's timestep units): the σ-aware exact set."""
    return tuple(w for w, idx in enumerate(windows_of(rec, window)) if bool((rec.times[idx] < t0).any()))


def routing_scores(rec: Recording, window: int, weights: str = "t") -> list[float]:
    """The routing score per window (docs/fidelity.md): min over interior k of
    cos(v_k − v_a, α_k (v_b − v_a)) over the
    flattened batch (nan for windows of ≤ 2 steps: always exact)."""
    basis = Basis("linear", weights)
    scores = []
    for idx in windows_of(rec, window):
        if len(idx) <= 2:
            scores.append(float("nan"))
            continue
        phi = basis.matrix(rec.times[idx])
        va, vb = rec.outputs[idx[0]].double(), rec.outputs[idx[-1]].double()
        worst = 1.0
        for s in range(1, len(idx) - 1):
            alpha = _bcast(phi[s, 1], va)
            c = torch.nn.functional.cosine_similarity((rec.outputs[idx[s]].double() - va).reshape(-1),
                                                      (alpha * (vb - va)).reshape(-1), dim=0)
            worst = min(worst, float(c))
        scores.append(worst)
    return scores


def routed_exact_windows(rec: Recording, window: int, *, jagg_frac: float = 1.0, weights: str = "t",
                         exact_below: float | None = None) -> tuple[int, ...]:
    """The exact windows under routing: windows below ``exact_below`` are exact; of the others,
    the top ⌊jagg_frac · #windows⌋ by score go JAGG, the rest exact."""
    windows = windows_of(rec, window)
    forced = set(windows_below(rec, window, exact_below)) if exact_below is not None else set()
    scores = routing_scores(rec, window, weights)
    eligible = [w for w in range(len(windows)) if w not in forced and not math.isnan(scores[w])]
    quota = int(math.floor(jagg_frac * len(windows) + 1e-9))
    chosen = set(sorted(eligible, key=lambda w: -scores[w])[:quota])
    return tuple(w for w in range(len(windows)) if w not in chosen)


# ---------------------------------------------------------------------------------------------
# one entry point


@dataclass(frozen=True)
class Setting:
    """One estimator configuration. ``variant`` in VARIANTS; ``jagg_frac`` < 1 routes by score;
    ``exact_below`` (timestep units) is the σ-aware hybrid; ``k`` for subsample; ``spacing`` for hat."""

    variant: str = "jagg"
    window: int = 4
    weights: str = "t"
    jagg_frac: float = 1.0
    exact_below: float | None = None
    k: float = 2
    spacing: int = 3
    p: float = 0.25     # control: correction probability
    per: str = "window"  # control: correct whole windows or single interior steps

    def label(self) -> str:
        if self.variant == "exact":
            return "exact"
        parts = [self.variant, f"W{self.window}" if self.variant != "hat" else f"m{self.spacing}", self.weights]
        if self.variant == "subsample":
            parts = ["subsample", f"W{self.window}", f"{self.k:g}of{self.window}"]
        if self.variant == "control":
            parts.append(f"p{self.p:g}" + ("/step" if self.per == "step" else ""))
        if self.jagg_frac < 1:
            parts.append(f"f{self.jagg_frac:g}")
        if self.exact_below is not None:
            parts.append(f"exact<{self.exact_below:g}")
        return "/".join(parts)


def estimate(rec: Recording, dit: nn.Module, setting: Setting, *, generator: torch.Generator | None = None,
             exact_windows: Sequence[int] | None = None) -> Estimate:
    s = setting
    if s.variant not in VARIANTS:
        raise JaggInputError(f"variant={s.variant!r}: use one of {VARIANTS}")
    if s.variant == "exact":
        return exact(rec, dit)
    if s.variant == "hat":
        end = None
        if s.exact_below is not None:
            below = (rec.times < s.exact_below).any(dim=1).nonzero()
            end = int(below[0]) if len(below) else None
        return hat(rec, dit, spacing=s.spacing, weights=s.weights, exact_steps_from=end)
    if s.variant == "extrapolate":
        end = None
        if s.exact_below is not None:
            below = (rec.times < s.exact_below).any(dim=1).nonzero()
            end = int(below[0]) if len(below) else None
        return extrapolate(rec, dit, spacing=s.window, weights=s.weights, exact_steps_from=end)
    if exact_windows is None:
        exact_windows = routed_exact_windows(rec, s.window, jagg_frac=s.jagg_frac, weights=s.weights,
                                             exact_below=s.exact_below)
    kw = dict(window=s.window, exact_windows=tuple(exact_windows))
    if s.variant == "jagg":
        return jagg(rec, dit, weights=s.weights, **kw)
    if s.variant == "causal":
        return causal(rec, dit, weights=s.weights, **kw)
    if s.variant == "lagrange":
        return lagrange(rec, dit, weights=s.weights, **kw)
    if s.variant == "denoised":
        return denoised(rec, dit, weights=s.weights, **kw)
    if s.variant == "random3":
        return random3(rec, dit, weights=s.weights, generator=generator, **kw)
    if s.variant == "control":
        # the study's generator seeds the basis's own: each call is a fresh draw
        seed = int(torch.randint(2**31, (1,), generator=generator)) if generator is not None else 0
        return basis_estimate(rec, dit, basis=Basis("control", s.weights, seed=seed, p=s.p, per=s.per),
                              name="control", **kw)
    return subsample(rec, dit, k=s.k, generator=generator, **kw)


def matched_subsample(rec: Recording, setting: Setting) -> Setting | None:
    """The subsampling baseline with the same windows, exact set and backward count per window
    (jagg/denoised: 2 of W; causal: 1; lagrange/random3: 3). None for hat/exact."""
    k = {"jagg": 2, "denoised": 2, "causal": 1, "extrapolate": 1, "lagrange": 3, "random3": 3}.get(setting.variant)
    if setting.variant == "control":
        k = 2 + setting.p * (setting.window - 2)     # its expected knots per full window
    if k is None:
        return None
    return Setting("subsample", setting.window, setting.weights, setting.jagg_frac, setting.exact_below, k=k)


def matched_subsample_setting(setting: Setting) -> Setting | None:
    """``matched_subsample`` without a recording (the baseline depends only on the setting)."""
    return matched_subsample(None, setting)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))


def rel_error(est: torch.Tensor, ref: torch.Tensor) -> float:
    return float((est - ref).norm() / ref.norm().clamp_min(1e-300))


__all__ = ["Estimate", "RANDOM_VARIANTS", "Recording", "Setting", "VARIANTS", "basis_estimate", "causal", "cosine", "denoised",
           "estimate", "exact", "extrapolate", "hat", "jagg", "lagrange", "matched_subsample",
           "matched_subsample_setting", "random3",
           "record", "rel_error", "routed_exact_windows", "routing_scores", "runtime_gradient", "subsample",
           "trainable", "vjp_sum", "windows_below", "windows_of", "with_state"]
