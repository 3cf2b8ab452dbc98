"""``jagg_compile``'s settings, grouped: the few a user picks per loss are keywords (``dit``,
``window``, ``weights``, ``backward``, ``capture``), the rest are ``Options``; which windows run
exactly at run time is ``Routing`` (runtime/routing.py).

The sixteen flat keywords of release 0.1 still work for one release, each with a
``DeprecationWarning`` naming its new place (``DEPRECATED``). ``apply_deprecated`` is the one place
that folds them into ``Options``/``Routing``, and ``Options.window_options`` the one that makes the
runtime's ``WindowOptions``; ``JaggCompiled`` (api.py) builds its ``CompileConfig`` (config.py) from
those two, for ``jagg_compile`` and ``explain`` alike, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import JaggInputError
from .frontends.registry import capture_choices
from .runtime.rollout_cache import RolloutCache
from .runtime.routing import Routing
from .runtime.window import WindowOptions

def __getattr__(name: str):
    # CAPTURES: the values of jagg_compile(capture=...), read from the frontend registry when asked
    # (a path registered later is one of them)
    if name == "CAPTURES":
        return capture_choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")



@dataclass(frozen=True)
class Options:
    """The less-used settings of ``jagg_compile``.

    ``time_arg``: which DiT argument is the timestep (name or position; default: found from the
    call). ``interior_chunk``: at most this many interior steps per no-grad forward (None: all at
    once). ``batch_knots=False``: each knot its own forward (lower peak, same FLOPs, per-step-shaped
    kernels). ``unbatched``: tensor inputs shared across the batch (Flux/Qwen-Image position ids).
    ``check_inputs``: refuse window inputs that require grad. ``rollout_cache``: the on-policy fast
    path (interior outputs recorded during the rollout). ``split_batches``: split a CFG call's
    detached chunks into no-grad reference calls. ``backend``: compile the glue of a Dynamo graph
    with this ``torch.compile`` backend. ``on_unsupported="exact"``: run a loss no path can take
    uncompiled (with a warning) instead of raising. ``check_passes``: run every graph pass's
    executable invariant (``ensures``) after it (slower compiles; the tests always do).
    """

    time_arg: str | int | None = None
    interior_chunk: int | None = None
    batch_knots: bool = True
    unbatched: tuple[str, ...] = ("img_ids", "txt_ids")
    check_inputs: bool = True
    rollout_cache: RolloutCache | None = field(default=None, compare=False)
    split_batches: bool = True
    backend: str | None = None
    on_unsupported: str = "raise"
    check_passes: bool = False

    def __post_init__(self):
        if self.on_unsupported not in ("raise", "exact"):
            raise JaggInputError(f"Options(on_unsupported={self.on_unsupported!r}): use 'raise' or 'exact'")

    def window_options(self, weights, backward: str, guard=None) -> WindowOptions:
        """The runtime's options for every window of the loss (``guard``: jagg_compile's Guard)."""
        return WindowOptions(weights=weights, time_arg=self.time_arg, interior_chunk=self.interior_chunk,
                             batch_knots=self.batch_knots, unbatched=tuple(self.unbatched),
                             check_inputs=self.check_inputs, backward=backward, rollout_cache=self.rollout_cache,
                             guard=guard)


# release-0.1 keyword -> (where it lives now, its field there)
DEPRECATED: dict[str, tuple[str, str]] = {
    **{name: ("options", name) for name in ("time_arg", "interior_chunk", "batch_knots", "check_inputs",
                                            "rollout_cache", "split_batches", "backend", "on_unsupported")},
    "jagg_frac": ("routing", "jagg_frac"),
    "jagg_threshold": ("routing", "threshold"),
    "exact_below_t": ("routing", "exact_below"),
}

# jagg_compile's own keywords (besides the loss): what explain() also accepts
KEYWORDS = ("dit", "window", "weights", "backward", "capture", "guard", "options", "routing")


def _exact_below_sigma(exact_below_t: float | None) -> float | None:
    """The release-0.1 ``exact_below_t`` (timestep units) as σ: t / 1000 for a 0..1000 schedule;
    a value <= 1 already is one (a DiT that takes σ, as Flux does)."""
    if exact_below_t is None:
        return None
    return float(exact_below_t) / 1000.0 if float(exact_below_t) > 1.0 else float(exact_below_t)


def apply_deprecated(options: Options | None, routing: Routing | None, old: dict[str, Any], *,
                     stacklevel: int = 4) -> tuple[Options, Routing]:
    """Fold release-0.1 keywords into ``options``/``routing``, warning once per keyword. Giving a
    setting both ways is refused (which one would win is not obvious)."""
    unknown = sorted(set(old) - set(DEPRECATED))
    if unknown:
        raise JaggInputError(f"jagg_compile got unknown option(s) {unknown}: remove them, or pass them as fields of "
                             f"jaggc.Options(...) or jaggc.Routing(...); its keywords are {list(KEYWORDS)}")
    options = Options() if options is None else options
    routing = Routing() if routing is None else routing
    if not isinstance(options, Options):
        raise JaggInputError(f"options={type(options).__name__}(...): pass jaggc.Options(...) (its fields: "
                             f"{[f.name for f in dataclasses.fields(Options)]})")
    if not isinstance(routing, Routing):
        raise JaggInputError(f"routing={type(routing).__name__}(...): pass jaggc.Routing(jagg_frac=..., "
                             f"threshold=..., exact_below=...)")
    moved = {"options": {}, "routing": {}}
    for name, value in old.items():
        where, field_name = DEPRECATED[name]
        if name == "exact_below_t":
            value = _exact_below_sigma(value)
        shown = f"{where}=jaggc.{'Options' if where == 'options' else 'Routing'}({field_name}=...)"
        note = " (in σ: exact_below_t / 1000)" if name == "exact_below_t" else ""
        warnings.warn(f"jagg_compile({name}=...) is deprecated: pass {shown}{note}", DeprecationWarning,
                      stacklevel=stacklevel)
        target = options if where == "options" else routing
        default = next(f.default for f in dataclasses.fields(type(target)) if f.name == field_name)
        if getattr(target, field_name) != default:
            raise JaggInputError(f"jagg_compile got {name}= and {where}.{field_name}: give it once, in {shown}")
        moved[where][field_name] = value
    if moved["options"]:
        options = dataclasses.replace(options, **moved["options"])
    if moved["routing"]:
        routing = dataclasses.replace(routing, **moved["routing"])
    return options, routing


__all__ = ["CAPTURES", "DEPRECATED", "KEYWORDS", "Options", "apply_deprecated"]
