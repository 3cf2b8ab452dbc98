"""Translation validation of ``@jagg_compile`` on the user's own loss: ``check_loss``.

JAGG is exact, whatever the loss does with the velocities and wherever the states lie, when the
DiT's parameter-Jacobian does not depend on the state and is affine in the timestep (exactness condition E2, proved in verify/symbolic.py). So a
stand-in DiT with the user's call signature and output structure,

    v = c * z + a(theta) + t * b(theta)        (a, b nonlinear in their parameters),

turns the user's loss into an oracle: the compiled loss (any window, the user's options, the
capture path it takes) must give the undecorated loss's value and gradient to rounding. A wrong
rewrite, a dropped no-grad block, a reference call paired with a policy call, a misread timestep
or wrong knot weights shows up as an error far above rounding, and hypothesis shrinks the case.

The stand-in mirrors the user's DiT: the output structure and shapes recorded from one real run
(``return_dict`` tuples, ``.sample`` outputs), the same adapters if the DiT is a peft model (its
``disable_adapter()`` / ``set_adapter(...)`` change the output, so a reference call under them is a
different call), eval mode halving the output (so train/eval matter). The real DiT is checked too:
at W=2 (every step a knot) the compiled gradient must equal the exact one, and the loss value must
be unchanged.

Cases perturb the loss's inputs with their shapes kept: state-like tensors (3 or more dims) get
noise; tensors named like advantages get fresh values of both signs (both PPO-clip branches); named
like log-probs get noise (off-policy ratios); timesteps, sigmas and anything else stay as given, since
a scheduler lookup needs exact values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from hypothesis import strategies as st
from torch import nn

from .._compat import is_fake, tree_flatten, tree_map, tree_unflatten
from ..errors import JaggInputError
from ..runtime.calls import DitCall
from ..runtime.rollout_cache import RolloutCache
from .harness import rel_err, run_exact_property


# --------------------------------------------------------------------------- the stand-in DiT

def _state(args, kwargs) -> torch.Tensor:
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next(x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor))


class StandInDiT(nn.Module):
    """v = φ(inputs) + s·(a(θ) + t b(θ)) in the user's DiT's output structure (module docstring).

    φ is the real DiT's own output on the same inputs, without grad and per sample (memoised by a
    digest of each sample's inputs, so a sample gets the same φ in a batch of B or of 2B: the
    comparison is not blurred by batch roundoff). It is free of θ, so the Jacobian is that of
    a + t b: free of the state, affine in t (E2), while the velocities stay realistic, so the loss's
    ratios and clipping behave as on the real model. ``s`` is small against the velocities."""

    def __init__(self, real: nn.Module, time_arg, dtype: torch.dtype, size: int, scale: float):
        super().__init__()
        self.time_arg, self.scale = time_arg, scale     # a constant: any state dependence breaks E2
        # the real DiT's parameters must not be ours: held outside the module tree
        self.__dict__["real"] = real
        self.__dict__["phi"] = RolloutCache(real, time_arg=time_arg)
        self.real_dtype = next(real.parameters()).dtype
        g = torch.Generator().manual_seed(0)
        # Linear layers (so peft can put adapters on them) applied to a constant input
        self.lin_a = nn.Linear(1, size, dtype=dtype)
        self.lin_b = nn.Linear(1, size, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
        self.register_buffer("one", torch.ones(1, dtype=dtype))

    def _time(self, args, kwargs) -> torch.Tensor:
        if isinstance(self.time_arg, int):
            return torch.as_tensor(args[self.time_arg])
        t = kwargs.get(self.time_arg)
        return torch.as_tensor(t if t is not None else args[1])

    def _cast(self, tree):
        """Floating tensors in the real DiT's dtype."""
        cast = lambda x: x.to(self.real_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        return tuple(tree_map(cast, list(tree))) if isinstance(tree, tuple) else tree_map(cast, tree)

    def _phi(self, args, kwargs):
        """The real DiT's output on these inputs (in its dtype), per sample, without grad."""
        call = DitCall(self._cast(tuple(args)), self._cast(dict(kwargs)))
        out = self.phi.lookup(call)
        if out is None:
            with torch.no_grad(), self.phi.record(clear=False):
                for row in _rows(call):
                    row(self.real)
            out = self.phi.lookup(call)
        return out

    def forward(self, *args, **kwargs):
        z = _state(args, kwargs)
        batch = z.shape[0]
        if is_fake(z):    # a capture learning output shapes: the real DiT's on fake tensors
            return tree_map(lambda x: x.to(self.one.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                            else x, self.real(*self._cast(args), **self._cast(kwargs)))
        t = self._time(args, kwargs).to(self.one.dtype)
        t = t.reshape(-1) if t.numel() > 1 else t.reshape(1).expand(batch)
        if t.numel() != batch:     # a per-token timestep: its largest value (the generated tokens')
            t = t.reshape(batch, -1).amax(1)
        a = torch.tanh(self.lin_a(self.one))
        b = torch.sinh(self.lin_b(self.one))
        leaves, spec = tree_flatten(self._phi(args, kwargs))
        out, primary = [], True
        for leaf in leaves:
            if primary and isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                primary = False
                n = leaf[0].numel()
                theta = (a[:n] + t[:, None] * b[:n]).reshape(leaf.shape)
                v = leaf.to(self.one.dtype) + self.scale * theta
                out.append(v if self.training else 0.5 * v)
            else:
                out.append(leaf)
        return tree_unflatten(out, spec)


def _rows(call: DitCall) -> list[DitCall]:
    """The call cut into one call per sample (tensors whose leading dim is the batch are cut)."""
    batch = _state(call.args, call.kwargs).shape[0]

    def row(b):
        cut = lambda x: x[b:b + 1] if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == batch else x  # noqa: E731
        return DitCall(tuple(tree_map(cut, list(call.args))), tree_map(cut, dict(call.kwargs)))

    return [row(b) for b in range(batch)]


def stand_in_for(dit: nn.Module, size: int, scale: float, time_arg, dtype: torch.dtype) -> nn.Module:
    """The stand-in, wrapped in the same peft adapters as ``dit`` if it is a peft model."""
    core = StandInDiT(dit, time_arg, dtype, size, scale)
    config = getattr(dit, "peft_config", None)
    if not config:
        return core
    import peft

    names = list(config)
    lora = peft.LoraConfig(r=1, lora_alpha=1, target_modules=["lin_a", "lin_b"], init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(core, lora, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora)
    model.set_adapter(dit.active_adapter)
    return model.to(dtype)


# --------------------------------------------------------------------------- the check

@dataclass
class LossCheck:
    """The outcome of ``check_loss``; ``table()`` shows it."""

    passed: bool
    max_rel_err: float
    capture_path: str
    counterexample: str | None
    examples: int
    windows: tuple
    tolerance: float
    real_dit: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    def table(self) -> str:
        lines = [f"check_loss: {'PASSED' if self.passed else 'FAILED'} — {self.examples} cases, windows "
                 f"{list(self.windows)}, capture path {self.capture_path}, max rel. err {self.max_rel_err:.2e} "
                 f"(tolerance {self.tolerance:.0e}), {self.seconds:.1f} s"]
        for k, v in self.real_dit.items():
            lines.append(f"  real DiT, {k}: {v:.2e}")
        if self.counterexample:
            lines.append(f"  counterexample (shrunk): {self.counterexample}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _args(dit, batch) -> tuple:
    if isinstance(batch, tuple):
        if not any(a is dit for a in batch):
            raise ValueError("check_loss: when `batch` is the tuple of the loss's arguments it must hold the DiT")
        return batch
    return (dit, batch)


def _flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _value_and_grad(fn: Callable, args: tuple, model: nn.Module):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss = fn(*args)
    loss.backward()
    grad = _flat_grad(params).clone()
    for p in params:
        p.grad = None
    return loss.detach(), grad


def _perturbed(value, gen: torch.Generator, flip: bool, dtype, path: str = ""):
    """A case's inputs (module docstring): same shapes, fresh states / advantages / log-probs."""
    if isinstance(value, dict):
        return {k: _perturbed(v, gen, flip, dtype, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        return type(value)(_perturbed(v, gen, flip, dtype, path) for v in value)
    if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return value
    x = value.detach().to(dtype)
    name = path.lower()
    if "adv" in name:
        fresh = torch.randn(x.shape, generator=gen, dtype=dtype)
        return -fresh.abs() if flip else fresh
    if "log_prob" in name or "logprob" in name:
        return x + 0.05 * torch.randn(x.shape, generator=gen, dtype=dtype)
    if x.ndim >= 3 and not any(k in name for k in ("time", "sigma", "step")):
        return x + 0.3 * torch.randn(x.shape, generator=gen, dtype=dtype)
    return x


def check_loss(loss_fn: Callable, dit: nn.Module, batch, *, windows=(2, 3, 4), examples: int = 25,
               dtype: torch.dtype = torch.float64, tolerance: float | None = None, seed: int = 0,
               **compile_options) -> LossCheck:
    """Does ``@jagg_compile(loss_fn, **compile_options)`` compute ``loss_fn``? (module docstring)

    ``batch``: the loss's second argument (``loss_fn(dit, batch)``), or the tuple of all its
    arguments, the DiT among them. ``tolerance``: default 1e-8 in float64, 1e-4 otherwise (a loss
    that computes in float32 internally, ``.float()``, needs about 1e-5 in float64)."""
    from ..api import jagg_compile

    owned = sorted({"dit", "window"} & set(compile_options))
    if owned:
        raise JaggInputError(
            f"check_loss: compile option(s) {owned} are check_loss's own (it compiles the loss with its stand-in "
            f"DiT at each window of windows={tuple(windows)}); drop them from the compile options and pass "
            f"windows=(...) instead of window=")
    start = time.perf_counter()
    tolerance = tolerance if tolerance is not None else (1e-8 if dtype == torch.float64 else 1e-4)
    args = _args(dit, batch)
    notes: list[str] = []
    sizes: list[int] = []
    magnitudes: list[float] = []

    def output_size(module, a, kw, output):
        leaf = next(x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.is_floating_point())
        sizes.append(leaf[0].numel())
        magnitudes.append(float(leaf.abs().mean()))

    handle = dit.register_forward_hook(output_size, with_kwargs=True)
    try:
        with torch.no_grad():
            loss_fn(*args)
    finally:
        handle.remove()
    real = _real_dit_checks(loss_fn, dit, args, compile_options)
    # θ's part of the velocity: a few percent of the real one's, so ratios stay near the real loss's
    scale = 0.05 * sum(magnitudes) / len(magnitudes)
    stand_in = stand_in_for(dit, max(sizes), scale, compile_options.get("time_arg") or "timestep", dtype)
    compiled = {w: jagg_compile(loss_fn, dit=stand_in, window=w, **compile_options) for w in windows}
    paths: set[str] = set()

    def case_args(case) -> tuple:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + case["perturbation"])
        swap = {id(dit): stand_in}
        return tuple(swap.get(id(a), _perturbed(a, gen, case["negative_advantages"], dtype)) for a in args)

    with_gradient = [0]

    def check(case, _seed) -> float:
        inputs = case_args(case)
        want_loss, want = _value_and_grad(loss_fn, inputs, stand_in)
        with_gradient[0] += bool(want.norm() > 0)
        fn = compiled[case["window"]]
        got_loss, got = _value_and_grad(fn, inputs, stand_in)
        paths.add(fn.report.path)
        scale = max(float(want_loss.abs().max()), 1.0)
        return max(rel_err(got, want), float((got_loss - want_loss).abs().max()) / scale)

    strategy = st.fixed_dictionaries(dict(window=st.sampled_from(list(windows)),
                                          perturbation=st.integers(0, 2**16),
                                          negative_advantages=st.booleans()))
    result = run_exact_property("check_loss", strategy, check, examples, seed, tol=tolerance)
    passed = result.passed and all(v <= max(tolerance, 1e-4) for v in real.values())
    if with_gradient[0] == 0:
        passed = False
        notes.append("no case gave the stand-in's parameters any gradient (every ratio clipped?): the check "
                     "compared zeros and proves nothing")
    if not result.passed and result.counterexample and tolerance < 1e-5 and 1e-8 < result.max_rel_err < 1e-5:
        notes.append("errors at float32 rounding: the loss may compute in float32 internally (.float()); "
                     "pass tolerance=1e-5")
    return LossCheck(passed=passed, max_rel_err=result.max_rel_err, capture_path="/".join(sorted(paths)) or "-",
                     counterexample=result.counterexample, examples=result.examples, windows=tuple(windows),
                     tolerance=tolerance, real_dit=real, notes=notes, seconds=time.perf_counter() - start)


def _real_dit_checks(loss_fn, dit, args, compile_options) -> dict:
    """On the real DiT: W=2 against the exact gradient, and the loss value."""
    from ..api import jagg_compile

    want_loss, want = _value_and_grad(loss_fn, args, dit)
    options = {k: v for k, v in compile_options.items() if k not in ("window",)}
    got_loss, got = _value_and_grad(jagg_compile(loss_fn, dit=dit, window=2, **options), args, dit)
    scale = max(float(want_loss.abs().max()), 1.0)
    return {"W=2 gradient vs exact (rel.)": rel_err(got, want),
            "loss value vs undecorated (rel.)": float((got_loss - want_loss).abs().max()) / scale}


def assert_loss_exact(loss_fn: Callable, dit: nn.Module, batch, **kwargs) -> LossCheck:
    """``check_loss`` for the user's own tests: raises AssertionError with the table if it fails."""
    check = check_loss(loss_fn, dit, batch, **kwargs)
    if not check.passed:
        raise AssertionError(check.table())
    return check
