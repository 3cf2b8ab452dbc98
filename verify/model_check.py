"""``check_model``: JAGG against the exact per-step gradient on real DiT trajectories (no exactness
expected; W = 2 must give cosine 1), and a trajectory factory for diffusers SD3 transformers."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn

from .._compat import tree_flatten
from ..runtime import DitCall, WindowOptions, jagg_calls, run_exact
from .harness import _grad_of, rel_err, shift_sigmas

__all__ = ["ModelCheck", "check_model", "model_table", "sd3_trajectory_factory"]

class ModelCheck(dict):
    """{W: {"cosine": mean, "rel_err": mean}}; ``str()`` / ``.table()`` print it."""

    def table(self) -> str:
        return model_table(self)

    def __str__(self) -> str:
        return self.table()


def model_table(result: dict) -> str:
    lines = ["  W   cosine(JAGG, exact)   rel_err", "  --  -------------------   -------"]
    for w, r in sorted(result.items()):
        lines.append(f"  {w:<3} {r['cosine']:>19.7f}   {r['rel_err']:.3e}")
    return "\n".join(lines)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def check_model(dit: nn.Module, inputs_factory: Callable[[int], list[DitCall]],
                windows: Sequence[int] = (2, 3, 4, 6), trajectories: int = 4, *,
                options: WindowOptions = WindowOptions()) -> ModelCheck:
    """Mean cosine and relative error of the JAGG gradient (``jagg_calls`` with window W) against
    the exact per-step gradient, for random upstream gradients on ``trajectories`` trajectories
    ``inputs_factory(seed)``. Windows longer than a trajectory are skipped."""
    acc: dict[int, list[tuple[float, float]]] = {w: [] for w in windows}
    for seed in range(trajectories):
        calls = inputs_factory(seed)
        with torch.no_grad():
            outs = run_exact(dit, calls, options=WindowOptions(check_inputs=False))
        gen = torch.Generator().manual_seed(10_000 + seed)
        gs = []
        for out in outs:
            leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
            gs.append([torch.randn(x.shape, generator=gen).to(dtype=x.dtype, device=x.device) for x in leaves[:1]])
        exact = _grad_of(dit, lambda: run_exact(dit, calls, options=options), gs)
        for w in windows:
            if w > len(calls):
                continue
            jagg = _grad_of(dit, lambda: jagg_calls(dit, calls, window=w, options=options), gs)
            acc[w].append((_cos(jagg, exact), rel_err(jagg, exact)))
    return ModelCheck({w: {"cosine": sum(c for c, _ in v) / len(v), "rel_err": sum(e for _, e in v) / len(v)}
                       for w, v in acc.items() if v})


def sd3_trajectory_factory(dit: nn.Module, *, num_steps: int = 6, batch: int = 1, shift: float = 3.0,
                           noise_level: float = 0.7) -> Callable[[int], list[DitCall]]:
    """``seed -> list[DitCall]``: an SDE rollout (Euler + sqrt(dt) noise) of a diffusers SD3
    transformer on a shift-``shift`` schedule, ``timestep = σ·1000`` per sample, stored states."""
    from .. import models

    def factory(seed: int) -> list[DitCall]:
        gen = torch.Generator().manual_seed(seed)
        dtype = next(dit.parameters()).dtype
        cond = models.sd3_conditioning(dit, batch, seed=seed).kwargs
        sig = shift_sigmas(num_steps, shift).to(torch.float32)
        z = torch.randn(models.sd3_latent_shape(dit, batch), generator=gen).to(dtype)
        calls = []
        with torch.no_grad():
            for k in range(num_steps):
                call = DitCall(kwargs=dict(hidden_states=z, timestep=(sig[k] * 1000).expand(batch).to(dtype),
                                           return_dict=False, **cond))
                calls.append(call)
                v = call(dit)[0]
                dt = float(sig[k + 1] - sig[k])
                z = z + dt * v + noise_level * math.sqrt(-dt) * torch.randn(z.shape, generator=gen).to(dtype)
        return calls

    return factory
