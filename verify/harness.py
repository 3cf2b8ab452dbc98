"""The harness the property checks run on: results, float64 numerics, deterministic generators,
and the two hypothesis runners (exact properties and counterexample searches).

Properties are run programmatically (derandomized, no example database, no deadline); ``seed`` is
mixed into every torch generator, so an (examples, seed) pair is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis.errors import NoSuchExample
from torch import nn

from .._compat import tree_flatten
from ..runtime import DitCall

DT = torch.float64
TOL = 1e-6


@dataclass
class PropertyResult:
    name: str
    kind: str  # "exact" | "counterexample"
    passed: bool
    examples: int
    max_rel_err: float
    counterexample: str | None = None
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- numerics

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (‖a − b‖ itself when b is zero)."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    den, num = b.norm(), (a - b).norm()
    return float(num / den) if den > 0 else float(num)


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def _grad_of(model: nn.Module, runner: Callable[[], Sequence[Any]], gs: Sequence[Any]) -> torch.Tensor:
    """Flat parameter gradient of L = Σ_k <leaves(out_k), leaves(g_k)>."""
    for p in model.parameters():
        p.grad = None
    outs = runner()
    terms = []
    for out, g in zip(outs, gs):
        o_leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        g_leaves = [x for x in tree_flatten(g)[0] if isinstance(x, torch.Tensor)]
        terms += [(o * gg).sum() for o, gg in zip(o_leaves, g_leaves)]
    torch.stack(terms).sum().backward()
    out = _flat_grads(model).clone()
    for p in model.parameters():
        p.grad = None
    return out


def shift_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """σ' = sσ/(1+(s−1)σ) of linspace(1, 0, num_steps + 1) (SD3's schedule for s = 3)."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=DT)
    return shift * s / (1 + (shift - 1) * s)


def _gen(*parts: int) -> torch.Generator:
    h = 0
    for p in parts:
        h = (h * 1_000_003 + int(p)) % (2**62)
    return torch.Generator().manual_seed(h)


def _window_times(gen: torch.Generator, window: int, batch: int, per_sample: bool) -> torch.Tensor:
    def one() -> torch.Tensor:
        n = int(torch.randint(window - 1, 25, (), generator=gen))
        start = int(torch.randint(0, n + 2 - window, (), generator=gen))
        return shift_sigmas(n)[start:start + window]
    if per_sample:
        return torch.stack([one() for _ in range(batch)], 1)
    return one()[:, None].expand(window, batch).clone()


def _chord(gen: torch.Generator, times: torch.Tensor, dim: int) -> torch.Tensor:
    _, batch = times.shape
    z_a = torch.randn(batch, dim, generator=gen, dtype=DT)
    z_b = torch.randn(batch, dim, generator=gen, dtype=DT)
    alpha = ((times - times[0]) / (times[-1] - times[0]))[..., None]
    return (1 - alpha) * z_a + alpha * z_b


def _calls(states: torch.Tensor, times: torch.Tensor) -> list[DitCall]:
    return [DitCall((z, t)) for z, t in zip(states, times)]


def _upstream(gen: torch.Generator, n: int, batch: int, dim: int) -> list[torch.Tensor]:
    return [torch.randn(batch, dim, generator=gen, dtype=DT) for _ in range(n)]


# ----------------------------------------------------------------------------- runners

def _settings(examples: int) -> settings:
    # no explain phase: after shrinking it re-runs the check on many variants of the minimal example
    # only to annotate it, which costs dozens of re-traces when the check compiles a loss
    return settings(max_examples=max(int(examples), 1), derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])


def _describe(case: Any) -> str:
    if isinstance(case, dict):
        return ", ".join(f"{k}={v}" for k, v in case.items())
    return repr(case)


def run_exact_property(name: str, strategy, check: Callable[[Any, int], float], examples: int,
                       seed: int, tol: float = TOL) -> PropertyResult:
    """Every example must have error <= ``tol``; a violation is shrunk by hypothesis and reported."""
    errs: list[float] = []
    last: list = [None, None]

    @_settings(examples)
    @given(strategy)
    def prop(case):
        last[0], last[1] = case, None
        try:
            err = float(check(case, seed))
        except Exception as e:  # a crash is a violation too; hypothesis shrinks it
            last[1] = f"{type(e).__name__}: {e}"
            raise
        errs.append(err)
        last[1] = err
        assert err <= tol and not math.isnan(err), f"rel_err {err:.3g} > {tol:g}"

    try:
        prop()
        passed, counterexample = True, None
    except Exception:  # noqa: BLE001 - AssertionError or whatever the runtime raised
        passed = False
        what = f"rel_err={last[1]:.3g}" if isinstance(last[1], float) else str(last[1])
        counterexample = f"{_describe(last[0])} -> {what}"
    finite = [e for e in errs if not math.isnan(e)]
    return PropertyResult(name, "exact", passed, len(errs), max(finite, default=0.0), counterexample)


def run_counterexample_property(name: str, strategy, check: Callable[[Any, int], float], examples: int,
                                seed: int) -> PropertyResult:
    """hypothesis must FIND (and shrink) an example with error > TOL."""
    errs: list[float] = []
    first_hit: list[int] = []

    def condition(case) -> bool:
        err = float(check(case, seed))
        errs.append(err)
        hit = err > TOL
        if hit and not first_hit:
            first_hit.append(len(errs))
        return hit

    try:
        case = find(strategy, condition, settings=_settings(examples))
    except NoSuchExample:
        return PropertyResult(name, "counterexample", False, len(errs), max(errs, default=0.0), None,
                              f"no example with rel_err > {TOL:g} in {len(errs)} examples")
    err = float(check(case, seed))
    detail = (f"first found at example {first_hit[0]}, shrunk over {len(errs) - first_hit[0]} "
              f"further evaluations")
    return PropertyResult(name, "counterexample", True, len(errs), max(errs), f"{_describe(case)} -> rel_err={err:.3g}",
                          detail)
