"""One DiT call as data, and the batching of several calls into one.

A window's knot steps run as ONE forward on their batch-concatenated inputs, and its interior
steps as one no-grad forward per chunk. ``concat_calls`` builds that batched call and
``split_output`` cuts the batched output back into one output per step, with the structure the
DiT returned (tensor, ``return_dict=False`` tuple, or a diffusers ``BaseOutput``).

Which tensors are batched: every tensor leaf whose leading dimension equals the batch size of the
call's primary input (``hidden_states`` or the first positional tensor). Other tensors (Flux's
``img_ids``/``txt_ids``) and non-tensor leaves are shared and must agree across steps. The
timestep is always batched: a scalar is expanded to one value per sample.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .._compat import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from ..errors import JaggInputError, JaggTypeError, where
from .autocast import fresh_cast_cache


@dataclass(frozen=True)
class DitCall:
    """The positional and keyword arguments of one ``dit(*args, **kwargs)`` call."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __call__(self, dit):
        fresh_cast_cache()      # under a bf16 autocast jaggc replays: this call's own weight casts
        out = dit(*self.args, **self.kwargs)
        if torch.is_grad_enabled():
            check_output_requires_grad(dit, out)
        return out


def check_output_requires_grad(dit, output) -> None:
    """Refuse a grad-enabled call of a trainable DiT whose outputs carry no gradient.

    This is what ``torch.utils.checkpoint.checkpoint(dit, ..., use_reentrant=True)`` around the
    whole DiT does with stored (no-grad) inputs: the reentrant checkpoint runs the DiT under
    no_grad and only re-attaches a graph if an *input* requires grad, so the parameters silently
    get no gradient (the exact loss then fails in ``backward`` or trains nothing).
    """
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves or any(x.requires_grad for x in leaves):
        return
    if not any(p.requires_grad for p in dit.parameters()):
        return
    raise JaggInputError(
        f"a grad-enabled call of the DiT ({type(dit).__name__}) returned outputs that do not require grad "
        f"although the DiT has trainable parameters, so no gradient can reach them. This is what "
        f"torch.utils.checkpoint.checkpoint(..., use_reentrant=True) around the DiT does with stored "
        f"(no-grad) states: use use_reentrant=False, or checkpoint inside the DiT with "
        f"dit.enable_gradient_checkpointing()"
    )


# --- the call layout: where the state and the timestep sit in a DiT call ------------------------
# One rule for the runtime (real tensors) and the passes (fx nodes standing for them): ``is_value``
# says which arguments are tensors (runtime) or graph values (passes).


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def state_position(args: Sequence, kwargs: dict, is_value=_is_tensor) -> int | str | None:
    """Where the state (the latents) sits: ``hidden_states`` if passed by name (diffusers' DiTs),
    else the first tensor argument, else the first tensor keyword; None if there is none."""
    if is_value(kwargs.get("hidden_states")):
        return "hidden_states"
    for i, a in enumerate(args):
        if is_value(a):
            return i
    return next((k for k, v in kwargs.items() if is_value(v)), None)


def time_position(kwargs: dict, time_arg: str | int | None) -> str | int:
    """Where the timestep sits: ``time_arg`` if given, else the keyword ``timestep`` if passed,
    else position 1."""
    if time_arg is not None:
        return time_arg
    return "timestep" if "timestep" in kwargs else 1


def argument_at(args: Sequence, kwargs: dict, position: int | str | None) -> Any:
    """The argument at a position or keyword; None if the call does not pass it."""
    if position is None:
        return None
    if isinstance(position, str):
        return kwargs.get(position)
    return args[position] if position < len(args) else None


def primary_input(call: DitCall) -> torch.Tensor:
    """The state tensor of a call (``state_position``)."""
    position = state_position(call.args, call.kwargs)
    if position is not None:
        return argument_at(call.args, call.kwargs, position)
    raise JaggInputError(
        "a DiT call has no tensor input; jaggc needs the state (hidden_states) as a tensor argument"
    )


def batch_size(call: DitCall) -> int:
    x = primary_input(call)
    if x.ndim == 0:
        raise JaggInputError("the DiT's state input is a 0-d tensor; it needs a leading batch dimension")
    return x.shape[0]


def resolve_time_arg(call: DitCall, time_arg: str | int | None) -> str | int:
    """Where the timestep sits (``time_position``)."""
    return time_position(call.kwargs, time_arg)


def get_time(call: DitCall, time_arg: str | int) -> Any:
    if isinstance(time_arg, str):
        if time_arg not in call.kwargs:
            raise JaggInputError(
                f"the DiT call has no keyword argument {time_arg!r} to read the timestep from; "
                f"pass time_arg= (jaggc.Options(time_arg=...)) the keyword name or position of the timestep argument"
            )
        return call.kwargs[time_arg]
    if time_arg >= len(call.args):
        raise JaggInputError(
            f"the DiT call has {len(call.args)} positional arguments, so position {time_arg} "
            f"cannot hold the timestep; pass time_arg= (jaggc.Options(time_arg=...)) the keyword name or position of the timestep"
        )
    return call.args[time_arg]


def set_time(call: DitCall, time_arg: str | int, value: Any) -> DitCall:
    if isinstance(time_arg, str):
        return DitCall(call.args, {**call.kwargs, time_arg: value})
    args = list(call.args)
    args[time_arg] = value
    return DitCall(tuple(args), call.kwargs)


def per_sample_time(call: DitCall, time_arg: str | int, step: int | None = None) -> torch.Tensor:
    """The timestep of each sample as a (B,) tensor on the state's device (no host sync).

    A per-token timestep (B, L) (Wan 2.2: the generated frames' tokens at the sample's t, the
    conditioning frames' at 0) gives each sample its largest value; ``check_token_times`` refuses
    rows that are not of that form."""
    b = batch_size(call)
    t = get_time(call, time_arg)
    x = primary_input(call)
    if isinstance(t, numbers.Number):
        return torch.full((b,), float(t), dtype=torch.float64, device=x.device)
    if not isinstance(t, torch.Tensor):
        raise JaggTypeError(
            f"the timestep is a {type(t).__name__}; pass a number or a tensor", where=where(step, "timestep"))
    if t.ndim == 0 or t.numel() == 1:
        return t.reshape(()).expand(b)
    if t.ndim == 1 and t.shape[0] == b:
        return t
    if t.ndim == 2 and t.shape[0] == b:
        return t.amax(1)
    raise JaggInputError(
        f"the timestep has shape {tuple(t.shape)}; jaggc needs a scalar, one value "
        f"per sample (shape ({b},)) or one per token (shape ({b}, tokens))", where=where(step, "timestep"))


def check_token_times(call: DitCall, time_arg: str | int, step: int | None = None) -> None:
    """A per-token timestep must be, per sample, one value outside tokens at 0 (conditioning
    frames): JAGG weights each sample by one time. One host sync; only for (B, L) timesteps."""
    t = get_time(call, time_arg)
    if not (isinstance(t, torch.Tensor) and t.ndim == 2 and t.shape[0] == batch_size(call)):
        return
    top = t.amax(1, keepdim=True)
    bad = ~((t == top) | (t == 0)).all(1)
    if bool(bad.any()):
        sample = int(torch.nonzero(bad)[0])
        values = sorted({float(v) for v in t[sample].unique()})
        raise JaggInputError(
            f"the per-token timestep of sample {sample} takes the values {values[:6]}; "
            f"JAGG interpolates each sample's Jacobian in one time, so per-token timesteps must be one value "
            f"per sample, with 0 only on conditioning tokens (Wan 2.2 TI2V). Train such steps exactly "
            f"(routing=jaggc.Routing(jagg_frac=0)) or pass one timestep per sample", where=where(step, "timestep"))


def batched_time(call: DitCall, time_arg: str | int, step: int | None = None) -> DitCall:
    """The call with a scalar timestep expanded to one per sample (so calls can be concatenated);
    per-sample and per-token timesteps are batched as they are."""
    t = get_time(call, time_arg)
    if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == batch_size(call) and t.numel() > 1:
        return call
    return set_time(call, time_arg, per_sample_time(call, time_arg, step))


def input_name(path) -> str:
    """A readable name for a leaf of ``(args, kwargs)``: ``'encoder_hidden_states'``,
    ``'joint_attention_kwargs'['scale']`` or ``args[0]`` (positional)."""
    if len(path) >= 2 and getattr(path[0], "idx", None) in (0, 1):
        head, rest = path[1], path[2:]
        if path[0].idx == 0 and hasattr(head, "idx"):
            return f"args[{head.idx}]" + keystr(rest)
        if path[0].idx == 1 and hasattr(head, "key"):
            return repr(head.key) + keystr(rest)
    s = keystr(path)
    return s or "<root>"


_leaf_name = input_name


def check_compatible(calls: Sequence[DitCall], time_arg: str | int, *, steps: Sequence[int] | None = None,
                     unbatched: Sequence[str] = ()) -> tuple:
    """Refuse calls that cannot share one batched call: different argument structure, batch size
    or tensor shapes, or different shared (unbatched tensor or non-tensor) values.

    ``run_window`` runs this on the WHOLE window, whatever ``interior_chunk``/``batch_knots`` say,
    so a step that runs alone is still checked against the rest. Returns what ``concat_calls``
    needs: (flattened leaves of every call, the tree spec, the batch, whether each leaf is batched).
    """
    steps = list(steps) if steps is not None else list(range(len(calls)))
    b = batch_size(calls[0])
    # the timestep is batched even when a step passes a scalar, so normalise it first
    calls = [batched_time(c, time_arg, s) for c, s in zip(calls, steps)]
    flat0, spec0 = tree_flatten_with_path((calls[0].args, calls[0].kwargs))
    flats = [flat0]
    for c, s in zip(calls[1:], steps[1:]):
        flat, spec = tree_flatten_with_path((c.args, c.kwargs))
        if spec != spec0:
            raise JaggInputError(
                f"step {s} calls the DiT with different arguments than step {steps[0]} "
                f"({spec} vs {spec0}); calls in one window must have the same argument structure"
            )
        if batch_size(c) != b:
            raise JaggInputError(
                f"step {s}: batch size {batch_size(c)} differs from step {steps[0]}'s {b}; "
                f"all steps of a window must have the same batch"
            )
        flats.append(flat)
    batched_flags = []
    time_path = _time_path(time_arg)
    for i, (path, leaf0) in enumerate(flat0):
        name = _leaf_name(path)
        leaves = [f[i][1] for f in flats]
        batched = False
        if isinstance(leaf0, torch.Tensor):
            batched = leaf0.ndim >= 1 and leaf0.shape[0] == b and not any(u in name for u in unbatched)
            for leaf, s in zip(leaves[1:], steps[1:]):
                if not isinstance(leaf, torch.Tensor) or leaf.shape != leaf0.shape:
                    got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                    raise JaggInputError(
                        f"step {s}, input {name}: shape {got} differs from step {steps[0]}'s "
                        f"{tuple(leaf0.shape)}; steps of one window must be batch-compatible"
                    )
                if leaf.device != leaf0.device:
                    raise JaggInputError(
                        f"step {s}, input {name}: tensor is on {leaf.device} but step {steps[0]}'s is on "
                        f"{leaf0.device}; move every step's inputs to the DiT's device"
                    )
                # torch.cat would silently promote the batched call to the wider dtype (the
                # timestep is exempt: the DiT casts it, and a Python-number timestep is float64;
                # under autocast the DiT's matmuls cast every step to the autocast dtype anyway)
                if (leaf.dtype != leaf0.dtype and _path_key(path) != time_path
                        and not torch.is_autocast_enabled(leaf.device.type)):
                    raise JaggInputError(
                        f"step {s}, input {name}: dtype {leaf.dtype} differs from step {steps[0]}'s "
                        f"{leaf0.dtype}; a batched call would silently promote every step to one dtype. "
                        f"Cast the stored inputs of all steps to the same dtype"
                    )
            if not batched:
                for leaf, s in zip(leaves[1:], steps[1:]):
                    if leaf is not leaf0 and not torch.equal(leaf, leaf0):
                        raise JaggInputError(
                            f"step {s}, input {name}: this unbatched tensor (leading dim != batch {b}) "
                            f"differs from step {steps[0]}'s; it cannot be shared by a batched call"
                        )
        else:
            for leaf, s in zip(leaves[1:], steps[1:]):
                if leaf != leaf0:
                    raise JaggInputError(
                        f"step {s}, input {name}: value {leaf!r} differs from step {steps[0]}'s "
                        f"{leaf0!r}; non-tensor arguments must be the same in every step of a window"
                    )
        batched_flags.append(batched)
    return flats, spec0, b, batched_flags


def _time_path(time_arg: str | int) -> tuple:
    return (1, time_arg) if isinstance(time_arg, str) else (0, time_arg)


def _path_key(path) -> tuple:
    return tuple(getattr(k, "idx", getattr(k, "key", None)) for k in path)


def concat_calls(calls: Sequence[DitCall], time_arg: str | int, *, steps: Sequence[int] | None = None,
                 unbatched: Sequence[str] = ()) -> DitCall:
    """One call whose batch is the concatenation of the given calls' batches, in order."""
    if len(calls) == 1:
        return calls[0]
    flats, spec0, _, batched_flags = check_compatible(calls, time_arg, steps=steps, unbatched=unbatched)
    out = []
    for i, batched in enumerate(batched_flags):
        leaves = [f[i][1] for f in flats]
        out.append(torch.cat(leaves, 0) if batched else leaves[0])
    args, kwargs = tree_unflatten(out, spec0)
    return DitCall(tuple(args), dict(kwargs))


def split_output(output: Any, num_calls: int, batch: int) -> list[Any]:
    """Cut a batched DiT output into ``num_calls`` outputs of ``batch`` samples each."""
    if num_calls == 1:
        return [output]
    leaves, spec = tree_flatten(output)
    per_call = [[] for _ in range(num_calls)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.ndim >= 1 and leaf.shape[0] == num_calls * batch:
            for k, chunk in enumerate(leaf.split(batch, 0)):
                per_call[k].append(chunk)
        elif isinstance(leaf, torch.Tensor):
            raise JaggTypeError(
                f"the DiT returned a tensor of shape {tuple(leaf.shape)} for a batch of "
                f"{num_calls * batch}; jaggc needs every output tensor to carry the batch dimension first"
            )
        else:
            for k in range(num_calls):
                per_call[k].append(leaf)
    return [tree_unflatten(p, spec) for p in per_call]
