"""A differential fuzzer of GRPO-like loss programs (issue 28), shared by tests/test_fuzz.py.

A ``Program`` is one point of the grammar: the DiT (an affine-Jacobian field, a curved field, a
real diffusers SD3), the step count and window, how the trajectory is held (a dict of (B, T+1)
or (T+1, B) tensors, a list of per-step tensors, positional arguments), how the timestep reaches the
DiT (a per-sample tensor, a Python float), how the schedule is read (tensor ops, ``float()``,
``.item()``, ``math.sqrt``), the per-step term (a linear probe or an SDE log-prob with a PPO clip),
classifier-free guidance (one batched call with a detached uncond half, or two calls per step), a
no-grad KL reference call, a data-dependent ``if`` (on the inputs, or on a DiT output), an extra
term on the parameters (weight decay, one parameter), how the terms are accumulated, an in-place
write (states scaled before they are read, the DiT output scaled, a clamp, a detached output stored
into an input buffer or into the next state, a state recomputed from the previous output), and a
mutation that must be refused (a state computed from an undetached output, a grad-carrying output
written into the next state, ``dit.forward``, a NaN state). ``source`` writes the loss as Python
source; it is imported from a file, so every path sees ordinary user code with line numbers.

``run_case`` runs one program through one capture path and backward mode and checks it against
oracles that share no code with jaggc's runtime or passes:

* the undecorated loss: the same value; at window 2 (every window exact) the same gradient; the
  same writes into the inputs;
* the exactness theorem: an affine-Jacobian DiT with every window's interior states on its chord
  (t-weights, per sample) gives the exact gradient at every window size, in float64;
* ``hand_jagg``: JAGG computed here from an eager run (per-step upstream gradients from autograd,
  composites by hand, one autograd call through the knots) for any DiT and window;
* a second call after a parameter step (what a stale trace-time constant gets wrong);
* a mutation that must be refused raises a jaggc error naming a step (or the line), before any
  gradient is written.

Any other outcome raises ``FuzzFailure``; a jaggc capture error on an explicitly chosen FX or Dynamo
path is a decline (the other paths are tried under ``capture="auto"``), and so is a refusal of
``backward="lowmem"`` for a loss it documents as unsupported.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import tempfile
import warnings
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from torch import nn

from jaggc import JaggCaptureError, JaggError, jagg_compile
from jaggc.verify.fields import AffineJacobianField, CurvedField

DITS = ("affine", "curved", "sd3")
CONTAINERS = ("dict_bt", "dict_tb", "list", "args")
IN_PLACE = ("none", "scale_states", "output_mul", "clamp", "out_buffer", "detached_write", "recompute")
MUTATIONS = ("none", "undetached", "grad_write", "forward", "nan")
CAPTURES = ("fx", "dynamo", "intercept", "auto")
BACKWARDS = ("joint", "per_window", "lowmem")


class FuzzFailure(AssertionError):
    """A silently wrong, crashed or wrongly refused case."""


@dataclass(frozen=True)
class Program:
    dit: str = "affine"
    steps: int = 4
    window: int = 2
    container: str = "dict_bt"
    time: str = "tensor"          # "tensor": (B,) per sample; "float": a Python number
    schedule: str = "tensor"      # "tensor", "float", "item", "math"
    term: str = "logprob"         # "linear", "logprob"
    clip: float = 0.2
    cfg: str = "none"             # "none", "batched", "two_calls"
    kl: bool = False
    data_if: str = "none"         # "none", "inputs", "output"
    extra: str = "none"           # "none", "decay", "first", "named"
    accumulate: str = "add"       # "add", "iadd", "stack", "mean"
    in_place: str = "none"
    mutation: str = "none"
    chord: bool = True
    weights: str = "t"            # "t" or "default" (jagg_compile's default: σ-aware placement)
    seed: int = 0

    @property
    def streams(self) -> int:
        return 2 if self.cfg == "two_calls" else 1

    @property
    def must_refuse(self) -> bool:
        return self.mutation != "none"

    @property
    def writes_inputs(self) -> bool:
        return self.in_place in ("scale_states", "out_buffer", "detached_write") or self.mutation == "grad_write"

    @property
    def off_chord(self) -> bool:
        """States the loss changes from its own DiT outputs (the theorem does not apply)."""
        return self.in_place in ("detached_write", "recompute")


# ---------------------------------------------------------------------------------------------
# the loss as source

def _read(p: Program, k: str) -> str:
    return {"dict_bt": f"latents[:, {k}]", "dict_tb": f"latents[{k}]", "list": f"latents[{k}]",
            "args": f"latents[{k}]"}[p.container]


def _call(p: Program, z: str, t: str, *, forward: bool = False, doubled: bool = False) -> str:
    fn = "dit.forward" if forward else "dit"
    if p.dit == "sd3":
        ehs, pool = ('torch.cat([batch["ehs"], batch["ehs"]])', 'torch.cat([batch["pool"], batch["pool"]])') \
            if doubled else ('batch["ehs"]', 'batch["pool"]')
        return (f"{fn}(hidden_states={z}, timestep={t}, encoder_hidden_states={ehs}, pooled_projections={pool}, "
                f"return_dict=False)[0]")
    return f"{fn}({z}, {t})"


def source(p: Program) -> str:
    """The loss function ``loss`` of program ``p`` as Python source."""
    head = "def loss(dit, latents, timesteps, batch):" if p.container == "args" else "def loss(dit, batch):"
    lines = [head]
    if p.container != "args":
        lines += ['    latents = batch["latents"]', '    timesteps = batch["timesteps"]']
    lines += ['    sig, g, adv, old = batch["sigmas"], batch["g"], batch["adv"], batch["old"]']
    if p.in_place == "scale_states" and p.container != "list":
        lines.append("    latents.mul_(0.9)")
    lines += ["    total = 0", "    terms = []", "    vprev = None"]
    loop = {"dict_bt": "range(timesteps.shape[1])", "dict_tb": "range(timesteps.shape[0])",
            "list": "range(len(latents) - 1)", "args": "range(latents.shape[0] - 1)"}[p.container]
    lines.append(f"    for k in {loop}:")
    body = []
    clone = p.in_place in ("detached_write", "recompute") or p.mutation in ("grad_write", "undetached")
    body.append(f"z = {_read(p, 'k')}" + (".clone()" if clone else ""))
    if p.in_place == "scale_states" and p.container == "list":
        body.append("z.mul_(0.9)")
    if p.in_place == "recompute":
        body += ["if vprev is not None:", "    z = z + 0.1 * vprev.detach()"]
    if p.mutation == "undetached":
        body += ["if vprev is not None:", "    z = z + 0.1 * vprev"]
    time_read = {"dict_bt": "timesteps[:, k]", "dict_tb": "timesteps[k]", "list": "timesteps[k]",
                 "args": "timesteps[k]"}[p.container]
    body.append(f"t = {time_read}" if p.time == "tensor" else 't = float(batch["tsched"][k])')
    body.append(f"zn = {_read(p, 'k + 1')}")
    forward = p.mutation == "forward"
    if p.cfg == "batched":
        tt = "torch.cat([t, t])" if p.time == "tensor" else "t"
        body += [f"out = {_call(p, 'torch.cat([z, z])', tt, forward=forward, doubled=True)}",
                 "vu, vc = out.chunk(2)", "v = vu.detach() + 1.5 * (vc - vu.detach())"]
    elif p.cfg == "two_calls":
        body += [f"vu = {_call(p, 'z', 't', forward=forward)}", f"vc = {_call(p, 'z', 't')}", "v = vu + 1.5 * (vc - vu)"]
    else:
        body.append(f"v = {_call(p, 'z', 't', forward=forward)}")
    if p.in_place == "output_mul":
        body.append("v.mul_(0.5)")
    if p.in_place == "recompute" or p.mutation == "undetached":
        body.append("vprev = v")
    if p.in_place == "detached_write":
        body.append(f"{_read(p, 'k + 1')}.add_(0.1 * v.detach())")
    if p.mutation == "grad_write":
        body.append(f"{_read(p, 'k + 1')}.add_(0.1 * v)")
    if p.in_place == "out_buffer":
        body.append('batch["out"][k] = v.detach()')
    body += {"tensor": ["dt = sig[k + 1] - sig[k]", "std = 0.7 * torch.sqrt(-dt)"],
             "float": ["dt = float(sig[k + 1] - sig[k])", "std = 0.7 * (-dt) ** 0.5"],
             "item": ["dt = (sig[k + 1] - sig[k]).item()", "std = 0.7 * (-dt) ** 0.5"],
             "math": ["dt = float(sig[k + 1]) - float(sig[k])", "std = 0.7 * math.sqrt(-dt)"]}[p.schedule]
    if p.term == "linear":
        body.append("s = (v * g[k]).sum(dim=tuple(range(1, v.ndim)))")
        if p.in_place == "clamp":
            body.append("s.clamp_(min=-50.0)")
        body.append("term = s.sum() * (-dt)")
    else:
        body += ["mu = z + dt * v",
                 "lp = -((zn - mu) ** 2).mean(dim=tuple(range(1, z.ndim))) / (2 * std ** 2)",
                 "lr = lp - lp.detach() + old[k]"]
        if p.in_place == "clamp":
            body.append("lr.clamp_(-0.25, 0.25)")
        body += ["ratio = torch.exp(lr)",
                 f"term = torch.maximum(-adv[k] * ratio, -adv[k] * torch.clamp(ratio, 1 - {p.clip}, 1 + {p.clip})).mean()"]
    if p.kl:
        body += ["with torch.no_grad():", f"    vref = {_call(p, 'z', 't')}",
                 "term = term + 0.1 * ((v - vref) ** 2).mean()"]
    if p.data_if == "inputs":
        body += ["if float(adv[k].abs().max()) > 0.8:", "    term = term * 0.5"]
    elif p.data_if == "output":
        body += ["if term.item() > 0:", "    term = term * 0.5"]
    body += {"add": ["total = total + term"], "mean": ["total = total + term"], "stack": ["terms.append(term)"],
             "iadd": ["if k == 0:", "    total = term", "else:", "    total += term"]}[p.accumulate]
    lines += ["        " + b for b in body]
    result = {"add": "total", "iadd": "total", "mean": "total / (k + 1)", "stack": "torch.stack(terms).mean()"}[p.accumulate]
    named = {"affine": "dit.A", "curved": "dit.w1", "sd3": "dit.proj_out.weight"}[p.dit]
    extra = {"none": "", "decay": " + 1e-3 * sum((p ** 2).sum() for p in dit.parameters())",
             "first": " + 1e-2 * next(dit.parameters()).pow(2).sum()", "named": f" + 1e-2 * ({named} ** 2).sum()"}[p.extra]
    lines.append(f"    return {result}{extra}")
    return "\n".join(lines) + "\n"


_DIR = tempfile.mkdtemp(prefix="jaggc_fuzz_")
_COUNTER = itertools.count()


def load(p: Program):
    """Import ``source(p)`` from a file of its own (a fresh code object per case)."""
    name = f"fuzz_loss_{os.getpid()}_{next(_COUNTER)}"
    path = os.path.join(_DIR, name + ".py")
    with open(path, "w") as f:
        f.write("import math\nimport torch\n\n\n" + source(p))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.loss


# ---------------------------------------------------------------------------------------------
# DiTs and inputs

def _per_sample(t, x: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device).reshape(-1)
    return t.expand(x.shape[0]) if t.numel() == 1 else t


class FuzzAffine(AffineJacobianField):
    """An affine-Jacobian field that also takes a Python-number timestep."""

    def forward(self, x, timestep):
        return super().forward(x, _per_sample(timestep, x))


class FuzzCurved(CurvedField):
    def forward(self, x, timestep):
        return super().forward(x, _per_sample(timestep, x))


_SD3 = {}


def make_dit(p: Program) -> nn.Module:
    if p.dit == "affine":
        return FuzzAffine(3, seed=p.seed % 7)
    if p.dit == "curved":
        return FuzzCurved(3, seed=p.seed % 7)
    from jaggc import models

    if "state" not in _SD3:
        _SD3["model"] = models.sd3("tiny", seed=0)
        _SD3["state"] = {k: v.clone() for k, v in _SD3["model"].state_dict().items()}
    model = _SD3["model"]
    model.load_state_dict(_SD3["state"])
    model.train()
    return model


def windows_of(p: Program) -> list[list[int]]:
    """The steps of each window, per stream (jaggc's one grouping rule for this grammar)."""
    if p.time == "float":
        return [[k] for k in range(p.steps)]             # a Python-number timestep: every call its own
    return [list(range(a, min(a + p.window, p.steps))) for a in range(0, p.steps, p.window)]


def make_inputs(p: Program, dit: nn.Module):
    gen = torch.Generator().manual_seed(1000 + p.seed)
    B = 2
    sd3 = p.dit == "sd3"
    dtype = torch.float32 if sd3 else torch.float64
    shape = (B, 4, 8, 8) if sd3 else (B, 3)
    gaps = torch.rand(p.steps, generator=gen, dtype=torch.float64) + 0.3
    sched = 1.0 - torch.cumsum(gaps, 0) / (gaps.sum() * 1.15) + gaps[0] / (gaps.sum() * 1.15)
    times = torch.stack([sched * (1 - 0.04 * b) for b in range(B)], 1) if p.time == "tensor" else \
        sched[:, None].expand(p.steps, B)
    states = torch.randn(p.steps + 1, *shape, generator=gen, dtype=torch.float64)
    if p.chord:
        for w in windows_of(p):
            a, b = w[0], w[-1]
            for k in w[1:-1]:
                alpha = ((times[k] - times[a]) / (times[b] - times[a])).reshape(B, *([1] * (len(shape) - 1)))
                states[k] = (1 - alpha) * states[a] + alpha * states[b]
    if p.mutation == "nan":
        states[p.seed % p.steps].view(-1)[0] = float("nan")
    scale = 1000.0 if sd3 else 1.0
    times_out = (times * scale).to(dtype)
    sigmas = torch.cat([sched, sched[-1:] * 0.5]).to(dtype)
    batch = {"sigmas": sigmas, "tsched": (sched * scale).to(dtype),
             "g": torch.randn(p.steps, *shape, generator=gen, dtype=torch.float64).to(dtype),
             "adv": torch.randn(p.steps, B, generator=gen, dtype=torch.float64).to(dtype),
             "old": (torch.rand(p.steps, B, generator=gen, dtype=torch.float64) * 0.6 - 0.3).to(dtype),
             "out": torch.zeros(p.steps, *shape, dtype=dtype)}
    if sd3:
        batch["ehs"] = torch.randn(B, 5, 16, generator=gen)
        batch["pool"] = torch.randn(B, 8, generator=gen)
    states = states.to(dtype)
    if p.container == "dict_bt":
        batch.update(latents=states.transpose(0, 1).contiguous(), timesteps=times_out.transpose(0, 1).contiguous())
    elif p.container == "dict_tb":
        batch.update(latents=states, timesteps=times_out)
    elif p.container == "list":
        batch.update(latents=[s.clone() for s in states], timesteps=[t.clone() for t in times_out])
    else:
        return (states, times_out, batch)
    return (batch,)


def copy_inputs(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: copy_inputs(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(copy_inputs(v) for v in x)
    return x


def _leaves(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    return []


# ---------------------------------------------------------------------------------------------
# oracles

def _flat(dit: nn.Module, grads) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p, g in zip(dit.parameters(), grads)])


def eager(loss_fn, args, dit) -> tuple[torch.Tensor, torch.Tensor]:
    loss = loss_fn(dit, *args)
    grads = torch.autograd.grad(loss, list(dit.parameters()), allow_unused=True)
    return loss.detach(), _flat(dit, grads)


def hand_jagg(p: Program, loss_fn, args, dit) -> tuple[torch.Tensor, torch.Tensor]:
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
        loss = loss_fn(dit, *args)
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
    return loss.detach(), _flat(dit, full) - _flat(dit, through_dit) + _flat(dit, jagg)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def _same_inputs(a, b, tol: float) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and torch.allclose(x.double(), y.double(), rtol=tol, atol=tol, equal_nan=True)
        for x, y in zip(la, lb))


# ---------------------------------------------------------------------------------------------
# one case

STATS: Counter = Counter()


def run_case(p: Program, capture: str, backward: str) -> str:
    """Run ``p`` through ``capture`` and ``backward``; the outcome's name, or ``FuzzFailure``."""
    with warnings.catch_warnings():
        # capture fallbacks and window cuts are announced; here the outcome is what is checked
        warnings.filterwarnings("ignore", message="jaggc:")
        outcome = _run_case(p, capture, backward)
    STATS[(capture, backward, outcome)] += 1
    return outcome


def _tolerances(p: Program) -> tuple[float, float]:
    return (2e-5, 2e-3) if p.dit == "sd3" else (1e-10, 1e-8)


def _run_case(p: Program, capture: str, backward: str) -> str:
    loss_fn = load(p)
    dit = make_dit(p)
    inputs = make_inputs(p, dit)
    vtol, gtol = _tolerances(p)
    what = f"{capture}/{backward}: {p}\n{source(p)}"
    compiled = jagg_compile(loss_fn, window=p.window, capture=capture, backward=backward,
                            **({} if p.weights == "default" else {"weights": "t"}))
    for call in (0, 1):
        if call == 1:
            with torch.no_grad():           # a parameter step between the calls
                gen = torch.Generator().manual_seed(p.seed)
                for q in dit.parameters():
                    q.add_(0.05 * torch.randn(q.shape, generator=gen, dtype=q.dtype))
        eager_args = copy_inputs(inputs)
        value, exact = eager(loss_fn, eager_args, dit)      # a mutation too: the program itself is valid
        if not p.must_refuse:
            _, reference = hand_jagg(p, loss_fn, copy_inputs(inputs), dit)
        args = copy_inputs(inputs)
        for q in dit.parameters():
            q.grad = None
        try:
            out = compiled(dit, *args)
            out.backward()
        except JaggCaptureError as e:
            return _declined(p, capture, backward, e, what, call)
        except JaggError as e:
            if backward == "lowmem" and "lowmem" in str(e):
                return "declined: lowmem"
            if p.must_refuse:
                return _refused(p, dit, e, what, args, inputs)
            raise FuzzFailure(f"a legal loss was refused ({type(e).__name__}: {e})\n{what}") from e
        except Exception as e:  # noqa: BLE001
            raise FuzzFailure(f"crash: {type(e).__name__}: {e}\n{what}") from e
        if p.must_refuse:
            raise FuzzFailure(f"a loss that must be refused ran ({p.mutation})\n{what}")
        got = _flat(dit, [q.grad for q in dit.parameters()])
        checks = {"value": _rel(out.detach(), value) <= vtol, "hand JAGG": _rel(got, reference) <= gtol}
        if all(len(w) <= 2 for w in windows_of(p)):
            checks["exact (window 2)"] = _rel(got, exact) <= gtol
        if p.dit == "affine" and p.chord and not p.off_chord:
            checks["theorem (affine, chord)"] = _rel(got, exact) <= gtol
        checks["input writes"] = _same_inputs(args, eager_args, max(vtol, 1e-12))
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise FuzzFailure(
                f"call {call + 1}: silently wrong ({', '.join(bad)}): value {_rel(out.detach(), value):.1e}, "
                f"gradient vs hand JAGG {_rel(got, reference):.1e}, vs exact {_rel(got, exact):.1e}, "
                f"path {compiled.report.path if compiled.report else '?'}\n{what}")
    return f"right ({compiled.report.path})"


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
        return "refused (capture)"
    if capture in ("fx", "dynamo") and call == 0:
        return f"declined: {capture}"
    raise FuzzFailure(f"call {call + 1}: a legal loss was refused on capture={capture!r} "
                      f"(JaggCaptureError: {text})\n{what}")


def _refused(p: Program, dit: nn.Module, e: JaggError, what: str, args, inputs) -> str:
    text = str(e)
    names = re.search(r"step \d+", text) or (p.mutation == "forward" and re.search(r"\.py:\d+", text))
    if not names:
        raise FuzzFailure(f"a refusal that names no step ({type(e).__name__}: {text})\n{what}")
    if any(q.grad is not None for q in dit.parameters()):
        raise FuzzFailure(f"a refused loss wrote gradients ({text})\n{what}")
    if not p.writes_inputs and not _same_inputs(args, inputs, 0.0):
        raise FuzzFailure(f"a refused loss changed its inputs ({text})\n{what}")
    return "refused"


def describe(p: Program) -> dict:
    return asdict(p)


# ---------------------------------------------------------------------------------------------
# the grammar as a hypothesis strategy

def programs(long: bool = False, lowmem: bool = False):
    """Programs of the grammar (module docstring). The quick profile keeps losses short (2-6 steps)
    and the real SD3 rare (about 1 case in 30, 2-3 steps); the long one goes to 12 steps. For
    ``backward="lowmem"`` (``lowmem``), losses it documents as unsupported (parameter terms,
    ``torch.stack(terms)``, two-call CFG) are drawn less often, so that most cases run."""
    from hypothesis import strategies as st

    @st.composite
    def draw_program(draw):
        roll = draw(st.integers(0, 99))
        dit = "sd3" if roll < (8 if long else 3) else "curved" if roll < 45 else "affine"
        steps = draw(st.integers(2, 3 if dit == "sd3" else (12 if long else 6)))
        window = draw(st.integers(2, min(6, steps)))
        mutation = draw(st.sampled_from(MUTATIONS)) if draw(st.integers(0, 99)) < 20 else "none"
        return Program(
            dit=dit, steps=steps, window=window, container=draw(st.sampled_from(CONTAINERS)),
            time="tensor" if dit == "sd3" else draw(st.sampled_from(("tensor", "tensor", "float"))),
            schedule=draw(st.sampled_from(("tensor", "float", "item", "math"))),
            term=draw(st.sampled_from(("linear", "logprob"))), clip=draw(st.sampled_from((1e-4, 0.2, 10.0))),
            cfg=draw(st.sampled_from(("none", "none", "batched") + (() if lowmem else ("two_calls",)) + ("two_calls",))),
            kl=draw(st.booleans()),
            data_if=draw(st.sampled_from(("none", "none", "inputs", "output"))),
            extra=draw(st.sampled_from(("none",) * (8 if lowmem else 2) + ("decay", "first", "named"))),
            accumulate=draw(st.sampled_from(("add", "iadd", "mean") * (3 if lowmem else 1) + ("stack",))),
            in_place=draw(st.sampled_from(IN_PLACE)), mutation=mutation,
            chord=draw(st.integers(0, 9)) < 7, weights=draw(st.sampled_from(("t", "t", "default"))),
            seed=draw(st.integers(0, 10_000)))

    return draw_program()
