"""Small numeric helpers shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence, Union

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


Tensors = Union[torch.Tensor, Mapping[str, torch.Tensor]]


def flat(x: Tensors) -> torch.Tensor:
    """One flat float64 vector: a tensor, or tensors by name (gradients by parameter name) in name
    order."""
    if isinstance(x, Mapping):
        return torch.cat([t.detach().reshape(-1).double() for _, t in sorted(x.items())])
    return x.detach().double().reshape(-1)


def _flat_pair(a: Tensors, b: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        assert set(a) == set(b), sorted(set(a) ^ set(b))
    return flat(a), flat(b)


def rel_err(a: Tensors, b: Tensors) -> float:
    """‖a − b‖ / ‖b‖ (‖a − b‖ itself when b is zero), of two tensors or two dicts of named tensors."""
    a, b = _flat_pair(a, b)
    den = b.norm()
    num = (a - b).norm()
    return float(num / den) if den > 0 else float(num)


def cosine(a: Tensors, b: Tensors) -> float:
    a, b = _flat_pair(a, b)
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


class LinearDiT(nn.Module):
    """The smallest DiT stand-in a compiled loss can call: ``lin(x) * t``."""

    def __init__(self, width: int = 2):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        return self.lin(x) * t
