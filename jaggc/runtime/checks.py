"""Refusals of the window runtime: inputs under which a JAGG window would compute a wrong gradient.

Each check runs once per window on the window's own inputs and costs at most one host sync
(the finiteness and monotonicity tests are reduced on the device and read back together).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .._compat import keystr, tree_flatten_with_path
from ..errors import JaggInputError
from .calls import DitCall, primary_input


def dit_parameter(dit: nn.Module) -> torch.Tensor | None:
    return next(iter(dit.parameters()), None)


def _tensor_inputs(call: DitCall):
    flat, _ = tree_flatten_with_path((call.args, call.kwargs))
    for path, leaf in flat:
        if isinstance(leaf, torch.Tensor):
            yield (keystr(path) or "<root>"), leaf


def check_calls(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int]) -> None:
    """Device, dtype and autograd-independence of every tensor input, and finiteness."""
    param = dit_parameter(dit)
    finite_flags, finite_where = [], []
    for call, step in zip(calls, steps):
        state = primary_input(call)
        if param is not None and state.is_floating_point() and param.is_floating_point():
            if state.dtype != param.dtype and not torch.is_autocast_enabled(state.device.type):
                raise JaggInputError(
                    f"step {step}: the state is {state.dtype} but the DiT's parameters are {param.dtype}; "
                    f"cast the stored states to {param.dtype} or run the loss under torch.autocast"
                )
        for name, t in _tensor_inputs(call):
            if param is not None and t.device != param.device and param.device.type != "meta":
                raise JaggInputError(
                    f"step {step}, input {name}: tensor is on {t.device} but the DiT's parameters are on "
                    f"{param.device}; move the stored trajectory to the DiT's device"
                )
            if t.requires_grad:
                raise JaggInputError(
                    f"step {step}, input {name}: the tensor requires grad (it depends on a trainable "
                    f"value, e.g. an earlier DiT output). JAGG needs stored trajectory data: pass "
                    f"`.detach()`ed states and conditioning"
                )
            if t.is_floating_point() and t.device.type != "meta":
                finite_flags.append(torch.isfinite(t).all())
                finite_where.append((step, name))
    if finite_flags and not bool(torch.stack(finite_flags).all()):
        step, name = next(w for f, w in zip(finite_flags, finite_where) if not bool(f))
        raise JaggInputError(
            f"step {step}, input {name}: contains NaN or Inf; check the stored trajectory "
            f"(rollouts in bf16 can overflow: keep latents and the SDE math in fp32)"
        )


def check_times(times: torch.Tensor, steps: Sequence[int]) -> None:
    """Per sample, the window's timesteps must be finite, distinct and strictly monotone."""
    if times.shape[0] < 2:
        return
    t = times.to(torch.float64)
    d = t[1:] - t[:-1]
    ok = torch.isfinite(t).all() & ((d > 0).all(0) | (d < 0).all(0)).all()
    if bool(ok):
        return
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        s = int(torch.nonzero(~finite.all(1))[0])
        raise JaggInputError(
            f"step {steps[s]}, input 'timestep': NaN or Inf timestep; pass each step's finite timestep "
            f"(sigma) from the sampler's schedule and check the stored trajectory")
    for i in range(d.shape[0]):
        if bool((d[i] == 0).any()):
            raise JaggInputError(
                f"steps {steps[i]} and {steps[i + 1]} have the same timestep; JAGG interpolates "
                f"in t and needs distinct timesteps within a window (pass each step's own timestep)"
            )
    raise JaggInputError(
        f"timesteps of steps {list(steps)} are not strictly monotone; a window must follow the "
        f"sampler's schedule in order (check the step order and the time_arg option)"
    )
