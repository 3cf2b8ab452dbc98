"""Refusals of the window runtime: inputs under which a JAGG window would compute a wrong gradient.

Each check runs once per window on the window's own inputs and costs at most one host sync
(the finiteness and monotonicity tests are reduced on the device and read back together).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .._compat import fsdp_version, tree_flatten, tree_flatten_with_path, tree_unflatten, version_counter
from ..errors import JaggInputError
from .calls import DitCall, input_name, primary_input

# tensor inputs that are never batched (Flux/Qwen-Image position ids): exempt from the dtype check
SHARED_INPUTS = ("img_ids", "txt_ids")


def dit_parameter(dit: nn.Module) -> torch.Tensor | None:
    return next(iter(dit.parameters()), None)


def _tensor_inputs(call: DitCall):
    """(name, tensor) of each tensor input of ``call``. The names are those of its structure (its
    ``TreeSpec``), worked out once per structure: flattening with paths costs twice a plain flatten,
    at every DiT call of a per-step loop."""
    leaves, spec = tree_flatten((call.args, call.kwargs))
    names = _NAMES.get(spec)
    if names is None:
        names = [input_name(path) for path, _ in tree_flatten_with_path((call.args, call.kwargs))[0]]
        if len(_NAMES) < _MAX_STRUCTURES:
            _NAMES[spec] = names
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, torch.Tensor):
            yield name, leaf


_NAMES: dict = {}          # a call structure (TreeSpec: hashable, equal where the structure is) -> leaf names
_MAX_STRUCTURES = 256


def check_placement(dit: nn.Module, call: DitCall, where: str, *, dtypes: bool = True) -> None:
    """Device and dtype of a call's tensor inputs against the DiT's parameters.

    Reads only metadata, so it also runs on fake tensors while a frontend traces the loss.
    ``where`` names the call in messages ("step 3"). Checked: every tensor input's device; the
    dtype of the state and of every batched feature input (floating, ndim >= 2, leading dim = the
    batch: ``encoder_hidden_states``, ``pooled_projections``), unless autocast is on. Per-sample
    scalars (timestep, guidance) and position ids are left to the DiT, which casts them.
    """
    param = dit_parameter(dit)
    if param is None:
        return
    state = primary_input(call)
    batch = state.shape[0] if state.ndim else None
    for name, t in _tensor_inputs(call):
        if t.device != param.device and param.device.type != "meta":
            raise JaggInputError(
                f"tensor is on {t.device} but the DiT's parameters are on "
                f"{param.device}; move the stored trajectory to the DiT's device",
                where=f"{where}, input {name}")
        if not dtypes or not (t.is_floating_point() and param.is_floating_point()) or t.dtype == param.dtype:
            continue
        if torch.is_autocast_enabled(t.device.type) or fsdp_version(dit) is not None:
            # autocast casts what the DiT computes with; so does FSDP's mixed precision
            # (MixedPrecision / MixedPrecisionPolicy casts the inputs and the gathered parameters),
            # whose stored parameters' dtype says nothing about the call's
            continue
        if t is state:
            raise JaggInputError(
                f"the state is {t.dtype} but the DiT's parameters are {param.dtype}; "
                f"cast the stored states to {param.dtype} or run the loss under torch.autocast",
                where=f"{where}, input {name}")
        if t.ndim >= 2 and t.shape[0] == batch and not any(u in name for u in SHARED_INPUTS):
            raise JaggInputError(
                f"the conditioning is {t.dtype} but the DiT's parameters are "
                f"{param.dtype}; cast it to {param.dtype} or run the loss under torch.autocast",
                where=f"{where}, input {name}")


def check_calls(dit: nn.Module, calls: Sequence[DitCall], steps: Sequence[int]) -> None:
    """Device, dtype and autograd-independence of every tensor input, and finiteness."""
    for call, step in zip(calls, steps):
        check_placement(dit, call, f"step {step}")
    check_step_values(calls, steps)


def check_step_values(calls: Sequence[DitCall], steps: Sequence[int]) -> None:
    """Autograd-independence and finiteness of every tensor input of ``calls`` (one host sync)."""
    finite_flags, finite_where = [], []
    for call, step in zip(calls, steps):
        for flag, where_ in step_value_flags(call, step, meta=False):
            finite_flags.append(flag)
            finite_where.append(where_)
    if finite_flags and not bool(torch.stack(finite_flags).all()):
        step, name = next(w for f, w in zip(finite_flags, finite_where) if not bool(f))
        raise nonfinite_input(step, name)


def step_value_flags(call: DitCall, step: int, *, meta: bool = True, checked: dict | None = None) -> list:
    """A call's refusals that need no host read (an input that requires grad raises here), and its
    finiteness as device flags to read later: ``[(0-d bool tensor, (step, input name))]``, one per
    floating tensor input (``meta=False``: not for meta tensors, which hold no values; the stepwise
    path, whose calls run, passes True). ``nonfinite_input`` is the refusal of a false flag.
    ``checked``: the inputs flagged before ({id: (tensor, version)}, kept by the caller over a trajectory):
    the same tensor unwritten since (a prompt's embeddings at every step) is not flagged again."""
    flags = []
    for name, t in _tensor_inputs(call):
        if t.requires_grad:
            raise JaggInputError(
                f"the tensor requires grad (it depends on a trainable "
                f"value, e.g. an earlier DiT output). JAGG needs stored trajectory data: pass "
                f"`.detach()`ed states and conditioning",
                where=f"step {step}, input {name}")
        if t.is_floating_point() and (meta or t.device.type != "meta"):
            if checked is not None:
                seen = checked.get(id(t))
                if seen is not None and seen[0] is t and seen[1] == version_counter(t):
                    continue
                checked[id(t)] = (t, version_counter(t))
            flags.append((torch.isfinite(t).all(), (step, name)))
    return flags


def nonfinite_input(step: int, name: str) -> JaggInputError:
    return JaggInputError(
        f"contains NaN or Inf; check the stored trajectory "
        f"(rollouts in bf16 can overflow: keep latents and the SDE math in fp32)",
        where=f"step {step}, input {name}")


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
                f"in t and needs distinct timesteps within a window (pass each step's own timestep). Two "
                f"grad-enabled DiT calls at one timestep are usually classifier-free guidance with separate "
                f"uncond and cond calls: concatenate them into one call on [uncond; cond] (Flow-GRPO's form), "
                f"or make the uncond call under torch.no_grad() if it needs no gradient"
            )
    raise JaggInputError(
        f"timesteps of steps {list(steps)} are not strictly monotone; a window must follow the "
        f"sampler's schedule in order (check the step order and the time_arg option)"
    )


def conform_placement(dit: nn.Module, call: DitCall) -> DitCall:
    """``call`` with the inputs ``check_placement`` would refuse moved/cast to the DiT's device and
    dtype. Only for a frontend's fake-tensor run while tracing: the trace must complete so that
    the refusal can be raised from the graph pass with the step number and the source line."""
    param = dit_parameter(dit)
    if param is None:
        return call
    state = primary_input(call)
    batch = state.shape[0] if state.ndim else None

    def fix(path, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        name = input_name(path)
        if leaf.device != param.device and param.device.type != "meta":
            leaf = leaf.to(param.device)
        if (leaf.is_floating_point() and param.is_floating_point() and leaf.dtype != param.dtype
                and not torch.is_autocast_enabled(leaf.device.type)
                and (path == state_path or (leaf.ndim >= 2 and leaf.shape[0] == batch
                                            and not any(u in name for u in SHARED_INPUTS)))):
            leaf = leaf.to(param.dtype)
        return leaf

    flat, spec = tree_flatten_with_path((call.args, call.kwargs))
    state_path = next((p for p, leaf in flat if leaf is state), None)
    args, kwargs = tree_unflatten([fix(p, leaf) for p, leaf in flat], spec)
    return DitCall(tuple(args), dict(kwargs))
