"""torch.fx capture with the DiT as a leaf: Python loops unroll, each DiT call is one node.

Arguments are bound to the function's signature: tensors (also inside dicts, lists and tuples)
become placeholders, everything else (Python ints for the step count, modules, configs) is
baked in as a constant, so a change in a constant re-traces (the cache key includes them).
FX silently drops ``torch.no_grad()`` blocks and inlines ``autograd.Function.apply`` without its
backward, so both are refused while tracing, as is calling the DiT through ``.forward``.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
import traceback
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn

from .._compat import tree_flatten, tree_unflatten
from ..errors import JaggUnsupportedError
from ..graph_ops import dit_call


def _bind(fn: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def concrete_args_for(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Tensor leaves -> fx.PH (placeholders); everything else stays concrete."""
    concrete = {}
    for name, value in _bind(fn, args, kwargs).arguments.items():
        leaves, spec = tree_flatten(value)
        concrete[name] = tree_unflatten([fx.PH if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    return concrete


def refuse_no_grad_blocks(fn: Callable) -> None:
    """FX drops ``with torch.no_grad()`` (the gradient would change silently): refuse it."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        filename, first_line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.With):
            for item in node.items:
                text = ast.unparse(item.context_expr)
                if any(k in text for k in ("no_grad", "inference_mode", "set_grad_enabled", "disable_adapter")):
                    raise JaggUnsupportedError(
                        f"{filename}:{first_line + node.lineno - 1}: `with {text}:` cannot be captured by the "
                        f"FX frontend (torch.fx drops grad-mode blocks, which would change the gradient). "
                        f"Use `.detach()` on the values instead, or capture='dynamo'"
                    )


class DiTLeafTracer(fx.Tracer):
    """Keeps the DiT (and any wrapper around it) opaque: each call becomes a ``dit_call`` node."""

    def __init__(self, dits: list[nn.Module]):
        super().__init__()
        self.dits = {id(m): m for m in dits}
        self.installed: dict[str, nn.Module] = {}

    def _attr_name(self, m: nn.Module) -> str:
        for name, mod in self.installed.items():
            if mod is m:
                return name
        prefix = "jagg_dit" if id(m) in self.dits else "module"
        count = sum(name.startswith(prefix) for name in self.installed)
        name = prefix if count == 0 and prefix == "jagg_dit" else f"{prefix}_{count}"
        self.installed[name] = m
        return name

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True  # every module called by the loss is a unit; only the DiT is rewritten

    def path_of_module(self, mod: nn.Module) -> str:
        try:
            return super().path_of_module(mod)
        except NameError:
            return self._attr_name(mod)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        if id(m) in self.dits:
            dit = self.create_proxy("get_attr", self._attr_name(m), (), {})
            proxy = self.create_proxy("call_function", dit_call, (dit, tuple(args), dict(kwargs)), {})
            proxy.node.stack_trace = _user_stack()  # fx would name this frame, not the user's call
            return proxy
        return self.create_proxy("call_module", self.path_of_module(m), args, kwargs)


_INTERNAL_FILES = ("/torch/fx/", "/torch/nn/modules/module.py", "/jaggc/frontends/")


def _user_frame():
    """The innermost frame outside torch.fx, nn.Module's call machinery and this frontend."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in name for part in _INTERNAL_FILES):
            return frame
        frame = frame.f_back
    return None


def _user_stack() -> str:
    frame = _user_frame()
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


def _where() -> str:
    frame = _user_frame()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}: " if frame is not None else ""


@contextlib.contextmanager
def _refuse_direct_forward(dits: list[nn.Module]):
    """A call through ``dit.forward(...)`` skips module hooks (DDP/FSDP sync): refuse it."""
    saved = []

    def refuse(*args, **kwargs):
        raise JaggUnsupportedError(
            f"{_where()}the DiT is called through `.forward(...)`; call the module itself, `dit(...)`, so "
            f"that its hooks (DDP/FSDP gradient sync, peft) run and jaggc can see the call")

    for m in dits:
        saved.append((m, m.__dict__.get("forward")))
        m.__dict__["forward"] = refuse
    try:
        yield
    finally:
        for m, old in saved:
            if old is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = old


class _RefuseFunctionApply:
    """FX runs ``Function.apply`` on proxies and loses the custom backward: refuse it."""

    def __enter__(self):
        # the raw classmethod object: restoring the bound method would break every Function
        self.original = torch.autograd.Function.__dict__["apply"]

        def refuse(cls, *args, **kwargs):
            raise JaggUnsupportedError(
                f"{_where()}the loss calls {cls.__name__}.apply; torch.fx would inline its forward and silently drop "
                f"its custom backward. Wrap the call in a module-level function decorated with "
                f"@torch.fx.wrap, or use capture='dynamo'")

        torch.autograd.Function.apply = classmethod(refuse)
        return self

    def __exit__(self, *exc):
        torch.autograd.Function.apply = self.original


def capture_fx(fn: Callable, args: tuple, kwargs: dict, dits: list[nn.Module]) -> fx.GraphModule:
    """Trace ``fn(*args, **kwargs)`` into a GraphModule with ``dit_call`` nodes."""
    refuse_no_grad_blocks(fn)
    tracer = DiTLeafTracer(dits)
    tracer.record_stack_traces = True  # file:line of each node, for error messages
    concrete = concrete_args_for(fn, args, kwargs)
    try:
        with _refuse_direct_forward(dits), _RefuseFunctionApply(), warnings.catch_warnings():
            # fx cannot add an assertion for a module-valued concrete argument; the cache key has its id
            warnings.filterwarnings("ignore", message="Was not able to add assertion")
            graph = tracer.trace(fn, concrete_args=concrete)
    except JaggUnsupportedError:
        raise
    except Exception as e:  # TraceError, TypeError from len()/range() on proxies, ...
        raise JaggUnsupportedError(
            f"the FX frontend cannot trace {getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}. "
            f"Tensor-valued control flow, len() of tensors and shape-dependent ranges need "
            f"capture='dynamo' (or make the step count a Python int argument)") from e
    return fx.GraphModule(dict(tracer.installed), graph, class_name="JaggLoss")
