"""The frontend contract: what a capture path hands the passes, and what it needs of the loss.

A compiled loss (``api.JaggCompiled``) tries its frontends in order (``capture="auto"``: the
order of ``registry.py``, FX, Dynamo, then the intercept fallback). Each frontend implements
``Frontend``: ``run`` captures the loss (or reuses a capture whose cache key and guards still hold),
has the ``Session`` (``session.CompileSession``, never the user's object) rewrite it, and runs the
rewritten graph. A frontend that cannot record the loss raises ``JaggCaptureError``
(the next path is tried); ``JaggGraphError``/``JaggInputError`` are final.

The graph frontends (FX, Dynamo) produce a ``Captured``: a GraphModule in the canonical
``graph_ops.dit_call`` form plus the modes it is entered in. The intercept fallback makes no
graph; it runs the loss twice around a recording proxy (``intercept.py``) and reports from that.

The rules every frontend applies the same way live here once: how the loss's arguments are
bound (``bind_loss``), how a call through ``dit.forward(...)`` is refused
(``direct_forward_error``), and how a DiT call inside a checkpoint the loss wrote is refused
(``checkpoint_region_error``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from torch import fx, nn

from ..config import CompileConfig
from ..errors import JaggGraphError
from ..source import user_frame
from ..runtime.autocast import AUTOCAST_OFF, AutocastState


@dataclass(frozen=True)
class Captured:
    """A graph frontend's result: the captured loss in ``dit_call`` form, the grad mode and
    autocast state it is entered in (the passes place mode switches relative to them), and the
    guard over the Python values the capture read (None: it read none, or the frontend guards
    them itself, as Dynamo does)."""

    gm: fx.GraphModule
    entry_grad: bool = True
    entry_autocast: AutocastState = AUTOCAST_OFF
    guard: Any = None


class Session(Protocol):
    """What a frontend needs of the compiled loss it runs for (``session.CompileSession``)."""

    fn: Callable
    dit: nn.Module | None          # jagg_compile(dit=...), or None: the loss's module arguments
    config: CompileConfig          # window, the windows' options, routing
    traces: int                    # captures made so far (read-only: rewrite and intercept_report count them)
    capture_failures: list[str]    # why earlier capture paths were left (for refusals)
    failed_now: list[str]          # why this call's earlier paths were left, so far (for refusals)

    def candidates(self, args: tuple, kwargs: dict) -> list[nn.Module]:
        """The modules to keep opaque (the DiT, or every module argument)."""

    def rewrite(self, captured: Captured, frontend: str) -> tuple[fx.GraphModule, Any]:
        """Run the passes on a capture: the graph to run and its report."""

    def show(self, report: Any) -> None:
        """Make ``report`` the one ``.report`` returns (the graph that runs now)."""

    def empty_report(self, path: str, note: str) -> Any:
        """A report for a call that made no graph (nothing to rewrite)."""

    def intercept_report(self, loss: Any) -> Any:
        """The report of a call the intercept fallback ran (``intercept.InterceptedLoss``); counts a trace."""


class Frontend(Protocol):
    """A capture path (module docstring)."""

    name: str

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The loss's value, computed by the rewritten loss; its backward runs JAGG."""

    def reset(self) -> None:
        """Forget what was captured (``capture="auto"`` moves on to the next path)."""


def bind_loss(fn: Callable, args: tuple, kwargs: dict, *, defaults: bool = False) -> inspect.BoundArguments:
    """The loss's arguments by name (``defaults``: with the defaults a trace bakes in as well).
    Raises the ``TypeError`` the call itself would raise."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    if defaults:
        bound.apply_defaults()
    return bound


def direct_forward_error(where: str = "", module: nn.Module | None = None, node: str | None = None) -> JaggGraphError:
    """The one refusal of a DiT called through ``.forward(...)``: that skips the module's hooks
    (DDP/FSDP gradient sync, peft), and the rewritten loss would run ``dit(...)`` with them, so
    the compiled loss would not compute what the user wrote. ``where``: ``file:line`` or
    ``step k``; ``node``: the graph node of the call, where there is one."""
    what = f"the DiT ({type(module).__name__})" if module is not None else "the DiT"
    return JaggGraphError(
        f"{what} is called through `.forward(...)`"
        f"{f' (graph node {node})' if node else ''}; call the module itself, `dit(...)`, so that its hooks "
        f"(DDP/FSDP gradient sync, peft) run and jaggc can see the call", where=where)


def checkpoint_region_error(where: str = "", module: nn.Module | None = None, region: str = "") -> JaggGraphError:
    """The one refusal of a DiT call inside an activation checkpoint written in the loss
    (``torch.utils.checkpoint.checkpoint(call_dit, dit, z, t, ...)``, either ``use_reentrant``).
    jaggc runs the window's knot and interior forwards itself, outside that region, so the promise
    (activations recomputed, not stored) would silently not hold: the knots would keep every
    activation. With ``use_reentrant=True`` and stored (no-grad) states the DiT gets no gradient at
    all. Checkpointing inside the DiT is honoured by every window forward: that is the fix.
    ``where``: ``file:line``; ``region``: the graph node of the region, where there is one."""
    what = f"the DiT ({type(module).__name__})" if module is not None else "the DiT"
    return JaggGraphError(
        f"{what} is called inside {region or 'torch.utils.checkpoint.checkpoint'}, "
        f"e.g. torch.utils.checkpoint.checkpoint(dit, ...) or a torch.autograd.Function around the DiT call. "
        f"jaggc cannot rewrite a call hidden in such a region (its window forwards would run outside the "
        f"checkpoint and keep every activation), and use_reentrant=True checkpointing with stored (no-grad) "
        f"states gives the DiT no gradient at all. Call the DiT directly in the loss and checkpoint inside "
        f"it: dit.enable_gradient_checkpointing() (non-reentrant)", where=where or "unknown source line")


def checkpoint_region_caller(frame=None):
    """If a frame from ``frame`` (default: the caller's) outwards runs torch.utils.checkpoint's code
    (the non-reentrant ``checkpoint`` function, the reentrant ``CheckpointFunction``), the call being
    made is inside a checkpoint region the loss wrote: the user's frame that opened the outermost
    such region (its line is the one to name), or True if there is none; else None."""
    import torch.utils.checkpoint as checkpoint_module

    here = os.path.realpath(checkpoint_module.__file__)
    frame = inspect.currentframe().f_back if frame is None else frame
    outermost = None
    while frame is not None:
        if os.path.realpath(frame.f_code.co_filename) == here:
            outermost = frame
        frame = frame.f_back
    if outermost is None:
        return None
    return user_frame(outermost.f_back) or True


def refuse_checkpoint_region(module: nn.Module) -> None:
    """Raise ``checkpoint_region_error`` if this DiT call runs inside a checkpoint region the loss
    wrote (``checkpoint_region_caller``), naming the line that opened the region."""
    caller = checkpoint_region_caller(inspect.currentframe().f_back)
    if caller is not None:
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not True else ""
        raise checkpoint_region_error(where, module)


_MISSING = object()


@contextlib.contextmanager
def instance_slots(patches: Iterable[tuple[Any, str, Any]]):
    """Set ``obj.__dict__[name] = value`` for each patch for the duration, then restore what each
    slot held (or remove it). Instance slots shadow the class's methods (``forward``, the call
    slot, ``train``) for that one module object, so other instances and threads are untouched."""
    saved = []
    try:
        for obj, name, value in patches:
            saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
            obj.__dict__[name] = value
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old


__all__ = ["Captured", "Frontend", "Session", "bind_loss", "direct_forward_error", "instance_slots"]
