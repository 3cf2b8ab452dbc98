"""A differential fuzzer of per-step training loops under ``jaggc.stepwise`` (issue 42).

The grammar is tests/step_fuzz_grammar.py. ``execute`` runs one program, written once, through one
of three drivers, from the same model copy and data:

* ``Plain``: the unchanged loop (no jaggc);
* ``Jaggc``: ``jaggc.stepwise(model, ...)`` installed and the loop's ``for`` wrapped by
  ``steps(order, timesteps)`` (or ``trajectory(timesteps)`` before it, then ``close()`` at the end);
* ``Reference``: JAGG by hand, apart from jaggc's runtime: every step's DiT output keeps its graph;
  a step of a JAGG window hands its upstream gradient g_k = ∂loss/∂out (``torch.autograd.grad``) to
  the oracle, and when every declared step of the window has one, the composites
  Γ_a = Σ (1 − α_k) g_k, Γ_b = Σ α_k g_k (α by the per-row timestep, or the index) go through the
  two knot outputs in one ``torch.autograd.backward``; an exact window's step runs ``backward()``.

THE ORACLE'S RULES (docs/stepwise.md, "When a window cannot run as planned", and jaggc/steps/safety.py):
windows are the declared steps sorted by σ (high first), cut into consecutive windows of ``window``;
a window of <= 2 steps, or (default weights) one reaching σ < 0.5, is exact. A JAGG window is OPEN
from its first visit until its last step's gradient arrives (its contribution lands in ``.grad``
only then). Disruptions while a window is open:

* ``zero_grad()`` (module's, optimizer's, either ``set_to_none``): the loop drops what the steps
  before it contributed: their g_k are dropped and every open window runs exactly from then on;
* a clip, a hand-written ``.grad`` write, an optimizer step, a parameter written: REFUSED (a
  ``JaggError``); an exact fallback is also accepted: ``.grad`` equal to the reference whose open
  windows landed their steps exactly just before the write (``fallback=True``), with a jaggc warning;
* the loop left early (``break``, an exception between a step's forward and backward, fewer steps
  than declared): with ``steps()`` the open windows run exactly when the loop ends (the exception's
  step contributes nothing); with ``trajectory()`` that happens at the next declaration or
  ``close()``, and an optimizer step before that is refused (the bullet above); a step visited
  without a backward is refused there;
* ``torch.autograd.grad(loss, params)`` or ``backward(inputs=params)`` at a step of a JAGG window:
  REFUSED (only a refusal is accepted); at an exact step it is the unchanged loop's.

Window <= 2 (every window exact): the result must equal the unchanged loop's (1e-10 relative), and
the reference is checked against it too (a check of the oracle). Per-step loss values must equal the
unchanged loop's bit for bit. Outcomes: ``right``, ``right (exact fallback)``, ``refused`` (the
message names a step or a line; a refused optimizer step moved no parameter; the parameters are the
reference's at its refusal; the next clean trajectory after ``zero_grad`` is right); FAILED kinds
(``FuzzFailure``): ``silently-wrong``, ``torch-error`` (a torch/Python error where jaggc promises
a result or a refusal), ``unexpected-refusal``, ``wrong-values``.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections import Counter
from dataclasses import replace

import torch

import jaggc
from step_fuzz_grammar import (BACKWARDS, DECLARES, DISRUPTIONS, DITS, LOOP_KINDS, ORDERS, PLACEMENTS,  # noqa: F401
                               TERMS, WEIGHTS, Disruption, Program, describe, do_backward, execute, make_model,
                               programs, positions, trainable)

TOL = 1e-10
STATS: Counter = Counter()


class FuzzFailure(AssertionError):
    def __init__(self, kind: str, text: str):
        super().__init__(f"{kind}: {text}")
        self.kind = kind


class Expected(Exception):
    """The reference's verdict: jaggc must refuse here."""


# --- the drivers ----------------------------------------------------------------------------------
class Plain:
    """The unchanged loop."""

    def __init__(self, p: Program):
        self.p, self.warned = p, False

    def install(self, model):
        pass

    def loop(self, iterate, declared_times):
        return iter(iterate)

    def declare(self, declared, declared_times, rows):
        pass

    def call(self, j, fn):
        return fn()[0]

    def backward(self, j, loss, form, scaler, params, side):
        do_backward(loss, form, scaler, params, side)

    def loop_ended(self, raised):
        pass

    def event(self, kind):
        pass

    def close(self):
        pass


class Jaggc(Plain):
    def install(self, model):
        p = self.p
        kw = dict(window=p.window, backward=p.backward, cfg_slice=p.cfg_slice, rollout_cache=p.rollout_cache)
        if p.weights != "default":
            kw["weights"] = p.weights
        self.jagg = jaggc.stepwise(model, **kw)

    def loop(self, iterate, declared_times):
        return self.jagg.steps(iterate, declared_times) if self.p.declare == "steps" else iter(iterate)

    def declare(self, declared, declared_times, rows):
        if self.p.declare == "trajectory":
            self.jagg.trajectory(declared_times)

    def close(self):
        self.jagg.close()


class RefWindow:
    def __init__(self, steps, exact):
        self.steps, self.exact = steps, exact
        self.visited, self.outs, self.rows, self.stored, self.done = set(), {}, {}, {}, False

    @property
    def open(self):
        return not self.exact and not self.done and bool(self.visited)


class Reference(Plain):
    """JAGG by hand (module docstring); ``fallback``: a refusal of a write becomes an exact fallback."""

    def __init__(self, p: Program, fallback: bool = False, optional: bool = True):
        super().__init__(p)
        self.fallback, self.optional, self.windows, self.window_of = fallback, optional, None, {}
        self.due_grad = self.due_param = None     # a refusal due where jaggc looks next (``_check_due``)
        self.plans = 0                            # trajectories declared: the CFG slice is learned from the last

    def _plan(self, declared, rows_of):
        p, self.window_of = self.p, {}
        self.plans += 1
        scale = 1000.0 if p.dit == "sd3" else 1.0
        order = sorted(declared, key=lambda k: -float(rows_of[k].max()))
        self.windows = []
        for lo in range(0, len(order), p.window):
            steps = order[lo:lo + p.window]
            low = any(bool((rows_of[k] / scale < 0.5).any()) for k in steps)
            w = RefWindow(steps, len(steps) <= 2 or (p.weights == "default" and low))
            self.windows.append(w)
            for k in steps:
                self.window_of[k] = w

    def loop(self, iterate, declared_times):
        if self.p.declare == "steps":
            self._plan(*self._pending)
        return iter(iterate)

    def declare(self, declared, declared_times, rows):
        if self.p.declare == "trajectory":
            self._end(None)
            self._plan(declared, rows)
        else:
            self._pending = (declared, rows)

    def call(self, j, fn):
        if torch.is_grad_enabled():
            self._check_due()
        out, t = fn()
        if self.windows is not None and torch.is_grad_enabled():
            w = self.window_of[j]
            w.visited.add(j)
            w.outs[j], w.rows[j] = out, t
        return out

    def backward(self, j, loss, form, scaler, params, side):
        w = self.window_of[j] if self.windows is not None else None
        if form != "plain" and self.optional and self.p.cfg_slice and self.p.cfg and self.plans > 1 and w is not None:
            # the CFG slice runs exact steps through jaggc's node too (docs/stepwise.md): the
            # per-step forms may be refused there; a result must then be the unchanged loop's
            raise Expected(f"optional: {form} at step {j} under the CFG slice")
        if w is None or w.exact:
            return do_backward(loss, form, scaler, params, side)
        if form != "plain":
            raise Expected(f"{form} at step {j} of a JAGG window")
        loss = scaler.scale(loss) if scaler is not None else loss
        w.stored[j] = torch.autograd.grad(loss, w.outs[j])[0]
        if all(k in w.stored for k in w.steps):
            self._land_jagg(w)

    def _land_jagg(self, w):
        a, b, S = w.steps[0], w.steps[-1], len(w.steps)
        ga, gb = torch.zeros_like(w.stored[a]), torch.zeros_like(w.stored[b])
        ta, tb = w.rows[a].double(), w.rows[b].double()
        for s, k in enumerate(w.steps):
            g = w.stored[k]
            alpha = torch.tensor(s / (S - 1), dtype=torch.float64) if self.p.weights == "index" else (w.rows[k] - ta) / (tb - ta)
            alpha = alpha.to(g.dtype).reshape(-1, *([1] * (g.ndim - 1)))
            ga, gb = ga + (1 - alpha) * g, gb + alpha * g
        torch.autograd.backward([w.outs[a], w.outs[b]], [ga, gb])
        w.done, w.outs, w.stored = True, {}, {}

    def _land_exactly(self, w):
        for k, g in w.stored.items():
            torch.autograd.backward(w.outs[k], g)
        w.exact, w.stored = True, {}
        self.warned = True

    def _open(self):
        return [w for w in self.windows if w.open] if self.windows is not None else []

    def _held(self) -> bool:
        """Some step's gradient is held back: it ran its backward, its window has not landed."""
        return any(w.stored for w in self._open())

    def event(self, kind):
        opened = self._open()
        if kind == "zero_grad":
            # the loop drops what the held-back steps gave; their windows run exactly; a write before
            # it (a clip) is moot now
            self.due_grad = None
            if self._held():
                for w in opened:
                    w.stored, w.exact = {}, True
                self.warned = True
            return
        if kind == "optimizer step":          # refused in the optimizer's pre-hook, before it moves anything
            self._check_due()
            if self._held():
                if not self.fallback:
                    raise Expected("optimizer step while a step's gradient is held back")
                for w in opened:
                    self._land_exactly(w)
            return
        if not opened or (kind != "parameter write" and not self._held()):
            return                            # .grad is the unchanged loop's: a read or write of it is the loop's
        if self.fallback:
            for w in opened:
                self._land_exactly(w)
        elif kind == "parameter write":
            self.due_param = kind
        else:
            self.due_grad = kind

    def _check_due(self, at_end: bool = False) -> None:
        """jaggc sees a write into .grad or a parameter where it looks next (before a step, at the
        trajectory's end, before an optimizer step), not when it happens: the refusal is due there, if
        a step's gradient is still held back (a parameter: before a step, while a window is open)."""
        grad, param, self.due_grad, self.due_param = self.due_grad, self.due_param, None, None
        if grad and self._held():
            raise Expected(f"{grad} while a step's gradient is held back")
        if param and (self._held() if at_end else self._open()):
            raise Expected(f"{param} while JAGG windows are open")

    def _end(self, raised):
        # a visited step whose backward never came adds nothing, as in the loop; the rest land exactly
        self._check_due(at_end=True)
        for w in self._open():
            self._land_exactly(w)
        self.windows = None

    def loop_ended(self, raised):
        if self.p.declare == "steps":
            self._end(raised)

    def close(self):
        self._end(None)


# --- one case: the three runs and the verdict --------------------------------------------------------
def flat(model, side) -> torch.Tensor:
    it = iter(side)
    parts = []
    for q in model.parameters():
        g = q.grad if q.grad is not None else torch.zeros_like(q)
        parts.append((g + next(it) if q.requires_grad else g).reshape(-1))
    return torch.cat(parts).double()


def params_of(model) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()]).double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (‖a − b‖ where b is zero: a clip to 1e-6 leaves tiny gradients, compared relatively)."""
    den = float(b.norm())
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def close_quietly(drv) -> None:
    """Close a driver's ``Stepwise`` (its optimizer pre-hook is global while it lives)."""
    jagg = getattr(drv, "jagg", None)
    if jagg is not None:
        try:
            jagg.close()
        except Exception:    # noqa: BLE001 - a deferred refusal, already judged
            pass


def run(p: Program, drv: Plain, base, keep: bool = False) -> dict:
    """One run of ``p`` from a copy of ``base``: its outcome (``done``, ``refused`` with the error,
    ``expected`` with the reference's reason, ``error``), gradient, parameters, values, warnings."""
    model = copy.deepcopy(base)
    log: dict = {}
    res = dict(model=model, log=log, drv=drv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            side = execute(p, drv, model, log)
            res.update(kind="done", grad=flat(model, side))
        except Expected as e:
            res.update(kind="expected", why=str(e))
        except jaggc.JaggError as e:
            res.update(kind="refused", error=e)
        except Exception as e:      # noqa: BLE001 - a torch or Python error is an outcome here
            res.update(kind="error", error=e)
        if not (keep and res["kind"] == "refused"):
            close_quietly(drv)
    res["params"] = params_of(model)
    res["jaggc_warned"] = any(str(w.message).startswith("jaggc") for w in caught)
    return res


def _text(p: Program, extra: str) -> str:
    return f"{extra}\n  program: {p!r}"


def _same(x: torch.Tensor, y: torch.Tensor, loose: bool) -> bool:
    return torch.equal(x, y) or (loose and float((x - y).abs()) <= 1e-12 * max(float(y.abs()), 1.0))


def _values_match(p: Program, ours: dict, plain: dict, expected: dict | None) -> str | None:
    """None if every per-step value before the first parameter change is the unchanged loop's bit for
    bit (the CFG slice: to 1e-12, its rows may round differently) and the later ones (the parameters
    moved by JAGG gradients) the expected run's to 1e-9; else what differs."""
    a, b = ours["log"]["values"], plain["log"]["values"]
    n0 = min(ours["log"].get("moved_at", len(a)), len(a))
    bad = [k for k, (x, y) in enumerate(zip(a[:n0], b[:n0])) if not _same(x, y, p.cfg_slice)]
    if len(b) < n0 or bad:
        return f"value {bad[:1]} differs from the unchanged loop's by {float(a[bad[0]] - b[bad[0]]):.3g}" if bad \
            else "more values than the unchanged loop"
    later = (expected or plain)["log"]["values"]
    n = min(len(a), len(later))
    if n > n0 and rel(torch.stack(a[n0:n]), torch.stack(later[n0:n])) > 1e-9:
        return "a value after the first parameter change differs from the expected run's"
    return None


def run_case(p: Program) -> str:
    """Run ``p`` unchanged, with jaggc and through the reference; the outcome, or ``FuzzFailure``."""
    try:
        outcome = _run_case(p)
    except FuzzFailure as f:
        STATS[f"FAILED {f.kind}"] += 1
        raise
    STATS[outcome] += 1
    return outcome


def _run_case(p: Program) -> str:
    base = make_model(p)
    plain = run(p, Plain(p), base)
    if plain["kind"] != "done":      # torch refuses the program itself (a GradScaler step with no .grad)
        return "invalid (the unchanged loop raises)"
    if not bool(torch.isfinite(plain["grad"]).all()):     # its own GradScaler overflowed: nothing to compare
        return "invalid (the unchanged loop's gradient is not finite)"
    ref = run(p, Reference(p), base)
    if ref["kind"] == "error":
        raise FuzzFailure("fuzzer", _text(p, f"the reference failed: {ref['error']!r}"))
    all_exact = p.window <= 2
    strict = ref if ref["kind"] == "done" or not all_exact else run(p, Reference(p, optional=False), base)
    if all_exact and (strict["kind"] != "done" or rel(strict["grad"], plain["grad"]) > TOL):
        raise FuzzFailure("fuzzer", _text(p, "the reference differs from the unchanged loop at window <= 2"))
    ours = run(p, Jaggc(p), base, keep=True)
    if p.window == 1 and ours["kind"] == "refused" and "window=1" in str(ours["error"]) and not ours["log"]["values"]:
        return "declined (window=1)"      # jaggc.stepwise(window=1) is refused at install: windows are >= 2
    moved = ours["log"].get("moved_at", len(ours["log"]["values"]))
    early = _values_match(p, dict(log=dict(values=ours["log"]["values"][:moved])), plain, None)
    if early:
        raise FuzzFailure("wrong-values", _text(p, early))
    if ours["kind"] == "error":
        raise FuzzFailure("torch-error", _text(p, f"{type(ours['error']).__name__}: {ours['error']}"[:600]
                                               + f" (reference: {ref.get('why', 'a result')})"))
    if ours["kind"] == "refused":
        if ref["kind"] != "expected":
            raise FuzzFailure("unexpected-refusal", _text(p, str(ours["error"])[:600]))
        try:
            return _check_refusal(p, ours, ref, base)
        finally:
            close_quietly(ours["drv"])
    # jaggc gave a result
    if ref["kind"] == "expected" and ref["why"].startswith("optional"):
        ref = run(p, Reference(p, optional=False), base)
    if ref["kind"] == "done":
        expected = plain if all_exact else ref
        err = rel(ours["grad"], expected["grad"])
        if err > TOL or rel(ours["params"], expected["params"]) > TOL:
            raise FuzzFailure("silently-wrong", _text(p, f".grad rel. error {err:.3g} against the "
                                                         f"{'unchanged loop' if all_exact else 'reference JAGG'}"
                                                         f" (vs unchanged: {rel(ours['grad'], plain['grad']):.3g}), "
                                                         f"parameters {rel(ours['params'], expected['params']):.3g}"))
        later = _values_match(p, ours, plain, expected)
        if later:
            raise FuzzFailure("wrong-values", _text(p, later))
        return "right"
    fallback = run(p, Reference(p, fallback=True, optional=False), base)
    if fallback["kind"] == "done" and ours["jaggc_warned"] and rel(ours["grad"], fallback["grad"]) <= TOL \
            and rel(ours["params"], fallback["params"]) <= TOL:
        return "right (exact fallback)"
    err = rel(ours["grad"], fallback["grad"]) if fallback["kind"] == "done" else float("nan")
    raise FuzzFailure("silently-wrong", _text(p, f"no refusal where one is due ({ref['why']}); .grad rel. error "
                                                 f"{err:.3g} against the exact fallback, jaggc warned: "
                                                 f"{ours['jaggc_warned']}"))


def _check_refusal(p: Program, ours: dict, ref: dict, base) -> str:
    message = str(ours["error"])
    if not re.search(r"step|\.py:\d+", message):
        raise FuzzFailure("refusal-text", _text(p, f"the refusal names no step or line: {message[:300]}"))
    if ours["log"].get("moved_by_refused_step"):
        raise FuzzFailure("silently-wrong", _text(p, "a refused optimizer step moved the parameters"))
    if rel(ours["params"], ref["params"]) > TOL:
        raise FuzzFailure("silently-wrong", _text(p, "the parameters at the refusal are not the reference's"))
    # the next clean trajectory, after optimizer.zero_grad(), is right
    model = ours["model"]
    for q in model.parameters():
        q.grad = None
    clean = replace(p, trajectories=1, disruptions=(), order="sigma", accumulate=1, declare="steps", scaler=False)
    start = copy.deepcopy(model)
    expected = run(clean, Plain(clean) if clean.window <= 2 else Reference(clean), start)
    plain = run(clean, Plain(clean), start)
    log: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            grad = flat(model, execute(clean, Jaggc(clean), model, log))
        except Exception as e:    # noqa: BLE001
            raise FuzzFailure("after-refusal", _text(p, f"the next clean trajectory raised {e!r}"[:600])) from None
    if _values_match(clean, dict(log=log), plain, expected) or rel(grad, expected["grad"]) > TOL:
        raise FuzzFailure("after-refusal", _text(p, f"the next clean trajectory is wrong "
                                                    f"(rel. error {rel(grad, expected['grad']):.3g})"))
    return "refused"
