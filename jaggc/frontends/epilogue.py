"""The run epilogue every frontend shares: what must hold after the loss (or its rewritten graph) ran.

Written once here so the capture paths cannot drift apart:

- ``modes_restored``: a rewritten graph switches grad mode and autocast around the loss's no-grad
  and autocast blocks, with absolute states (runtime/autocast.py); a refusal raised inside one of
  those blocks must not leave the caller in it.
- ``check_ran``: no fake tensor leaves a capture (fake_boundary.py): the returned value on every
  call, the parameters' ``.grad`` at the end of a new graph's first backward.
- ``traced_aliasing`` / ``aliasing_holds``: a graph that writes into its inputs assumed the traced
  call's storage sharing (aliasing.py); it is reused only for calls whose inputs share storage the
  same way (the FX cache traces again, the Dynamo path refuses).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import fx, nn

from ..alias_roots import input_writes
from ..runtime.autocast import reset_graph_autocast
from .aliasing import storage_groups
from .fake_boundary import check_real_grads_after_backward, check_real_output


@contextlib.contextmanager
def modes_restored() -> Iterator[None]:
    """Leave the caller's grad mode as it was and exit every autocast switch the graph entered,
    also when the graph raised."""
    grad = torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_grad_enabled(grad)
        reset_graph_autocast()


def check_ran(out: Any, modules: Iterable[nn.Module], qualname: str, *, new_graph: bool) -> Any:
    """Refuse a fake tensor in ``out``; after a new graph's first backward, a fake ``.grad`` on the
    parameters of ``modules`` (the DiT and the other modules kept opaque). Returns ``out``."""
    check_real_output(out, qualname)
    if new_graph:
        check_real_grads_after_backward(out, [p for m in modules for p in m.parameters()], qualname)
    return out


def traced_aliasing(gm: fx.GraphModule, inputs: Any) -> tuple | None:
    """The storage sharing of ``inputs`` (the traced call's) if ``gm`` writes into its inputs, else
    None: a graph that writes nothing into its inputs runs for any aliasing."""
    return storage_groups(inputs) if input_writes(gm) else None


def aliasing_holds(traced: tuple | None, inputs: Any) -> bool:
    """Whether ``inputs`` share storage as the traced call's did (always, if the graph writes none)."""
    return traced is None or storage_groups(inputs) == traced


__all__ = ["aliasing_holds", "check_ran", "modes_restored", "traced_aliasing"]
