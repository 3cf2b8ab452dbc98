"""A ``Stepwise``'s settings: their checks (``checked_settings``, ``checked_options``), the engine it
supports (``supported_engine``), the rollout cache it builds (``build_rollout_cache``), and the comparison
``jaggc.stepwise(module, ...)`` makes with the settings of one already installed (``same_settings``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..backward_modes import BackwardMode, backward_mode, modes_where
from ..errors import JaggInputError, JaggUnsupportedError
from ..options import Options
from ..runtime.engines import (Engine, engine_of, refuse_bare_zero_module, refuse_unsupported_engine,
                               refuse_zero3_stepwise)
from ..runtime.guard import Guard
from ..runtime.rollout_cache import RolloutCache
from ..runtime.weights import DEFAULT_WEIGHTS, resolve_basis
from ..runtime.window import check_window_size

#: the backward= forms of a stepwise loop (backward_modes.SUPPORT, its ``stepwise`` column)
STEPWISE_MODES: tuple[BackwardMode, ...] = modes_where("stepwise")


def checked_settings(window: int, weights, backward: str, guard):
    """``Stepwise(...)``'s window, weights and backward form checked: (the basis, the backward mode)."""
    check_window_size(window)
    if backward not in STEPWISE_MODES:
        raise JaggInputError(f"stepwise(backward={backward!r}): use one of {tuple(m.value for m in STEPWISE_MODES)}")
    basis = resolve_basis(weights)
    if basis.kind in ("randomized", "control"):
        raise JaggUnsupportedError(
            f"stepwise(weights=Basis({basis.kind!r})) draws a window's knots when the window runs, but a "
            f"per-step loop must know them at the window's first step; use a deterministic basis (weights='t', "
            f"the default) or jagg_compile on a whole-trajectory loss")
    if guard is not None and not isinstance(guard, Guard):
        raise JaggInputError(f"stepwise(guard={type(guard).__name__}): pass a jaggc.Guard(every=..., on_drift=...)")
    return basis, backward_mode(backward)


def with_defaults(given: dict) -> dict:
    """``jaggc.stepwise``'s settings (None: not given) with the defaults filled in."""
    return dict(window=4 if given["window"] is None else given["window"],
                weights=DEFAULT_WEIGHTS if given["weights"] is None else given["weights"],
                backward="joint" if given["backward"] is None else given["backward"], options=given["options"],
                cfg_slice=bool(given["cfg_slice"]),
                rollout_cache=False if given["rollout_cache"] is None else given["rollout_cache"],
                guard=given["guard"])


def same_settings(existing, module: nn.Module, given: dict) -> None:
    """``jaggc.stepwise(module, **given)`` on a module that has ``existing`` installed: refused unless
    every setting given (None: not given) is ``existing``'s."""
    settings = with_defaults(given)
    mine = dict(window=existing.window, weights=existing.basis, backward=existing.backward, options=existing.options,
                cfg_slice=existing.cfg_slice, rollout_cache=existing.rollout_cache, guard=existing.guard)
    asked = dict(settings, weights=resolve_basis(settings["weights"]), options=checked_options(given["options"]))
    if mine != asked:
        differ = sorted(k for k in mine if mine[k] != asked[k])
        raise JaggInputError(f"{type(module).__name__} already has a jaggc.stepwise with other settings ({differ}: "
                             f"{', '.join(f'{k}={mine[k]!r}' for k in differ)}); call jaggc.stepwise(module) to get it, "
                             f"or close() it first")


#: the rollout cache's bound with ``rollout_cache=True``
DEFAULT_CACHE_BYTES = 2 * 2**30
#: off-policy serving's defaults, from ``python -m jaggc_studies.digits.first_order_fidelity`` (digits
#: base, attention trained, Flow-GRPO's PPO loss, clip 1e-2, AdamW lr 3e-4, W=4, 3 seeds): in windows
#: that stay above σ = 0.5 the upstream gradients at served outputs have cosine >= 0.9999 to those at the
#: true outputs after 8 optimizer steps; a window reaching σ 0.50-0.26 served gave 0.88-0.9999 after one
#: step and 0.41-0.50 after 8 (the PPO clip decides otherwise for many samples there). So: at most 8
#: steps, and no window below σ = 0.5 (the σ-aware placement's threshold: those run exactly by default)
DEFAULT_MAX_OPTIMIZER_STEPS = 8
DEFAULT_MIN_SIGMA = 0.5
#: the guard's bound on a probe's served outputs' relative error |served − true| / |true| (steps/
#: served_probe.py) above which ``Guard(on_drift="adapt")`` stops serving. On the digits base (the study
#: above, 3 seeds) that error is 0.016 / 0.030 / 0.052 / 0.077 (median; max 0.105) after 1 / 2 / 4 / 8 steps
#: while every step's upstream-gradient cosine stays >= 0.9999, and 0.016 / 0.030 / 0.047 / 0.071 (max 0.109)
#: with ``--weights t --min-sigma 0``, where the lowest step's falls to 0.81 / 0.34 / 0.26 / 0.04: it
#: measures the formula, not the training signal, which
#: ``min_sigma`` protects. So the bound catches the formula failing grossly: over twice the largest seen
DEFAULT_MAX_SERVED_ERROR = 0.25


@dataclass(frozen=True)
class FirstOrder:
    """``stepwise(rollout_cache=FirstOrder(...))``: the rollout cache, and after optimizer steps since the
    recording an interior step's output served as the recorded one plus its window's knots' change
    (runtime/first_order.py) while at most ``max_optimizer_steps`` steps, and nothing else, changed the
    parameters, in windows whose lowest noise level is at least ``min_sigma`` (0: every window);
    ``rollout_cache="first_order"`` is ``FirstOrder()``. With a guard, each probed trajectory measures the
    served outputs' relative error (steps/served_probe.py); above ``max_served_error`` the guard's
    ``on_drift="adapt"`` / ``"exact"`` stops serving, ``"warn"`` warns."""

    max_optimizer_steps: int = DEFAULT_MAX_OPTIMIZER_STEPS
    max_bytes: int = DEFAULT_CACHE_BYTES
    min_sigma: float = DEFAULT_MIN_SIGMA
    max_served_error: float = DEFAULT_MAX_SERVED_ERROR


def build_rollout_cache(module: nn.Module, setting, options: Options, engine=None) -> RolloutCache | None:
    """The rollout cache of ``stepwise(rollout_cache=setting)`` (None: off); ``engine``: the stepwise's engine
    entry (runtime/engines.py: DeepSpeed's is not reachable from ``engine.module``)."""
    if setting is False or setting is None:
        return None
    first_order = None
    if setting == "first_order":
        first_order = FirstOrder()
    elif isinstance(setting, FirstOrder):
        first_order = setting
    if first_order is not None:
        if not (isinstance(first_order.max_optimizer_steps, int) and first_order.max_optimizer_steps >= 1):
            raise JaggInputError(f"FirstOrder(max_optimizer_steps={first_order.max_optimizer_steps!r}): a positive int")
        if not (isinstance(first_order.min_sigma, (int, float)) and 0 <= first_order.min_sigma <= 1):
            raise JaggInputError(f"FirstOrder(min_sigma={first_order.min_sigma!r}): a noise level in [0, 1]")
        if not (isinstance(first_order.max_served_error, (int, float)) and first_order.max_served_error > 0):
            raise JaggInputError(f"FirstOrder(max_served_error={first_order.max_served_error!r}): a positive relative error")
        return RolloutCache(module, time_arg=options.time_arg, unbatched=tuple(options.unbatched),
                            max_bytes=first_order.max_bytes, first_order=True,
                            max_optimizer_steps=first_order.max_optimizer_steps,
                            min_sigma=float(first_order.min_sigma),
                            max_served_error=float(first_order.max_served_error), engine=engine)
    if setting is True:
        max_bytes = DEFAULT_CACHE_BYTES
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting > 0:
        max_bytes = setting
    else:
        raise JaggInputError(f"stepwise(rollout_cache={setting!r}): pass True (a {DEFAULT_CACHE_BYTES // 2**30} GiB "
                             f"bound), the bound in bytes (a positive int), or 'first_order' / "
                             f"jaggc.FirstOrder(max_optimizer_steps=...) to serve off-policy steps too")
    return RolloutCache(module, time_arg=options.time_arg, unbatched=tuple(options.unbatched), max_bytes=max_bytes,
                        engine=engine)


def supported_engine(module: nn.Module) -> Engine:
    """The engine of ``module``, refused where a stepwise cannot serve it (runtime/engines.py)."""
    refuse_bare_zero_module(module, "jaggc.stepwise")
    engine = engine_of(module)
    refuse_unsupported_engine(engine, "jaggc.stepwise")
    refuse_zero3_stepwise(engine, "jaggc.stepwise")
    return engine


def checked_options(options: Options | None) -> Options:
    """``options`` (None: the defaults), refused where it sets what a per-step loop does not use."""
    options = Options() if options is None else options
    unused = [name for name, default in (("rollout_cache", None), ("split_batches", True), ("backend", None),
                                         ("on_unsupported", "raise"), ("interior_chunk", None))
              if getattr(options, name) != default]
    if unused:
        instead = {"rollout_cache": "stepwise(rollout_cache=True) records the rollout itself",
                   "split_batches": "stepwise(cfg_slice=True) is the per-step form of the CFG split"}
        hints = "".join(f"; {instead[n]}" for n in unused if n in instead)
        raise JaggInputError(f"stepwise(options=...): {unused} do not apply to a per-step loop (each step is its "
                             f"own call); leave them at their defaults{hints}")
    return options


__all__ = ["DEFAULT_CACHE_BYTES", "STEPWISE_MODES", "checked_options", "build_rollout_cache", "checked_settings", "same_settings",
           "supported_engine", "with_defaults"]
