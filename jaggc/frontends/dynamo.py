"""Dynamo capture with the DiT kept opaque, canonicalised to ``dit_call`` nodes.

torch 2.13's Dynamo inlines every nn.Module. While a jaggc-compiled function runs, the DiT (and
every wrapper around it: DDP, PeftModel, ...) has its ``_compiled_call_impl`` (the slot
``nn.Module.compile`` uses, read by ``Module.__call__``) set to a ``nonstrict_trace``d function that
runs the module's normal call, hooks included; Dynamo records each call as one
opaque ``flat_apply`` node, and ``canonicalize_dynamo_calls`` turns that node into
``dit_call(dit, args, kwargs)`` followed by ``flatten_output`` (Dynamo expects the opaque call to
return its flat output leaves). A call with tensor/constant arguments and ``return_dict=False``
is recorded more cheaply, as one ``jaggc::opaque_dit`` custom-op node (``opaque_op.py``), which
``canonicalize_dynamo_calls`` turns into the same ``dit_call`` + ``flatten_output``. The patched
forward is created once per module and reinstalled for every call, so Dynamo's guards see the
same function and never recompile for it; outside a jaggc call the module is untouched.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Iterable

import torch
from torch import fx, nn

from .. import _compat
from .._compat import tree_flatten
from ..graph_ops import dit_call, flatten_output, user_source
from ..runtime.calls import DitCall
from ..runtime.checks import conform_placement
from ..runtime.module_state import module_chain
from . import opaque_op
from .contract import checkpoint_region_error, direct_forward_error, instance_slots
from .fake_cache import cached_fake_call

_OPAQUE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


# nonstrict_trace accepts only graphable leaves (tensors, numbers, str, ...), and None is a leaf
# that is not graphable; trainers pass ``joint_attention_kwargs=None``, ``guidance=None``. A top-level
# None argument travels through the opaque call as this string and is turned back into None on
# both sides (the fake-tensor run inside Dynamo, and the ``dit_call`` node). A None nested deeper
# still fails the capture (a JaggUnsupportedError, never a silent change).
_NONE = "<jaggc:None>"


def _encode_none(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # (Dynamo names graph nodes after these loop variables: keep them recognisable)
    return (tuple(_NONE if dit_arg is None else dit_arg for dit_arg in args),
            {key: (_NONE if dit_arg is None else dit_arg) for key, dit_arg in kwargs.items()})


def decode_none(args, kwargs) -> tuple[tuple, dict]:
    return (tuple(None if isinstance(a, str) and a == _NONE else a for a in args),
            {k: (None if isinstance(v, str) and v == _NONE else v) for k, v in kwargs.items()})


def _opaque_functions(module: nn.Module):
    """(call, forward, call_slot, forward_slot) for ``module``.

    ``call``/``forward`` are the ``nonstrict_trace``d opaque functions (what a flat_apply node
    names); ``call_slot``/``forward_slot`` are what is installed in ``module._compiled_call_impl``
    and ``module.forward``: plain functions Dynamo inlines, which encode None arguments and call
    the opaque ones. Dynamo reaches a module either through ``__call__`` (which reads
    ``_compiled_call_impl``, the path with hooks) or, when the module has no hooks, straight
    through ``forward``; both slots are patched so both paths end in one opaque node. At run time
    they call the real implementation.
    """
    fns = _OPAQUE.get(module)
    if fns is None:
        # everything here refers to the module weakly: these functions live in module-level
        # tables (weak-keyed by the module), and a strong reference from a table's value would
        # keep every module ever called through a compiled loss alive
        module_ref = weakref.ref(module)
        own_call = _weak_callable(module.__dict__.get(_compat.MODULE_CALL_SLOT))   # module.compile()
        own_forward = _weak_callable(module.__dict__.get("forward"))            # e.g. accelerate's wrapper

        def original_call(m: nn.Module):
            return (own_call and own_call()) or _compat.module_call_impl(m)

        def original_forward(m: nn.Module):
            return (own_forward and own_forward()) or type(m).forward.__get__(m)

        def jaggc_opaque_dit_call(*args, **kwargs):
            m = module_ref()
            args, kwargs = _for_fake_run(m, *decode_none(args, kwargs))
            if is_distributed(m) and _has_fake(args, kwargs):
                return real_run_as_fake(original_call(m), args, kwargs)
            return cached_fake_call(m, original_call(m), args, kwargs)

        def jaggc_opaque_dit_forward(*args, **kwargs):
            m = module_ref()
            args, kwargs = _for_fake_run(m, *decode_none(args, kwargs))
            return cached_fake_call(m, original_forward(m), args, kwargs)

        opaque_call = _compat.nonstrict_trace(jaggc_opaque_dit_call)
        opaque_forward = _compat.nonstrict_trace(jaggc_opaque_dit_forward)
        key = opaque_op.register_module(module, jaggc_opaque_dit_call, jaggc_opaque_dit_forward)

        def jaggc_dit_call_slot(*args, **kwargs):
            if opaque_op.takes_fast_path(args, kwargs):
                return opaque_op.fast_call(key, True, args, kwargs)
            args, kwargs = _encode_none(args, kwargs)
            return opaque_call(*args, **kwargs)

        def jaggc_dit_forward_slot(*args, **kwargs):
            if opaque_op.takes_fast_path(args, kwargs):
                return opaque_op.fast_call(key, False, args, kwargs)
            args, kwargs = _encode_none(args, kwargs)
            return opaque_forward(*args, **kwargs)

        fns = (opaque_call, opaque_forward, jaggc_dit_call_slot, jaggc_dit_forward_slot)
        _OPAQUE[module] = fns
    return fns


def _weak_callable(fn):
    """A weak reference to ``fn`` (a bound method's ``WeakMethod``), or None for None; a callable
    that cannot be weakly referenced is held strongly."""
    if fn is None:
        return None
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    try:
        return weakref.ref(fn)
    except TypeError:
        return lambda: fn


def _has_fake(args, kwargs) -> bool:
    return any(_compat.is_fake(x) for x in tree_flatten((args, kwargs))[0])


_DISTRIBUTED = ("DistributedDataParallel", "FullyShardedDataParallel")


def is_distributed(module: nn.Module) -> bool:
    """DDP, FSDP1, or a module FSDP2's ``fully_shard`` turned into an ``FSDPModule``."""
    return any(c.__name__ in _DISTRIBUTED + ("FSDPModule",) for c in type(module).__mro__)


def real_run_as_fake(call, args: tuple, kwargs: dict):
    """The fake-tensor run of a distributed wrapper, done for real.

    FSDP's (and DDP's) forward hooks keep state across calls and run collectives. Run on Dynamo's
    fake tensors, FSDP2's hooks record an unshard that never really happened: after an earlier
    backward, the next real forward skips the all-gather of the root's parameters (left
    "unsharded" by the fake run, their storage never written) and the compiled loss computed with
    garbage, NaN gradients included (tests/runtime/test_fsdp.py, compiled cases). So the traced call runs
    the wrapper for real, without grad, on zeros of the fake inputs' shapes (every rank traces
    the same calls, so the collectives pair up), and hands Dynamo fake copies of the real
    outputs. DDP is treated the same way (its forward hooks also talk to the other ranks).
    """
    leaves, spec = tree_flatten((args, kwargs))
    fake_mode = _compat.detect_fake_mode([x for x in leaves if _compat.is_fake(x)])
    grad = torch.is_grad_enabled()
    with _compat.fake_mode_suspended():
        real = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) if _compat.is_fake(x) else x
                for x in leaves]
        real_args, real_kwargs = _compat.tree_unflatten(real, spec)
        with torch.no_grad():
            out = call(*real_args, **real_kwargs)

    def fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        f = fake_mode.from_tensor(t)
        return f.requires_grad_(True) if grad and f.is_floating_point() else f

    return _compat.tree_map(fake, out)


def _for_fake_run(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """While Dynamo traces, the opaque call runs the DiT on fake tensors. A wrong device or dtype
    (a 'meta' state, float64 latents for a float32 DiT) would fail that run inside Dynamo, which
    reports it as an unrelated graph break. The fake run gets conforming inputs instead and
    ``find_dit_calls`` refuses the call from the captured graph, naming the step and source line
    (``check_placement`` on the recorded example values). Real (non-fake) calls are untouched."""
    leaves = tree_flatten((args, kwargs))[0]
    if not any(_compat.is_fake(x) for x in leaves):
        return args, kwargs
    call = conform_placement(module, DitCall(tuple(args), dict(kwargs)))
    return call.args, call.kwargs


def module_of_opaque(fn) -> nn.Module | None:
    for module, fns in _OPAQUE.items():
        if fn in fns[:2]:
            return module
    return None


_SLOTS = (_compat.MODULE_CALL_SLOT, "forward")


# Methods that change a module's state (module_state.py). Dynamo records such a change as a side
# effect it replays after the graph, so every DiT call in the graph would run in the state the
# loss was entered in: a reference call after ``dit.eval()`` would silently be the train-mode call.
# While Dynamo traces, these methods are ``torch.compiler.disable``d stand-ins, which a full-graph
# capture refuses; the FX frontend replays such changes instead.
_STATE_METHODS = ("train", "eval", "requires_grad_", "set_adapter", "disable_adapter", "enable_adapters",
                  "disable_adapters", "enable_adapter_layers", "disable_adapter_layers", "merge_adapter",
                  "unmerge_adapter", "register_forward_hook", "register_forward_pre_hook")
STATE_CHANGE_MARK = "jaggc_module_state_change"
_STATE_REFUSERS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _state_refusers(module: nn.Module) -> dict:
    found = _STATE_REFUSERS.get(module)
    if found is None:
        module_ref = weakref.ref(module)
        found = {}
        for name in _STATE_METHODS:
            if callable(getattr(type(module), name, None)):
                found[name] = _compat.compiler_disable(_state_change(module_ref, name))
        _STATE_REFUSERS[module] = found
    return found


def _state_change(module_ref, name: str):
    def jaggc_module_state_change(*args, **kwargs):     # named for the refusal message
        m = module_ref()
        return getattr(type(m), name)(m, *args, **kwargs)
    return jaggc_module_state_change


@contextlib.contextmanager
def opaque_modules(modules: Iterable[nn.Module]):
    """Install the opaque call slots and the state-change refusers on ``modules`` (and their
    wrapped modules) for the duration."""
    patches = []
    seen = set()
    for top in modules:
        for m in module_chain(top):
            if id(m) in seen:
                continue
            seen.add(id(m))
            slots = list(zip(_SLOTS, _opaque_functions(m)[2:])) + list(_state_refusers(m).items())
            patches += [(m, slot, fn) for slot, fn in slots]
    with instance_slots(patches):
        yield


def check_called_as_module(node: fx.Node, module: nn.Module, fn) -> None:
    """Refuse a DiT reached through ``module.forward(...)`` rather than ``module(...)``.

    ``dit.forward(...)`` skips the module's hooks (DDP/FSDP gradient sync, peft), and the rewritten
    graph would run ``dit(...)`` with its hooks: the compiled loss would not compute what the user
    wrote. Dynamo records a call through ``Module.__call__`` in ``nn_module_stack`` under the key
    ``str(id(module))`` (``"<id>@<n>"`` for later calls); a direct ``.forward`` call has no entry
    for the module. The ``_compiled_call_impl`` stand-in is only reachable through ``__call__``.
    """
    call_fn = _opaque_functions(module)[0]
    if fn is call_fn:
        return
    stack = node.meta.get("nn_module_stack") or {}
    if any(str(key).split("@")[0] == str(id(module)) for key in stack):
        return
    raise direct_forward_error(user_source(node) or "unknown source line", module, node.name)


def canonicalize_dynamo_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each opaque DiT ``flat_apply`` node with ``dit_call`` + ``flatten_output``.

    Invariant after: no flat_apply node of a jaggc-opaque module remains; every DiT call is a
    ``dit_call`` node whose first argument is a ``get_attr`` of the called module.
    """
    check_no_dit_in_subgraphs(gm)
    graph = gm.graph
    names: dict[int, str] = {}
    for node in list(graph.nodes):
        if opaque_op.is_opaque_op_node(node):
            module, args, kwargs, via_call = opaque_op.call_of(node)
            if not via_call:
                check_called_as_module(node, module, None)
        elif _compat.is_flat_apply_node(node):
            fn = _compat.flat_apply_function(gm, node)
            module = module_of_opaque(fn)
            if module is None:
                continue
            check_called_as_module(node, module, fn)
            args, kwargs = decode_none(*_compat.flat_apply_inputs(gm, node))
        else:
            continue
        if id(module) not in names:
            names[id(module)] = f"jagg_dit_{len(names)}" if names else "jagg_dit"
            gm.add_submodule(names[id(module)], module)
        with graph.inserting_before(node):
            dit = graph.get_attr(names[id(module)])
            call = graph.call_function(dit_call, (dit, tuple(args), dict(kwargs)))
            call.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
            flat = graph.call_function(flatten_output, (call,))
        node.replace_all_uses_with(flat)
        spec_node, callable_node = node.args[1], node.args[0]
        graph.erase_node(node)
        for attr_node in (spec_node, callable_node):
            if isinstance(attr_node, fx.Node) and attr_node.op == "get_attr" and not attr_node.users:
                graph.erase_node(attr_node)
    graph.lint()
    gm.recompile()
    return gm


def _hidden_dit_calls(sub: fx.GraphModule) -> list[tuple[fx.Node, nn.Module]]:
    """Opaque DiT calls anywhere inside ``sub`` (and the subgraphs nested in it)."""
    found = []
    for m in sub.modules():
        if not isinstance(m, fx.GraphModule):
            continue
        for n in m.graph.nodes:
            if opaque_op.is_opaque_op_node(n):
                found.append((n, opaque_op.site_of(n).module()))
            elif _compat.is_flat_apply_node(n):
                module = module_of_opaque(_compat.flat_apply_function(m, n))
                if module is not None:
                    found.append((n, module))
    return found


def check_no_dit_in_subgraphs(gm: fx.GraphModule) -> None:
    """Refuse DiT calls that Dynamo placed inside a higher-order op's subgraph.

    ``torch.utils.checkpoint.checkpoint(dit, ...)`` around the DiT call in the loss (either
    ``use_reentrant``) becomes a ``tag_activation_checkpoint`` node whose body holds the call; a
    ``torch.autograd.Function`` becomes ``autograd_function_apply``. jaggc cannot batch or
    rewrite such a call, and with ``use_reentrant=True`` and stored (no-grad) states the DiT gets
    no gradient at all, so the loss is refused with the op and the source line.
    """
    for sub_name, sub in gm.named_children():
        if not isinstance(sub, fx.GraphModule):
            continue
        hidden = _hidden_dit_calls(sub)
        if not hidden:
            continue
        users = [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == sub_name for u in n.users]
        op = users[0] if users else None
        op_name = getattr(op.target, "__name__", str(op.target)) if op is not None else sub_name
        where = (user_source(op) if op is not None else "") or user_source(hidden[0][0])
        raise checkpoint_region_error(where, hidden[0][1], f"{op_name} (graph node {op.name if op is not None else sub_name})")
