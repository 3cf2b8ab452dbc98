"""A trajectory's calls run again with grad inside a window's backward (knots whose graph is not held).

A re-run must compute what the call computed when the loop made it: the same inputs (written in
place since? refused), the same parameters (the ledger), the module's and the thread's state of
then (``CallState``: train/eval, adapters, the step's autocast block) and, where dropout is live,
the same random draws (the call's RNG state). Calls of one window that share their state run as
ONE forward on their batch-concatenated inputs (``Options(batch_knots=True)``, the default, as the
whole-loss path batches its knots): on a latency-bound device a forward and backward of 2B cost
hardly more than of B. With dropout live a batch would draw other masks than the calls did, so
each call then re-runs on its own with its own RNG state: a call whose forward drew random numbers
(``StepVisit.drew``, read from the generators around the call, so whichever API drew: a dropout module,
``F.dropout``, attention's ``dropout_p``, a peft ``lora_dropout``) or, before any call ran, a dropout
module in train mode. A re-run that draws random numbers where its call drew none (its value came from
the rollout cache, not from a forward jaggc can replay) is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
from torch import nn

from .._compat import rng_drawn, rng_states, rng_states_restored, version_counter
from ..errors import JaggInputError
from ..runtime.autocast import autocast_applied
from ..runtime.calls import DitCall, batch_size, concat_calls, resolve_time_arg, split_output

from .roles import RunOfSteps, StepVisit


def rerun_calls(run: RunOfSteps, jobs: Sequence[tuple[StepVisit, DitCall]], *, count: bool = True) -> list[Any]:
    """The outputs, with grad, of each job's call (a visit's call, or its rows under the CFG
    slice) run again in its visit's state (module docstring), in the order of ``jobs``. ``count``:
    counted as the window's re-runs (not for a guard probe's, steps/probe.py)."""
    owner = run.owner
    visits = list({id(v): v for v, _ in jobs}.values())
    for visit in visits:
        for x, version in visit.inputs:
            if version_counter(x) != version:
                raise owner.safety.refuse(run, (
                    f"an input of step {visit.step}'s DiT call was written in place after the call; "
                    f"jaggc re-runs the call with grad in its window's backward and would see other values. Pass "
                    f"the stored states unchanged (write into a copy)"), where=visit.where)
        owner.safety.before_rerun(run, visit)
    if not jobs:
        return []
    batched = _batched(run, jobs)
    if batched is not None:
        call, batch = batched
        before = rng_states(devices=run.devices)
        with _state_applied(run, jobs[0][0].state), owner.passing_through(), torch.enable_grad():
            out = call(owner.module)
            # the slices are views: taken with grad on (a window's backward runs without), or
            # they would carry no graph
            outs = split_output(out, len(jobs), batch)
        owner.counts.grad_forwards += count
        if rng_drawn(before):
            raise _drew_in_rerun(run, jobs[0][0])
    else:
        outs = []
        for visit, job in jobs:
            with rng_states_restored(visit.rng), _state_applied(run, visit.state), owner.passing_through(), \
                    torch.enable_grad():
                outs.append(job(owner.module))
                drew = not visit.drew and rng_drawn(visit.rng)
            owner.counts.grad_forwards += count
            if drew:
                raise _drew_in_rerun(run, visit)
    owner.counts.reruns += len(jobs) if count else 0
    run.latest = jobs[-1][0]
    return outs


def _batched(run: RunOfSteps, jobs: Sequence[tuple[StepVisit, DitCall]]):
    """(one batched call, the batch of one) for ``jobs``, or None when they must run one by one."""
    owner = run.owner
    visits = [v for v, _ in jobs]
    if len(jobs) < 2 or not owner.options.batch_knots or any(v.state != visits[0].state for v in visits):
        return None
    if any(v.drew for v in visits):
        return None            # their forwards drew (dropout): one by one, each from its own RNG states
    with _state_applied(run, visits[0].state):
        if any(m.training for m in run.dropouts):
            return None
    time_arg = resolve_time_arg(jobs[0][1], owner.options.time_arg)
    try:
        call = concat_calls([c for _, c in jobs], time_arg, steps=[v.step for v in visits],
                            unbatched=owner.options.unbatched)
    except JaggInputError:
        return None            # not batch-compatible (another argument structure): one by one
    return call, batch_size(jobs[0][1])


@contextlib.contextmanager
def _state_applied(run: RunOfSteps, state):
    """``state.applied(module)`` with the module's flags read by the trajectory's cheap reader first:
    a re-run in the state the module is in already (the common case) switches nothing."""
    if run.states.read() == state.module:
        with autocast_applied(state.autocast):
            yield
        return
    with state.applied(run.owner.module):
        yield


def _drew_in_rerun(run: RunOfSteps, visit: StepVisit):
    return run.owner.safety.refuse(run, (
        f"the re-run of step {visit.step}'s DiT call in its window's backward drew random numbers (live dropout: a "
        f"dropout module, F.dropout or attention's dropout_p in train mode) where the value the loop saw came from "
        f"no forward that drew (the rollout cache served it), so the re-run cannot draw that value's masks and its "
        f"gradient would belong to other masks. Turn dropout off (eval(), p=0, lora_dropout=0) while training with "
        f"JAGG, or the rollout cache off (rollout_cache=None), or use backward='joint'"), where=visit.where)


def live_dropouts(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules that draw dropout masks when in training mode: torch's dropout modules with p > 0 and
    its modules with a ``dropout`` probability > 0 (``MultiheadAttention``, RNNs). Dropout that no module
    shows (``F.dropout`` in a forward, attention's ``dropout_p``) is seen once a call drew
    (``StepVisit.drew``)."""
    kinds = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
    return [m for m in modules if (isinstance(m, kinds) and m.p > 0)
            or (isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and m.dropout > 0)]


__all__ = ["live_dropouts", "rerun_calls"]
