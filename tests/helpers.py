"""Small numeric helpers shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from jaggc.verify.reference import reference_jagg  # noqa: F401 - the tests' oracle, shared with `jaggc trainers`


def grads(model: nn.Module) -> torch.Tensor:
    """All parameter gradients of ``model`` as one flat vector (zeros where ``.grad`` is None)."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()
    ])


def zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (‖a − b‖ itself when b is zero)."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    den = b.norm()
    num = (a - b).norm()
    return float(num / den) if den > 0 else float(num)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def linear_loss(outs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """L = Σ_k <v_k, g_k>, so that ∂L/∂v_k = g_k exactly (steps with g_k None are unused)."""
    terms = [(v * g).sum() for v, g in zip(outs, gs) if g is not None]
    return torch.stack(terms).sum()


def grad_of(model: nn.Module, runner: Callable[[], Sequence[torch.Tensor]],
            gs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Flat parameter gradient of L = Σ_k <v_k, g_k> with v = runner() (fresh .grad)."""
    zero_grads(model)
    linear_loss(runner(), gs).backward()
    out = grads(model).clone()
    zero_grads(model)
    return out


def loss_and_grad(fn: Callable, args: tuple, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, flat parameter gradient) of ``fn(*args)`` with fresh ``.grad``."""
    zero_grads(model)
    loss = fn(*args)
    loss.backward()
    out = grads(model).clone()
    zero_grads(model)
    return loss.detach(), out
