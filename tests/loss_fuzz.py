"""A differential fuzzer of GRPO-like loss programs (issues 28, 36), shared by tests/compiler/test_fuzz.py.

The grammar is tests/fuzz_grammar.py (``Program``, ``source``, ``programs``), the DiTs and inputs
tests/fuzz_inputs.py. ``run_case`` runs one program through one capture path and backward mode, in
the program's backward form (``backward()``, a scaled loss, ``backward(inputs=params)``,
``torch.autograd.grad``, the sum of two calls' losses, accumulation over two calls,
``torch.amp.GradScaler("cpu")``, ``retain_graph=True`` and a second backward), and checks it
against oracles that share no code with jaggc's runtime or passes:

* the undecorated loss, run the same way from the same module state: the same value and logged
  values; at window 2 (every window exact) the same gradient; the same writes into the inputs; the
  module left in the same state;
* the exactness theorem: an affine-Jacobian DiT with every window's interior states on its chord
  (t-weights, per sample) gives the exact gradient at every window size, in float64;
* ``hand_jagg``: JAGG computed here from an eager run (per-step upstream gradients from autograd,
  composites by hand, one autograd call through the knots) for any DiT and window;
* a second round of calls after a parameter step (what a stale trace-time constant gets wrong; the
  data-dependent branches on ``flip`` / ``flags`` take the other branch);
* the guard on (``jaggc.Guard(every=1)``): ``.grad`` and the value bit-identical to the same
  compiled loss without the guard;
* a mutation or a checkpoint around the DiT call must be refused: a jaggc error naming a step (or
  the line), before any gradient is written;
* a loss whose eager run raises (a write into a state the DiT saved, reentrant checkpointing of a
  call on stored states) raises the same error, or a jaggc error naming a step or line.

Any other outcome raises ``FuzzFailure``; a jaggc capture error on an explicitly chosen FX or Dynamo
path is a decline (the other paths are tried under ``capture="auto"``), and so is a refusal of
``backward="lowmem"`` for a loss it documents as unsupported.

``KNOWN_OPEN``: issue 36's classes A-E, fixed on another branch (issue-36-state). A failure of a
program that has a class's feature (``OPEN_CLASSES``) is counted as ``known-open <class>`` (and
reported by tests/compiler/test_fuzz.py, never silently skipped) only if the same program without the
features passes; any other failure fails the case. After that branch merges, empty the set: the
fuzzer then fails on every one of them.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

import jaggc
from fuzz_grammar import (AUTOCAST, BACKWARD_FORMS, CHECKPOINT, CONTAINERS, DATA_IF, DITS, IN_PLACE,  # noqa: F401
                          MUTATIONS, RETURNS, STATE_HOW, STATE_OPS, Program, describe, load, programs, source,
                          windows_of)
from fuzz_inputs import copy_inputs, leaves, make_dit, make_inputs
from jaggc import JaggCaptureError, JaggError, jagg_compile

CAPTURES = ("fx", "dynamo", "intercept", "auto")
BACKWARDS = ("joint", "per_window", "lowmem")

# issue 36's classes still open (A-E were, until issue-36-state merged): a class here is counted,
# not failed; add one only for a class a parallel branch is fixing, and empty it when that merges
KNOWN_OPEN: set[str] = set()


@dataclass(frozen=True)
class OpenClass:
    name: str
    what: str
    applies: Callable[[Program, str, str, str], bool]     # program, capture, backward, failure text
    strip: Callable[[Program], Program]


_NO_STATE = (lambda p: replace(p, state_op="none"))
_LATE_STATE = ("between_eval", "between_train", "end_eval", "end_train", "give_back")
OPEN_CLASSES = (   # the first that applies names the case (a label: the stripped rerun is the evidence)
    OpenClass("C", "per_window under backward(inputs=) / autograd.grad",
              lambda p, c, b, f: b == "per_window" and p.backward_form in ("inputs", "autograd_grad"),
              lambda p: replace(p, backward_form="plain")),
    OpenClass("B", "intercept: a module-state change after the first DiT call (the replay starts in the "
                   "state the recording left)",
              lambda p, c, b, f: p.state_op in _LATE_STATE and ("path intercept" in f or "capture='intercept'" in f
                                                              or c == "intercept"), _NO_STATE),
    OpenClass("D", "per_window knots re-run in the backward-time module state",
              lambda p, c, b, f: b == "per_window" and p.state_op != "none" and "(value" not in f, _NO_STATE),
    OpenClass("A", "FX: a module-state change after the last DiT call leaks into the calls",
              lambda p, c, b, f: p.state_op in _LATE_STATE, _NO_STATE),
    OpenClass("E", "autocast-region numerics",
              lambda p, c, b, f: p.autocast != "none", lambda p: replace(p, autocast="none")),
)


class FuzzFailure(AssertionError):
    """A silently wrong, crashed or wrongly refused case."""


STATS: Counter = Counter()
FEATURES: Counter = Counter()             # (issue 36 field, value, outcome kind) -> cases
NEW_FIELDS = ("entry_train", "state_op", "state_how", "autocast", "checkpoint", "guard", "backward_form", "data_if",
              "returns")
KNOWN_OPEN_SEEN: Counter = Counter()      # (class, first line of the failure) -> cases


# ---------------------------------------------------------------------------------------------
# oracles

def _flat(dit: nn.Module, grads) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p, g in zip(dit.parameters(), grads)])


def split(out):
    """``(loss, logs)`` of a loss's return value (logs None for a plain loss)."""
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)


def eager(loss_fn, args, dit) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    loss, logs = split(loss_fn(dit, *args))
    grads = torch.autograd.grad(loss, list(dit.parameters()), allow_unused=True)
    return loss.detach(), _flat(dit, grads), logs


def hand_jagg(p: Program, loss_fn, args, dit) -> torch.Tensor:
    """JAGG of the calls the loss makes, computed by hand (module docstring)."""
    outs, times = [], []

    def keep(module, a, kw, output):
        if torch.is_grad_enabled():
            v = output[0] if isinstance(output, (tuple, list)) else output
            t = kw["timestep"] if "timestep" in kw else a[1]
            outs.append(v)
            times.append(torch.as_tensor(t, dtype=torch.float64).reshape(-1).expand(v.shape[0]))

    handle = dit.register_forward_hook(keep, with_kwargs=True)
    try:
        loss, _ = split(loss_fn(dit, *args))
    finally:
        handle.remove()
    params = list(dit.parameters())
    full = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    up = torch.autograd.grad(loss, outs, retain_graph=True, allow_unused=True)
    up = [torch.zeros_like(v) if u is None else u for v, u in zip(outs, up)]
    through_dit = torch.autograd.grad(outs, params, grad_outputs=up, retain_graph=True, allow_unused=True)
    knots, comps = [], []
    for stream in range(p.streams):
        for w in windows_of(p):
            idx = [k * p.streams + stream for k in w]
            scale = 1000.0 if float(max(times[k].max() for k in idx)) > 1.0 else 1.0
            low = p.weights == "default" and any(bool((times[k] / scale < 0.5).any()) for k in idx)
            if len(idx) <= 2 or low:
                knots += [outs[k] for k in idx]
                comps += [up[k] for k in idx]
                continue
            a, b = idx[0], idx[-1]
            ga, gb = torch.zeros_like(up[a]), torch.zeros_like(up[b])
            for k in idx:
                alpha = ((times[k] - times[a]) / (times[b] - times[a])).to(up[k].dtype)
                alpha = alpha.reshape(-1, *([1] * (up[k].ndim - 1)))
                ga, gb = ga + (1 - alpha) * up[k], gb + alpha * up[k]
            knots += [outs[a], outs[b]]
            comps += [ga, gb]
    jagg = torch.autograd.grad(knots, params, grad_outputs=comps, allow_unused=True)
    return _flat(dit, full) - _flat(dit, through_dit) + _flat(dit, jagg)


# below this norm a reference is zero up to rounding (a PPO term clipped on every sample leaves
# eager a 1e-17 gradient from the tie split of torch.maximum): compared absolutely, so a zero
# gradient must match it to 1e-6 * tolerance, not to a relative error of 1 over rounding noise
_ZERO_NORM = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float((a - b).norm() / max(float(b.norm()), _ZERO_NORM))


def _same_inputs(a, b, tol: float) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and torch.allclose(x.double(), y.double(), rtol=tol, atol=tol, equal_nan=True)
        for x, y in zip(la, lb))


def _same_logs(a, b, tol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.keys() != b.keys():
        return False
    return all(_rel(torch.as_tensor(a[k]), torch.as_tensor(b[k])) <= tol if isinstance(a[k], torch.Tensor)
               else a[k] == b[k] for k in a)


@dataclass
class Reference:
    """One undecorated call: its value, exact and hand-JAGG gradients, logs, the inputs after its
    writes, and the module state it left."""
    value: torch.Tensor
    exact: torch.Tensor
    hand: torch.Tensor | None
    logs: dict | None
    args: tuple
    exit_training: bool
    windows: list          # the windows of this call (its entry state decides where a state call cuts)


def reference(p: Program, loss_fn, inputs, dit: nn.Module, entry: bool) -> Reference | RuntimeError:
    """The undecorated loss entered in module state ``entry``; the error if its eager run raises."""
    dit.train(entry)
    args = copy_inputs(inputs)
    try:
        value, exact, logs = eager(loss_fn, args, dit)
    except RuntimeError as e:      # the program itself is invalid: jaggc must raise too
        return e
    exit_training = dit.training
    entered = replace(p, entry_train=entry)
    hand = None
    if not p.must_refuse:
        dit.train(entry)
        hand = hand_jagg(entered, loss_fn, copy_inputs(inputs), dit)
    return Reference(value, exact, hand, logs, args, exit_training, windows_of(entered))


# ---------------------------------------------------------------------------------------------
# the backward forms

def run_backward(p: Program, compiled, dit: nn.Module, arg_sets: list) -> tuple[list, torch.Tensor]:
    """Call ``compiled`` on each argument set and backpropagate in ``p.backward_form``: the
    calls' return values and the gradient of one unscaled pass (the sum over the calls)."""
    params = list(dit.parameters())
    form = p.backward_form
    if form in ("sum2", "accumulate"):
        outs, losses = [], []
        for args in arg_sets:
            outs.append(compiled(dit, *args))
            losses.append(split(outs[-1])[0])
            if form == "accumulate":
                losses[-1].backward()
        if form == "sum2":
            (losses[0] + losses[1]).backward()
        return outs, _flat(dit, [q.grad for q in params])
    out = compiled(dit, *arg_sets[0])
    loss, factor = split(out)[0], 1.0
    if form == "plain":
        loss.backward()
    elif form == "scaled":
        (loss * 0.5).backward()
        factor = 0.5
    elif form == "inputs":
        loss.backward(inputs=params)
    elif form == "autograd_grad":
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        if any(q.grad is not None for q in params):
            raise FuzzFailure("torch.autograd.grad wrote .grad")
        return [out], _flat(dit, grads)
    elif form == "scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(loss).backward()
        factor = 1024.0
    elif form == "retain":
        loss.backward(retain_graph=True)
        loss.backward()
        factor = 2.0
    else:
        raise ValueError(form)
    return [out], _flat(dit, [q.grad for q in params]) / factor


# ---------------------------------------------------------------------------------------------
# one case

def run_case(p: Program, capture: str, backward: str) -> str:
    """Run ``p`` through ``capture`` and ``backward``; the outcome's name, or ``FuzzFailure``."""
    with warnings.catch_warnings():
        # capture fallbacks, window cuts and the guard's figures are announced; here the outcome is checked
        warnings.filterwarnings("ignore", message="jaggc")
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")   # reentrant checkpoint
        try:
            outcome = _run_case(p, capture, backward)
        except FuzzFailure as failure:
            outcome = _known_open(p, capture, backward, failure)
    STATS[(capture, backward, outcome)] += 1
    kind = outcome.split(" (")[0].split(":")[0]
    for field in NEW_FIELDS:
        FEATURES[(field, str(getattr(p, field)), kind)] += 1
    return outcome


def _known_open(p: Program, capture: str, backward: str, failure: FuzzFailure) -> str:
    """``known-open <class>`` if the failing program has an open class's feature and passes without
    the open classes' features; else the failure stands."""
    classes = [c for c in OPEN_CLASSES if c.name in KNOWN_OPEN and c.applies(p, capture, backward, str(failure))]
    if not classes:
        raise failure
    stripped = p
    for c in classes:
        stripped = c.strip(stripped)
    try:
        _run_case(stripped, capture, backward)
    except FuzzFailure:
        raise failure from None
    KNOWN_OPEN_SEEN[(classes[0].name, str(failure).splitlines()[0][:160])] += 1
    return f"known-open {classes[0].name}"


def _tolerances(p: Program) -> tuple[float, float]:
    if p.dit == "sd3":
        return (1e-2, 5e-2) if p.autocast in ("call", "step", "loss") else (2e-5, 2e-3)
    return 1e-10, 1e-8


def _compile(p: Program, loss_fn, capture: str, backward: str, guard: bool):
    return jagg_compile(loss_fn, window=p.window, capture=capture, backward=backward,
                        guard=jaggc.Guard(every=1, on_drift="warn") if guard else None,
                        **({} if p.weights == "default" else {"weights": "t"}))


def _run_case(p: Program, capture: str, backward: str) -> str:
    loss_fn = load(p)
    dit = make_dit(p)
    vtol, gtol = _tolerances(p)
    what = f"{capture}/{backward}: {p}\n{source(p)}"
    compiled = _compile(p, loss_fn, capture, backward, p.guard)
    unguarded = _compile(p, loss_fn, capture, backward, False) if p.guard else None
    for call in (0, 1):
        if call == 1:
            with torch.no_grad():           # a parameter step between the rounds
                gen = torch.Generator().manual_seed(p.seed)
                for q in dit.parameters():
                    q.add_(0.05 * torch.randn(q.shape, generator=gen, dtype=q.dtype))
        sets = [make_inputs(p, dit, call)] + ([make_inputs(replace(p, seed=p.seed + 7919), dit, call)] if p.two_calls else [])
        refs, state = [], p.entry_train
        for inputs in sets:     # the second call of a round is entered in the state the first left
            refs.append(reference(p, loss_fn, inputs, dit, state))
            if isinstance(refs[-1], RuntimeError):
                break
            state = refs[-1].exit_training
        eager_error = next((r for r in refs if isinstance(r, RuntimeError)), None)
        args = [copy_inputs(i) for i in sets]
        for q in dit.parameters():
            q.grad = None
        dit.train(p.entry_train)
        try:
            outs, got = run_backward(p, compiled, dit, args)
        except FuzzFailure as e:
            raise FuzzFailure(f"call {call + 1}: {e}\n{what}") from e
        except Exception as e:  # noqa: BLE001
            documented = _documented_decline(p, backward, e)
            if documented:
                return documented
            if eager_error is not None:
                return _raised_like_eager(eager_error, e, dit, what)
            if isinstance(e, JaggCaptureError):
                return _declined(p, capture, backward, e, what, call)
            if isinstance(e, JaggError):
                if p.must_refuse:
                    return _refused(p, dit, e, what, args[0], sets[0])
                raise FuzzFailure(f"call {call + 1}: a legal loss was refused ({type(e).__name__}: {e})\n{what}") from e
            raise FuzzFailure(f"call {call + 1}: crash: {type(e).__name__}: {e}\n{what}") from e
        if eager_error is not None:
            raise FuzzFailure(f"call {call + 1}: eager raises ({eager_error}), the compiled loss ran\n{what}")
        if p.must_refuse:
            raise FuzzFailure(f"a loss that must be refused ran ({p.mutation}, checkpoint {p.checkpoint})\n{what}")
        _check(p, call, outs, got, refs, args, dit, vtol, gtol, compiled, what)
        if unguarded is not None:
            _check_guard_bit_identity(p, call, unguarded, dit, sets, outs, got, what, compiled._guard)
    return f"right ({compiled.report.path})"


def _check(p, call, outs, got, refs, args, dit, vtol, gtol, compiled, what) -> None:
    exact = sum(r.exact for r in refs)
    hand = sum(r.hand for r in refs)
    values = [split(o)[0].detach() for o in outs]
    checks = {"value": all(_rel(v, r.value) <= vtol for v, r in zip(values, refs)),
              "logs": all(_same_logs(split(o)[1], r.logs, vtol) for o, r in zip(outs, refs)),
              "hand JAGG": _rel(got, hand) <= gtol,
              "module state after the call": dit.training == refs[-1].exit_training,
              "input writes": all(_same_inputs(a, r.args, max(vtol, 1e-12)) for a, r in zip(args, refs))}
    if all(len(w) <= 2 for r in refs for w in r.windows):
        checks["exact (window 2)"] = _rel(got, exact) <= gtol
    # the chord states are placed on the windows of a call entered in p's entry state; a second
    # call of a round entered in another state (the first left the module in eval) may cut elsewhere
    if p.dit == "affine" and p.chord and not p.off_chord and all(r.windows == windows_of(p) for r in refs):
        checks["theorem (affine, chord)"] = _rel(got, exact) <= gtol
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise FuzzFailure(
            f"call {call + 1}: silently wrong ({', '.join(bad)}): value {_rel(values[0], refs[0].value):.1e}, "
            f"gradient vs hand JAGG {_rel(got, hand):.1e}, vs exact {_rel(got, exact):.1e}, "
            f"path {compiled.report.path if compiled.report else '?'}\n{what}")


def _check_guard_bit_identity(p, call, unguarded, dit, sets, outs, got, what, guard=None) -> None:
    """The guard measures, it does not change: the same values and ``.grad`` bit for bit."""
    for q in dit.parameters():
        q.grad = None
    dit.train(p.entry_train)
    plain_outs, plain = run_backward(p, unguarded, dit, [copy_inputs(i) for i in sets])
    same = torch.equal(got, plain) and all(torch.equal(split(a)[0].detach(), split(b)[0].detach())
                                           for a, b in zip(outs, plain_outs))
    if not same:
        raise FuzzFailure(f"call {call + 1}: the guard changed the result (gradient {_rel(got, plain):.1e})\n{what}")
    # issue 42: the guard reads a call's JAGG gradient from .grad, which these forms do not (all) write:
    # such a call gives no probe (never figures made of a .grad nobody wrote); others give finite ones
    if guard is not None and p.backward_form in ("inputs", "autograd_grad"):
        if guard.probed or not guard.skipped:
            raise FuzzFailure(f"call {call + 1}: a probe under backward form {p.backward_form!r} (probed "
                              f"{guard.probed}, skipped {guard.skipped})\n{what}")
    elif guard is not None and guard.last is not None and not math.isfinite(guard.last.rel_error):
        raise FuzzFailure(f"call {call + 1}: the guard's figures are not finite ({guard.last})\n{what}")


def _documented_decline(p: Program, backward: str, e: BaseException) -> str:
    """A refusal the docs state for this backward mode (a loss the mode does not support: the
    low-memory mode's shapes, a per-window loss backpropagated twice): a decline, whatever else."""
    if not isinstance(e, JaggError) or isinstance(e, JaggCaptureError) and backward != "lowmem":
        return ""
    text = str(e)
    if backward == "lowmem" and "lowmem" in text:
        return "declined: lowmem"
    if backward == "per_window" and p.backward_form == "retain" and "backpropagated twice" in text:
        return "declined: per_window retain_graph"
    return ""


def _raised_like_eager(eager_error: RuntimeError, e: BaseException, dit: nn.Module, what: str) -> str:
    text = str(e)
    if isinstance(e, JaggError):
        if not re.search(r"step \d+|\.py:\d+", text):
            raise FuzzFailure(f"eager raises; a jaggc refusal that names neither a step nor a line: {text}\n{what}")
        if any(q.grad is not None for q in dit.parameters()):
            raise FuzzFailure(f"a refused loss wrote gradients ({text})\n{what}")
        return "eager raises: jaggc refused"
    if type(e) is type(eager_error) and text[:60] == str(eager_error)[:60]:
        return "eager raises: raised like eager"
    raise FuzzFailure(f"eager raises {type(eager_error).__name__}: {eager_error}; jaggc raised "
                      f"{type(e).__name__}: {text}\n{what}")


def _declined(p: Program, capture: str, backward: str, e: JaggCaptureError, what: str, call: int) -> str:
    text = str(e)
    if "same JAGG window" in text and not re.search(r"step \d+", text):
        raise FuzzFailure(f"a window refusal that names no step: {text}\n{what}")
    if "cycle" in text:
        raise FuzzFailure(f"a refusal that names a cycle: {text}\n{what}")
    if backward == "lowmem" and "lowmem" in text:
        return "declined: lowmem"
    if p.must_refuse:
        if not re.search(r"step \d+|\.py:\d+", text):
            raise FuzzFailure(f"a refusal that names neither a step nor a line: {text}\n{what}")
        return "refused: capture"
    if capture in ("fx", "dynamo") and call == 0:
        return f"declined: {capture}"
    raise FuzzFailure(f"call {call + 1}: a legal loss was refused on capture={capture!r} "
                      f"(JaggCaptureError: {text})\n{what}")


def _refused(p: Program, dit: nn.Module, e: JaggError, what: str, args, inputs) -> str:
    text = str(e)
    by_line = p.mutation == "forward" or p.checkpoint != "none"
    names = re.search(r"steps? \d+", text) or (by_line and re.search(r"\.py:\d+", text))
    if not names:
        raise FuzzFailure(f"a refusal that names no step ({type(e).__name__}: {text})\n{what}")
    if p.checkpoint != "none" and p.mutation == "none" and "enable_gradient_checkpointing" not in text:
        raise FuzzFailure(f"a checkpoint refusal without the fix ({text})\n{what}")
    if any(q.grad is not None for q in dit.parameters()):
        raise FuzzFailure(f"a refused loss wrote gradients ({text})\n{what}")
    if not p.writes_inputs and not _same_inputs(args, inputs, 0.0):
        raise FuzzFailure(f"a refused loss changed its inputs ({text})\n{what}")
    return "refused"
