"""The one place where jaggc touches private or unstable PyTorch APIs.

Everything here is marked backward-incompatible (or private) upstream; keeping it in one module
means a PyTorch upgrade that moves one of them costs one file.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as _pytree

TreeSpec = _pytree.TreeSpec
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_flatten_with_path = _pytree.tree_flatten_with_path
keystr = _pytree.keystr

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


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


def dynamo_reset():
    torch._dynamo.reset()


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


def dynamo_user_location(exc: BaseException) -> str:
    """Where Dynamo stopped, from its ``real_stack`` (outermost frame first): ``file:line`` of the
    loss's own line, followed by ``(in file:line)`` of the innermost frame when the break is
    inside a function it calls (a library, a helper); "" if unknown."""
    frames = [f for f in (getattr(exc, "real_stack", None) or [])
              if not any(part in str(getattr(f, "filename", "")).replace("\\", "/")
                         for part in ("/jaggc/", "/torch/"))]
    if not frames:
        return ""
    outer, inner = frames[0], frames[-1]
    where = f"{outer.filename}:{outer.lineno}"
    if (inner.filename, inner.lineno) != (outer.filename, outer.lineno):
        where += f" (in {inner.filename}:{inner.lineno})"
    return where


def dynamo_unique_graphs() -> int:
    """How many distinct graphs Dynamo has compiled in this process (its own statistics counter,
    which ``jaggc bench`` reports next to jaggc's trace count when it looks for recompiles)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def backend_failed_type() -> type:
    import torch._dynamo.exc as exc

    return exc.BackendCompilerFailed


# --- torch.fx: running real code in the middle of a symbolic trace ---------------------------

def fx_patches_reverted():
    """While torch.fx traces, ``nn.Module.__call__`` (and autowrapped functions) are patched to
    record nodes; code run to compute an example value must see the real ones."""
    return torch.fx._symbolic_trace._maybe_revert_all_patches()


# --- nn.Module internals -------------------------------------------------------------------

def module_hook_keys(module) -> tuple:
    """The handles of a module's own forward and forward-pre hooks (its private hook dicts),
    leaving out jaggc's own observers (marked ``_jaggc_observer``: pass counters, the rollout
    cache's recorder), which see a call without changing it."""
    hooks, pre = module._forward_hooks, module._forward_pre_hooks
    if not hooks and not pre:
        return ()
    keep = lambda d: tuple(k for k, fn in d.items() if not getattr(fn, "_jaggc_observer", False))  # noqa: E731
    keys = (keep(hooks), keep(pre))
    return keys if keys != ((), ()) else ()


# --- grad mode as a graph node ---------------------------------------------------------------
# Dynamo records ``with torch.no_grad()`` as calls of this function; the FX frontend and the
# grad-mode pass emit the same nodes so that one rule reads both.

SET_GRAD_ENABLED = torch._C._set_grad_enabled


def copy_input_codegen(src, dst) -> None:
    """Give fx.Graph ``dst`` the argument handling of ``src`` (FX's pytree codegen for
    ``concrete_args`` with containers), so both take the same call arguments; ``dst`` returns its
    output as it is."""

    from torch.fx.graph import _PyTreeCodeGen

    codegen = src._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None:
        codegen = _PyTreeCodeGen(codegen.pytree_info._replace(out_spec=None))
    dst.set_codegen(codegen)


def fake_mode_suspended():
    """Run real tensor code while a FakeTensorMode is active (the FX frontend's value reads)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


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


def dispatch_mode_base():
    """The base class of a Python dispatch mode (sees every aten op run on real tensors)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def is_fake(t) -> bool:
    """A fake tensor (a capture is learning shapes), not real data."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
