"""Bad-input campaign: malformed inputs through the public API, generated with hypothesis.

Two entry points are attacked: ``@jagg_compile`` on the built-in Flow-GRPO loss
(``jaggc_studies.example_losses.flow_grpo_sd3_loss``, a tiny diffusers SD3 transformer, T=6 trained
steps, batch 2) and the runtime ``jagg_calls`` on the same trajectory's DiT calls with a linear
loss Σ_k <v_k, g_k>. Every generated case has an oracle computed without jaggc:

* a case jaggc must refuse ends in a ``jaggc.JaggError`` subclass whose message names the step
  (and the input where there is one) and a fix, and leaves the parameters and the ``.grad``
  accumulated before the call bit-for-bit as they were;
* a case jaggc must accept (e.g. timesteps that are non-monotone only ACROSS a window boundary,
  shape changes inside an exact (<= 2 step) window) gives the gradient of a hand-written JAGG
  reference (``hand_jagg``: per window, J_aᵀ G_a + J_bᵀ G_b from two plain endpoint forwards).

Categories (the generated-case counts are printed at the end of the module with ``-s``, and
written as JSON to ``$JAGGC_CASE_COUNTS`` if set):

  nan_inf_dit_inputs   NaN/±Inf in a state, a timestep or the conditioning        -> refused
  nan_inf_loss_inputs  NaN/±Inf in old log-probs, advantages, next states, sigmas  -> same NaN-ness
  timestep_order       permuted / duplicated / reversed timesteps per sample       -> refused iff a
                                                                                      JAGG window is
                                                                                      not strictly
                                                                                      monotone
  shapes               a step with another batch, spatial size or text length      -> refused iff in
                                                                                      a JAGG window
  dtypes               a step's state/conditioning in float64/bf16/fp16            -> refused
  devices              a step's state/conditioning on the 'meta' device            -> refused
  window_vs_steps      T in 0..7 steps, window in -1..9                            -> refused iff W<2;
                                                                                      W>T is one window
                                                                                      of T, T=0 none
  dependent_states     x_j (or its conditioning/timestep) computed from v_i        -> refused
  checkpointing        torch.utils.checkpoint around the DiT call                   -> refused
                       (reentrant inside the DiT's blocks                          -> accepted)

**NaN/Inf in log-probs and advantages: the choice.** These values never enter a DiT call; the
exact per-step loss turns them into NaN/Inf gradients (or, through ``clamp`` of an infinite
advantage, into finite ones). jaggc does not refuse them: a JAGG gradient is non-finite exactly
where the exact gradient is (per parameter tensor, and the loss value likewise), so a trainer's
own non-finite-gradient guard (e.g. skipping a step on a NaN grad norm) behaves the same with and
without jaggc; and where the exact gradient is finite (±Inf advantage clamped to ±5) the JAGG
gradient is bit-identical to the one on the clamped data. Refusing them would need a backward-time
check on the upstream gradients that runs before ANY window's DiT backward (see the report of
issue 8); the property tested here is what holds today.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import types
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import jaggc
from jaggc import JaggError, JaggGraphError, JaggInputError
from jaggc_studies import example_losses as el
from jaggc.runtime import DitCall, jagg_calls
from jaggc.verify.reference import reference_jagg

from helpers import grads as flat_grad, rel_err

T = 6
B = 2
WINDOWS = (3, 4)
NAN, INF = float("nan"), float("inf")
VALUES = st.sampled_from([NAN, INF, -INF])
COUNTS: Counter = Counter()
# categories that compile a fresh loss per generated case run fewer cases (a capture costs seconds)
FEW = max(3, settings.default.max_examples // 5)
SHORT = 4   # trained steps of the losses compiled anew per case (a capture's cost grows with the steps)


# --------------------------------------------------------------------------- shared set-up


def fresh(fn):
    """``fn`` with its own code object: Dynamo keeps one cache (and one recompile limit) per code
    object, so every test that compiles a loss anew gets a clean cache without a global reset
    (which would drop the warm compiled losses the hypothesis tests reuse)."""
    g = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    g.__qualname__ = fn.__qualname__
    return g


class Env:
    def __init__(self):
        ex = el.build_example("flow_grpo_sd3", num_steps=T, batch=B, seed=0)
        self.model, self.batch = ex.model, ex.batch
        self.compiled = {w: jaggc.jagg_compile(fresh(el.flow_grpo_sd3_loss), window=w, weights="t")
                         for w in WINDOWS}   # plain JAGG: the values are checked against hand_jagg
        for c in self.compiled.values():   # capture once on clean data (forward only)
            c(self.model, self.batch)
        g = torch.Generator().manual_seed(5)
        self.gs = [torch.randn(self.batch["latents"][:, 0].shape, generator=g) for _ in range(T + 1)]
        self.prior = [torch.randn(p.shape, generator=g) for p in self.model.parameters()]

    def copy(self) -> dict:
        return {k: v.clone() for k, v in self.batch.items()}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env():
    return Env()


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    if COUNTS:
        print("\n\ngenerated bad-input cases per category:")
        for k, v in sorted(COUNTS.items()):
            print(f"  {k:28s} {v}")
    path = os.environ.get("JAGGC_CASE_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump(dict(COUNTS), f, indent=1, sort_keys=True)


def calls_of(batch: dict, steps=None) -> list[DitCall]:
    steps = range(batch["latents"].shape[1]) if steps is None else steps
    return [DitCall((), dict(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                             encoder_hidden_states=batch["prompt_embeds"],
                             pooled_projections=batch["pooled_prompt_embeds"], return_dict=False))
            for j in steps]


def linear_loss(outs, gs) -> torch.Tensor:
    return sum((o[0] * g).sum() for o, g in zip(outs, gs))


def windows_of(num_steps: int, window: int) -> list[list[int]]:
    """Consecutive windows, a shorter tail its own window (written out, not jaggc's partition)."""
    return [list(range(lo, min(lo + window, num_steps))) for lo in range(0, num_steps, window)]


def hand_jagg(model: nn.Module, calls: list[DitCall], gs, window: int) -> torch.Tensor:
    """The JAGG gradient written by hand with plain autograd: per window of > 2 steps,
    J_aᵀ G_a + J_bᵀ G_b with per-sample α_k = (t_k - t_a)/(t_b - t_a); per-step exact otherwise."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for idx in windows_of(len(calls), window):
        if len(idx) <= 2:
            for k in idx:
                total = total + (model(**calls[k].kwargs)[0] * gs[k]).sum()
            continue
        t = torch.stack([calls[k].kwargs["timestep"].double() for k in idx])   # (W, B)
        alpha = (t - t[0]) / (t[-1] - t[0])
        shape = (-1,) + (1,) * (gs[idx[0]].ndim - 1)
        g_a = sum((1 - alpha[i]).view(shape) * gs[k].double() for i, k in enumerate(idx)).float()
        g_b = sum(alpha[i].view(shape) * gs[k].double() for i, k in enumerate(idx)).float()
        total = total + (model(**calls[idx[0]].kwargs)[0] * g_a).sum() \
            + (model(**calls[idx[-1]].kwargs)[0] * g_b).sum()
    total.backward()
    out = flat_grad(model).clone()
    model.zero_grad(set_to_none=True)
    return out


class Recorder:
    """Stands in for the DiT in the eager loss: runs it without grad, records the call and hands
    back a leaf, so that autograd gives the exact upstream gradient g_k = ∂L/∂v_k."""

    def __init__(self, model):
        self.model, self.calls, self.leaves = model, [], []

    def __call__(self, **kwargs):
        with torch.no_grad():
            v = self.model(**kwargs)[0]
        v = v.detach().requires_grad_()
        self.calls.append(DitCall((), dict(kwargs)))
        self.leaves.append(v)
        return (v,)


def loss_upstream(batch: dict, model) -> tuple[list[DitCall], list[torch.Tensor]]:
    rec = Recorder(model)
    loss = el.flow_grpo_sd3_loss(rec, batch)
    gs = torch.autograd.grad(loss, rec.leaves)
    return rec.calls, list(gs)


def _named_steps(msg: str) -> set[int]:
    named = set()
    for m in re.finditer(r"\bsteps?\s+((?:\[[\d,\s]*\])|(?:\d+(?:\s*(?:,|and)\s*\d+)*))", msg):
        named.update(int(x) for x in re.findall(r"\d+", m.group(1)))
    return named


def refused(model: nn.Module, fn, *, steps=None, mentions=(), advice=(), error=JaggError) -> str:
    """Run ``fn`` with a prior gradient in ``.grad`` (as if earlier micro-batches ran); expect a
    jaggc refusal whose message names one of ``steps``, mentions every word of ``mentions`` and
    one of ``advice``; parameters and ``.grad`` must be bit-for-bit what they were."""
    params = [p.detach().clone() for p in model.parameters()]
    prior = [torch.full_like(p, 0.25) + i for i, p in enumerate(model.parameters())]
    for p, g in zip(model.parameters(), prior):
        p.grad = g.clone()
    try:
        with pytest.raises(error) as info:
            fn()
        msg = str(info.value)
        if steps is not None:
            assert _named_steps(msg) & set(steps), f"message names none of steps {sorted(steps)}: {msg}"
        for word in mentions:
            assert word.lower() in msg.lower(), f"message does not mention {word!r}: {msg}"
        assert any(a.lower() in msg.lower() for a in advice), f"no fix advice {advice} in: {msg}"
        for p, g, q in zip(model.parameters(), prior, params):
            assert p.grad is not None and torch.equal(p.grad, g), "a refused call changed .grad"
            assert torch.equal(p.detach(), q), "a refused call changed a parameter"
        return msg
    finally:
        model.zero_grad(set_to_none=True)


def run_compiled(compiled, model, batch) -> None:
    compiled(model, batch).backward()


def run_runtime(model, batch, gs, window: int) -> None:
    linear_loss(jagg_calls(model, calls_of(batch), window=window), gs).backward()


# --------------------------------------------------------------------------- NaN / Inf

DIT_INPUTS = {  # batch key -> (input name in messages, does the message name the step)
    "latents": ("'hidden_states'", True),
    "timesteps": ("'timestep'", True),
    "prompt_embeds": ("'encoder_hidden_states'", False),          # shared by every step
    "pooled_prompt_embeds": ("'pooled_projections'", False),
}


@given(api=st.sampled_from(["compile", "runtime"]), window=st.sampled_from(WINDOWS),
       key=st.sampled_from(sorted(DIT_INPUTS)), step=st.integers(0, T - 1), sample=st.integers(0, B - 1),
       value=VALUES, data=st.data())
def test_nan_inf_in_dit_inputs_is_refused(env, api, window, key, step, sample, value, data):
    COUNTS["nan_inf_dit_inputs"] += 1
    batch = env.copy()
    t = batch[key]
    if key in ("latents", "timesteps"):
        cell = t[sample, step]
    else:
        cell = t[sample]
    flat = cell.reshape(-1)
    flat[data.draw(st.integers(0, flat.numel() - 1), label="element")] = value
    name, names_step = DIT_INPUTS[key]
    fn = (functools.partial(run_compiled, env.compiled[window], env.model, batch) if api == "compile"
          else functools.partial(run_runtime, env.model, batch, env.gs, window))
    refused(env.model, fn, steps=[step] if names_step else range(T), mentions=(name, "nan or inf"),
            advice=("check the stored trajectory",), error=JaggInputError)


LOSS_INPUTS = ("log_probs", "advantages", "next_latents", "sigmas", "sigmas_next")


def _grads_and_loss(model, fn) -> tuple[list[torch.Tensor], torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out, loss.detach()


@given(window=st.sampled_from(WINDOWS), key=st.sampled_from(LOSS_INPUTS), step=st.integers(0, T - 1),
       sample=st.integers(0, B - 1), value=VALUES, data=st.data())
def test_nan_inf_in_loss_inputs_gives_the_exact_nan_pattern(env, window, key, step, sample, value, data):
    """Documented choice (module docstring): not refused; JAGG is non-finite exactly where the exact
    gradient is, per parameter tensor, and so is the loss value."""
    COUNTS["nan_inf_loss_inputs"] += 1
    batch = env.copy()
    cell = batch[key][sample, step].reshape(-1)
    cell[data.draw(st.integers(0, cell.numel() - 1), label="element")] = value
    exact, exact_loss = _grads_and_loss(env.model, lambda: el.flow_grpo_sd3_loss(env.model, batch))
    jagg, jagg_loss = _grads_and_loss(env.model, lambda: env.compiled[window](env.model, batch))
    assert bool(torch.isfinite(jagg_loss)) == bool(torch.isfinite(exact_loss))
    assert bool(torch.isnan(jagg_loss)) == bool(torch.isnan(exact_loss))
    finite_exact = [bool(torch.isfinite(g).all()) for g in exact]
    finite_jagg = [bool(torch.isfinite(g).all()) for g in jagg]
    names = [n for n, _ in env.model.named_parameters()]
    diff = [n for n, a, b in zip(names, finite_exact, finite_jagg) if a != b]
    assert not diff, f"finite in one gradient but not the other: {diff}"
    if key == "advantages" and math.isinf(value):
        # clamp(±inf) = ±5: the JAGG gradient is the one on the clamped data, bit for bit
        batch[key][sample, step] = math.copysign(el.ADV_CLIP_MAX, value)
        clamped, _ = _grads_and_loss(env.model, lambda: env.compiled[window](env.model, batch))
        assert all(torch.equal(a, b) for a, b in zip(jagg, clamped))


# --------------------------------------------------------------------------- timestep order


def _monotone(t: torch.Tensor) -> bool:
    d = t[1:] - t[:-1]
    return bool((d > 0).all() or (d < 0).all())


@given(api=st.sampled_from(["compile", "runtime"]), window=st.sampled_from(WINDOWS),
       perm=st.permutations(range(T)), dup=st.one_of(st.none(), st.integers(0, T - 2)),
       samples=st.sampled_from(["all", 0, 1]))
def test_timestep_order(env, api, window, perm, dup, samples):
    """Per sample, each JAGG window (> 2 steps) needs strictly monotone, distinct timesteps;
    anything across window boundaries, or inside an exact tail window, is fine."""
    COUNTS["timestep_order"] += 1
    batch = env.copy()
    rows = list(range(B)) if samples == "all" else [samples]
    ts = batch["timesteps"]
    for r in rows:
        ts[r] = ts[r][list(perm)]
        if dup is not None:
            ts[r, dup + 1] = ts[r, dup]
    bad = [idx for idx in windows_of(T, window) if len(idx) > 2
           and not all(_monotone(ts[b, idx]) for b in range(B))]
    if api == "compile":
        fn = functools.partial(run_compiled, env.compiled[window], env.model, batch)
    else:
        fn = functools.partial(run_runtime, env.model, batch, env.gs, window)
    if bad:
        refused(env.model, fn, steps=bad[0], mentions=("timestep",),
                advice=("distinct", "schedule"), error=JaggInputError)
        return
    if api == "compile":
        calls, gs = loss_upstream(batch, env.model)
    else:
        calls, gs = calls_of(batch), env.gs
    want = hand_jagg(env.model, calls, gs, window)
    env.model.zero_grad(set_to_none=True)
    fn()
    got = flat_grad(env.model)
    env.model.zero_grad(set_to_none=True)
    assert rel_err(got, want) < 1e-4


# --------------------------------------------------------------------------- shapes


def _reshaped_call(call: DitCall, kind: str, gen: torch.Generator) -> DitCall:
    kw = dict(call.kwargs)
    x = kw["hidden_states"]
    if kind == "batch":   # every batched input of the step has B+1 samples: runnable on its own
        kw = {k: (torch.cat([v, v[:1]]) if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == B else v)
              for k, v in kw.items()}
    elif kind == "spatial":
        kw["hidden_states"] = torch.randn(x.shape[0], x.shape[1], 6, 6, generator=gen)
    elif kind == "text_len":
        e = kw["encoder_hidden_states"]
        kw["encoder_hidden_states"] = torch.cat([e, e[:, :1]], 1)
    return DitCall((), kw)


@given(num_steps=st.integers(3, T), window=st.integers(3, T), step=st.integers(0, T - 1),
       kind=st.sampled_from(["batch", "spatial", "text_len"]))
def test_shape_change_between_steps(env, num_steps, window, step, kind):
    """Runtime: refused iff the odd step shares a JAGG window with other steps; inside an exact
    (<= 2 step) window each step runs alone and the gradient is the exact one."""
    window, step = min(window, num_steps), min(step, num_steps - 1)
    COUNTS["shapes"] += 1
    calls = calls_of(env.batch, range(num_steps))
    calls[step] = _reshaped_call(calls[step], kind, torch.Generator().manual_seed(step))
    with torch.no_grad():
        odd = calls[step](env.model)[0].shape
    gs = [torch.randn(odd, generator=torch.Generator().manual_seed(9)) if i == step else env.gs[i]
          for i in range(num_steps)]

    def fn():
        linear_loss(jagg_calls(env.model, calls, window=window), gs).backward()

    win = next(idx for idx in windows_of(num_steps, window) if step in idx)
    if len(win) > 2:
        refused(env.model, fn, steps=[step], mentions=("batch" if kind == "batch" else "shape",),
                advice=("same batch", "batch-compatible"), error=JaggInputError)
        return
    want = hand_jagg(env.model, calls, gs, window)
    env.model.zero_grad(set_to_none=True)
    fn()
    assert rel_err(flat_grad(env.model), want) < 1e-4
    env.model.zero_grad(set_to_none=True)


def list_states_loss(transformer, states, batch):
    """Flow-GRPO with the states passed as a list of per-step tensors (one may be odd)."""
    total = 0.0
    for j in range(len(states)):
        v = transformer(hidden_states=states[j], timestep=batch["timesteps"][:, j],
                        encoder_hidden_states=batch["prompt_embeds"],
                        pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
        total = total + (v.float() ** 2).mean()
    return total


def test_shape_change_between_steps_compiled(env):
    """Through @jagg_compile: step 2's state has another spatial size (the DiT runs it alone, so
    the capture succeeds); the window refuses it at run time, naming the step and the input."""
    COUNTS["shapes"] += 1
    states = [env.batch["latents"][:, j] for j in range(4)]
    states[2] = torch.randn(B, states[2].shape[1], 6, 6, generator=torch.Generator().manual_seed(3))
    compiled = jaggc.jagg_compile(fresh(list_states_loss), window=4, capture="dynamo")
    refused(env.model, lambda: compiled(env.model, states, env.batch).backward(), steps=[2],
            mentions=("'hidden_states'", "shape"), advice=("batch-compatible",), error=JaggInputError)


# --------------------------------------------------------------------------- dtypes and devices

RUNTIME_INPUTS = {"state": ("hidden_states", "'hidden_states'"),
                  "conditioning": ("encoder_hidden_states", "'encoder_hidden_states'"),
                  "pooled": ("pooled_projections", "'pooled_projections'")}


@given(window=st.sampled_from(WINDOWS), step=st.integers(0, T - 1), which=st.sampled_from(sorted(RUNTIME_INPUTS)),
       dtype=st.sampled_from([torch.float64, torch.bfloat16, torch.float16]))
def test_dtype_of_one_step(env, window, step, which, dtype):
    COUNTS["dtypes"] += 1
    calls = calls_of(env.batch)
    key, name = RUNTIME_INPUTS[which]
    calls[step] = DitCall((), {**calls[step].kwargs, key: calls[step].kwargs[key].to(dtype)})
    refused(env.model, lambda: linear_loss(jagg_calls(env.model, calls, window=window), env.gs).backward(),
            steps=[step], mentions=(name, str(dtype), "torch.float32"), advice=("cast",), error=JaggInputError)


@given(window=st.sampled_from(WINDOWS), step=st.integers(0, T - 1), which=st.sampled_from(sorted(RUNTIME_INPUTS)))
def test_meta_device_in_one_step(env, window, step, which):
    COUNTS["devices"] += 1
    calls = calls_of(env.batch)
    key, name = RUNTIME_INPUTS[which]
    calls[step] = DitCall((), {**calls[step].kwargs, key: calls[step].kwargs[key].to("meta")})
    refused(env.model, lambda: linear_loss(jagg_calls(env.model, calls, window=window), env.gs).backward(),
            steps=[step], mentions=(name, "meta", "cpu"), advice=("move",), error=JaggInputError)


COMPILED_PLACEMENT = {
    # batch key -> (transform, error, mentions)
    "latents-float64": ("latents", lambda t: t.double(), JaggInputError, ("'hidden_states'", "torch.float64")),
    "latents-bfloat16": ("latents", lambda t: t.bfloat16(), JaggInputError, ("'hidden_states'", "torch.bfloat16")),
    "prompt_embeds-float64": ("prompt_embeds", lambda t: t.double(), JaggInputError,
                              ("'encoder_hidden_states'", "torch.float64")),
    "prompt_embeds-meta": ("prompt_embeds", lambda t: t.to("meta"), JaggInputError,
                           ("'encoder_hidden_states'", "meta")),
}


@pytest.mark.parametrize("case", sorted(COMPILED_PLACEMENT))
def test_dtype_device_compiled(env, case):
    """Through @jagg_compile the refusal comes from the captured graph (Dynamo's recorded example
    values), before anything runs: it names step 0, the source line and the input."""
    COUNTS["dtypes" if "meta" not in case else "devices"] += 1
    key, transform, error, mentions = COMPILED_PLACEMENT[case]
    batch = _steps(env.batch, SHORT)
    batch[key] = transform(batch[key])
    compiled = jaggc.jagg_compile(fresh(el.flow_grpo_sd3_loss), window=4, capture="dynamo")
    msg = refused(env.model, lambda: run_compiled(compiled, env.model, batch), steps=[0], mentions=mentions,
                  advice=("cast", "move"), error=error)
    assert "example_losses.py:" in msg


def test_meta_latents_compiled(env):
    """'meta' latents also feed the user's own SDE math, which Dynamo fails to trace (a device
    mismatch in the user's code, before jaggc sees a graph); FX cannot trace the loss either, and
    the intercept fallback refuses the first DiT call before running it: step 0, the input, the
    fix. Never a bare traceback."""
    COUNTS["devices"] += 1
    batch = _steps(env.batch, SHORT)
    batch["latents"] = batch["latents"].to("meta")
    compiled = jaggc.jagg_compile(fresh(el.flow_grpo_sd3_loss), window=4)
    refused(env.model, lambda: run_compiled(compiled, env.model, batch), steps=[0],
            mentions=("'hidden_states'", "meta", "cpu"), advice=("move",), error=JaggInputError)


# --------------------------------------------------------------------------- window vs steps


@given(num_steps=st.integers(0, T + 1), window=st.integers(-1, T + 3))
def test_window_vs_steps_runtime(env, num_steps, window):
    COUNTS["window_vs_steps"] += 1
    batch = env.batch
    if num_steps > T:   # one step more than the stored trajectory: reuse the last state at a new time
        batch = env.copy()
        for k in ("latents", "timesteps"):
            last = batch[k][:, -1:]
            batch[k] = torch.cat([batch[k], last * (0.5 if k == "timesteps" else 1.0)], 1)
    calls = calls_of(batch, range(num_steps))
    gs = env.gs[:num_steps]

    def fn():
        linear_loss(jagg_calls(env.model, calls, window=window), gs).backward()

    if window < 2:
        refused(env.model, fn, mentions=(f"window={window}",), advice=("at least 2",), error=JaggInputError)
    elif num_steps == 0:
        assert jagg_calls(env.model, calls, window=window) == []      # an empty trajectory has no outputs
    else:
        # window is the largest window: fewer steps make one window of their length (<= 2: exact)
        want = hand_jagg(env.model, calls, gs, window)
        env.model.zero_grad(set_to_none=True)
        fn()
        assert rel_err(flat_grad(env.model), want) < 1e-4
        env.model.zero_grad(set_to_none=True)


def test_single_step_trajectory_runs_exactly(env):
    COUNTS["window_vs_steps"] += 1
    calls = calls_of(env.batch, [0])
    linear_loss(jagg_calls(env.model, calls, window=2), env.gs[:1]).backward()
    got = flat_grad(env.model).clone()
    env.model.zero_grad(set_to_none=True)
    linear_loss([c(env.model) for c in calls], env.gs[:1]).backward()
    assert rel_err(got, flat_grad(env.model)) == 0
    env.model.zero_grad(set_to_none=True)


def _steps(batch: dict, n: int) -> dict:
    return {k: (v[:, :n].contiguous() if v.ndim >= 2 and v.shape[1] == T else v) for k, v in batch.items()}


@pytest.mark.parametrize("num_steps,window", [(SHORT, SHORT + 1), (2, 4), (1, 2)])
def test_window_longer_than_the_steps_compiled(env, num_steps, window):
    """``window`` is the largest window: a compiled loss with fewer trained steps gets one window of
    its length (MixGRPO's window shrinking at the end of its run): plain JAGG over them, exact for
    one or two steps; the loss value is the undecorated one."""
    COUNTS["window_vs_steps"] += 1
    batch = _steps(env.batch, num_steps)
    compiled = jaggc.jagg_compile(fresh(el.flow_grpo_sd3_loss), window=window, weights="t")
    env.model.zero_grad(set_to_none=True)
    loss = compiled(env.model, batch)
    loss.backward()
    got = flat_grad(env.model).clone()
    ref_loss, ref = reference_jagg(el.flow_grpo_sd3_loss, (env.model, batch), env.model, window)
    env.model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-7)
    assert rel_err(got, ref) < 1e-5
    assert [w.steps for w in compiled.report.windows] == [list(range(num_steps))]


def summed_loss(transformer, batch):
    """Flow-GRPO without the division by the step count (so 0 steps is not a ZeroDivisionError)."""
    total = 0.0
    for j in range(batch["timesteps"].shape[1]):
        latents = batch["latents"][:, j]
        v = transformer(hidden_states=latents, timestep=batch["timesteps"][:, j],
                        encoder_hidden_states=batch["prompt_embeds"],
                        pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
        _, log_prob, _, _ = el.sde_step_with_logprob(v, latents, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                                     batch["next_latents"][:, j], batch["sigma_max"])
        total = total + el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
    return total


def test_empty_trajectory_compiled(env):
    """No trained step: nothing to rewrite, the compiled loss returns the undecorated value."""
    COUNTS["window_vs_steps"] += 1
    compiled = jaggc.jagg_compile(fresh(summed_loss), window=2)
    assert compiled(env.model, _steps(env.batch, 0)) == summed_loss(env.model, _steps(env.batch, 0)) == 0.0


def test_empty_trajectory_after_a_successful_call(env):
    """Dynamo retraces for the new step count and builds no graph; FX traces a graph without DiT
    call: either way the value is the undecorated loss's, and the next full call is right again."""
    COUNTS["window_vs_steps"] += 1
    for capture in ("auto", "dynamo"):
        compiled = jaggc.jagg_compile(fresh(summed_loss), window=2, capture=capture)
        compiled(env.model, _steps(env.batch, 2)).backward()
        env.model.zero_grad(set_to_none=True)
        assert compiled(env.model, _steps(env.batch, 0)) == 0.0
        assert "no DiT call" in str(compiled.report) or "no graph" in str(compiled.report)
        loss = compiled(env.model, _steps(env.batch, 2))
        torch.testing.assert_close(loss, summed_loss(env.model, _steps(env.batch, 2)))


def test_empty_trajectory_compiled_dividing_loss(env):
    """Flow-GRPO's loss divides by the step count: Dynamo reports the ZeroDivisionError as an
    'Observed exception' graph break; jaggc names the user's exception and the empty trajectory."""
    COUNTS["window_vs_steps"] += 1
    compiled = jaggc.jagg_compile(fresh(el.flow_grpo_sd3_loss), window=2)
    refused(env.model, lambda: compiled(env.model, _steps(env.batch, 0)), mentions=("ZeroDivisionError",),
            advice=("empty", "no DiT call", "trajectory"))


# --------------------------------------------------------------------------- dependent states


def chained_loss_factory(src: int, dst: int, how: str):
    def chained_loss(transformer, batch):
        total = 0.0
        outs = {}
        for j in range(batch["timesteps"].shape[1]):
            latents = batch["latents"][:, j]
            t = batch["timesteps"][:, j]
            cond = batch["prompt_embeds"]
            if j == dst:
                v_src = outs[src]
                if how == "state":
                    latents = latents + 0.01 * v_src          # x_{j} from an earlier v, no detach
                elif how == "timestep":
                    t = t + 0.0 * v_src.mean(dim=(1, 2, 3))
                else:
                    cond = cond + 0.0 * v_src.mean()
            v = transformer(hidden_states=latents, timestep=t, encoder_hidden_states=cond,
                            pooled_projections=batch["pooled_prompt_embeds"], return_dict=False)[0]
            outs[j] = v
            _, log_prob, _, _ = el.sde_step_with_logprob(v, latents, batch["sigmas"][:, j],
                                                         batch["sigmas_next"][:, j], batch["next_latents"][:, j],
                                                         batch["sigma_max"])
            total = total + el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
        return total / batch["timesteps"].shape[1]
    return fresh(chained_loss)


@settings(max_examples=FEW)
@given(pair=st.lists(st.integers(0, SHORT - 1), min_size=2, max_size=2, unique=True).map(sorted),
       window=st.sampled_from(WINDOWS), how=st.sampled_from(["state", "timestep", "conditioning"]))
def test_dependent_states_compiled(env, pair, window, how):
    COUNTS["dependent_states"] += 1
    src, dst = pair
    compiled = jaggc.jagg_compile(chained_loss_factory(src, dst, how), window=window, capture="dynamo")
    batch = _steps(env.batch, SHORT)
    msg = refused(env.model, lambda: run_compiled(compiled, env.model, batch), steps=[dst],
                  mentions=(f"output of step {src}",), advice=(".detach()",), error=JaggGraphError)
    assert re.search(rf"step {dst} \(node \w+, .*test_bad_inputs\.py:\d+\)", msg), msg


@given(pair=st.lists(st.integers(0, T - 1), min_size=2, max_size=2, unique=True).map(sorted),
       window=st.sampled_from(WINDOWS), how=st.sampled_from(["state", "timestep", "conditioning"]))
def test_dependent_states_runtime(env, pair, window, how):
    COUNTS["dependent_states"] += 1
    src, dst = pair
    calls = calls_of(env.batch)
    v_src = env.model(**calls[src].kwargs)[0]   # a grad-enabled output, not detached
    kw = dict(calls[dst].kwargs)
    if how == "state":
        key, name = "hidden_states", "'hidden_states'"
        kw[key] = kw[key] + 0.01 * v_src
    elif how == "timestep":
        key, name = "timestep", "'timestep'"
        kw[key] = kw[key] + 0.0 * v_src.mean(dim=(1, 2, 3))
    else:
        key, name = "encoder_hidden_states", "'encoder_hidden_states'"
        kw[key] = kw[key] + 0.0 * v_src.mean()
    calls[dst] = DitCall((), kw)
    refused(env.model, lambda: linear_loss(jagg_calls(env.model, calls, window=window), env.gs).backward(),
            steps=[dst], mentions=(name, "requires grad", "earlier DiT output"), advice=(".detach()",),
            error=JaggInputError)


# --------------------------------------------------------------------------- checkpointing


def checkpointed_loss_factory(use_reentrant: bool):
    def checkpointed_loss(transformer, batch):
        total = 0.0
        for j in range(batch["timesteps"].shape[1]):
            latents = batch["latents"][:, j]
            v = checkpoint(transformer, latents, batch["prompt_embeds"], batch["pooled_prompt_embeds"],
                           batch["timesteps"][:, j], use_reentrant=use_reentrant)[0]
            _, log_prob, _, _ = el.sde_step_with_logprob(v, latents, batch["sigmas"][:, j],
                                                         batch["sigmas_next"][:, j], batch["next_latents"][:, j],
                                                         batch["sigma_max"])
            total = total + el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j])
        return total / batch["timesteps"].shape[1]
    return fresh(checkpointed_loss)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_around_the_dit_call_compiled(env, use_reentrant):
    """checkpoint(dit, ...) in the loss hides the DiT call in a checkpoint region: refused with the
    source line (reentrant: the exact loss itself gets no gradient with stored no-grad states)."""
    COUNTS["checkpointing"] += 1
    compiled = jaggc.jagg_compile(checkpointed_loss_factory(use_reentrant), window=4, capture="dynamo")
    batch = _steps(env.batch, SHORT)
    msg = refused(env.model, lambda: run_compiled(compiled, env.model, batch),
                  mentions=("checkpoint", "use_reentrant=True"), advice=("enable_gradient_checkpointing",),
                  error=JaggGraphError)
    assert re.search(r"test_bad_inputs\.py:\d+: the DiT \(SD3Transformer2DModel\) is called inside "
                     r"tag_activation_checkpoint", msg), msg


class ReentrantCheckpointed(nn.Module):
    """A DiT wrapped in reentrant checkpointing as a whole (what a trainer might write)."""

    def __init__(self, dit):
        super().__init__()
        self.dit = dit

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict=False):
        return checkpoint(self.dit, hidden_states, encoder_hidden_states, pooled_projections, timestep,
                          use_reentrant=True)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@given(window=st.sampled_from(WINDOWS + (2,)))
def test_reentrant_checkpoint_around_the_dit_runtime(env, window):
    COUNTS["checkpointing"] += 1
    wrapped = ReentrantCheckpointed(env.model)
    refused(env.model, lambda: linear_loss(jagg_calls(wrapped, calls_of(env.batch), window=window), env.gs).backward(),
            mentions=("use_reentrant=True", "no gradient"), advice=("enable_gradient_checkpointing",),
            error=JaggInputError)


def test_reentrant_checkpointing_inside_the_dit_is_fine():
    """Reentrant checkpointing of the DiT's blocks (their inputs require grad) is a plain single
    backward per window: accepted, same gradient as without checkpointing."""
    COUNTS["checkpointing"] += 1
    ex = el.build_example("flow_grpo_sd3", num_steps=4, batch=B, seed=0)
    plain = el.build_example("flow_grpo_sd3", num_steps=4, batch=B, seed=0).model
    ckpt = ex.model
    ckpt.enable_gradient_checkpointing(functools.partial(checkpoint, use_reentrant=True))
    ckpt.train()
    calls = calls_of(ex.batch)
    gs = [torch.randn(ex.batch["latents"][:, 0].shape, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    grads = []
    for m in (ckpt, plain):
        m.zero_grad(set_to_none=True)
        linear_loss(jagg_calls(m, calls, window=4), gs).backward()
        grads.append(flat_grad(m))
    assert rel_err(grads[0], grads[1]) < 1e-6
