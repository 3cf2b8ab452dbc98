"""Dynamo: keeping the DiT opaque while it traces (``nonstrict_trace``, ``flat_apply`` nodes), the
fake mode it traces in, its errors and recompile limits, and its backend registry."""

from __future__ import annotations

import contextlib

import torch

from .pytree import tree_unflatten


# --- Dynamo: keeping the DiT opaque ---------------------------------------------------------
# torch 2.13's Dynamo always inlines nn.Modules. ``nonstrict_trace`` makes a function one opaque
# ``flat_apply`` node (args: a _LeafCallable, the input TreeSpec, then the flat inputs) whose
# output is the flat list of the function's output leaves.

def nonstrict_trace(fn):
    return torch._dynamo.nonstrict_trace(fn)


def compiler_disable(fn):
    """A function Dynamo does not trace into (a full-graph capture that reaches it fails)."""
    return torch.compiler.disable(fn)


def assume_constant_result(fn):
    """Dynamo calls ``fn`` while tracing and records its result as a constant (no guard)."""
    return torch._dynamo.assume_constant_result(fn)


def is_flat_apply_node(node) -> bool:
    target = node.target
    return node.op == "call_function" and getattr(target, "__name__", "").startswith("flat_apply")


def flat_apply_function(gm, node):
    """The Python function behind a flat_apply node (unwrapping Dynamo's patched_fn closure)."""
    import inspect

    callable_node = node.args[0]
    leaf_callable = getattr(gm, callable_node.target) if callable_node.op == "get_attr" else callable_node
    fn = getattr(leaf_callable, "_fn", leaf_callable)
    try:
        return inspect.getclosurevars(fn).nonlocals.get("fn", fn)
    except (TypeError, ValueError):
        return fn


def flat_apply_inputs(gm, node):
    """(args, kwargs) of a flat_apply node, with graph nodes as leaves."""
    spec_node = node.args[1]
    spec = getattr(gm, spec_node.target) if spec_node.op == "get_attr" else spec_node
    return tree_unflatten(list(node.args[2:]), spec)


def detect_fake_mode(tensors):
    """The FakeTensorMode of a trace's fake tensors (None if there are none)."""
    from torch._guards import detect_fake_mode as detect

    return detect(tensors)


@contextlib.contextmanager
def fake_mode_accepts_real_tensors():
    """Inside a fake mode, let real tensors (the DiT's parameters) mix with fake inputs, as
    ``nonstrict_trace`` does for the functions it runs."""
    from torch._subclasses.fake_tensor import fake_tensor_tls

    prior = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        yield
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = prior


def unwrap_backend_error(exc: BaseException) -> BaseException:
    """Dynamo wraps exceptions raised in a backend; return the one jaggc raised."""
    inner = getattr(exc, "inner_exception", None)
    return inner if inner is not None else exc


def dynamo_unsupported_types() -> tuple[type, ...]:
    import torch._dynamo.exc as exc

    return tuple(t for t in (getattr(exc, "Unsupported", None), getattr(exc, "UserError", None),
                             getattr(exc, "TorchRuntimeError", None)) if t is not None)


def recompile_limit_types() -> tuple[type, ...]:
    import torch._dynamo.exc as exc

    return tuple(t for t in (getattr(exc, "FailOnRecompileLimitHit", None),) if t is not None)


def dynamo_real_stack(exc: BaseException) -> list:
    """The user stack Dynamo recorded where it stopped (``real_stack``, outermost frame first;
    FrameSummary-like objects), [] if none. ``source.stack_location`` reads it."""
    return list(getattr(exc, "real_stack", None) or [])


@contextlib.contextmanager
def dynamo_recompile_limits(limit: int, *, accumulated: int):
    """Raise Dynamo's recompile limits for the duration: the verifier compiles one loss against a
    new field and new shapes per example, i.e. one more graph of the same code each time, and the
    default limit (8) would refuse the 9th example. Dynamo's config has no public setter."""
    with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=accumulated):
        yield


def lookup_dynamo_backend(name: str):
    """The compiler function registered as a ``torch.compile`` backend under ``name``: jaggc hands
    each glue segment of the rewritten graph to it itself (``backends.py``), with no Dynamo frame
    around, so ``torch.compile(backend=name)`` is not the right call."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def dynamo_unique_graphs() -> int:
    """How many distinct graphs Dynamo has compiled in this process (its own statistics counter,
    which ``jaggc bench`` reports next to jaggc's trace count when it looks for recompiles)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def backend_failed_type() -> type:
    import torch._dynamo.exc as exc

    return exc.BackendCompilerFailed


def recompile_reason(exc: BaseException) -> str:
    """The guard whose failure caused the last recompile, from Dynamo's message or its recorded
    guard failures, without Dynamo's frame prefix and source comment: ``steps[3] == 3``; "" if
    unknown."""
    import re

    text = str(exc)
    match = re.search(r"last reason:\s*(.+)", text)
    reason = match.group(1) if match else ""
    if not reason:
        try:
            from torch._dynamo.utils import guard_failures

            reasons = [r for failures in guard_failures.values() for r in failures]
            reason = str(reasons[-1]) if reasons else ""
        except Exception:  # noqa: BLE001 - a message helper must never fail
            return ""
    reason = reason.splitlines()[0].split("#")[0].strip() if reason else ""
    return re.sub(r"^\d+/\d+:\s*", "", reason)
