"""torch.fx capture with the DiT as a leaf: Python loops unroll, each DiT call is one node.

Unlike plain torch.fx, questions about a traced value's shape, dtype or device (``x.ndim``,
``range(batch["timesteps"].shape[1])``) get concrete answers (``example_values.py``), so a real
Flow-GRPO loss traces; the cache key holds every input's shape, dtype and device. This is the
fast capture: a 50-step loss traces in about a fifth of Dynamo's time, without Dynamo's guards
on globals and closures (``fx_guards.py`` puts the constants the loss reads into the cache key).

Arguments are bound to the function's signature: tensors (also inside dicts, lists and tuples)
become placeholders, everything else (Python ints for the step count, modules, configs) is
baked in as a constant, so a change in a constant re-traces (the cache key includes them).
FX silently drops ``torch.no_grad()`` / ``torch.autocast`` blocks (it records ops, not modes) and
inlines ``autograd.Function.apply`` without its backward, so both are refused while tracing (an op
traced under a mode other than the caller's, also inside a helper function), as is calling the DiT
through ``.forward``.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import linecache
import textwrap
import traceback
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn

from .._compat import tree_flatten, tree_unflatten
from ..errors import JaggUnsupportedError
from ..graph_ops import dit_call, is_in_place
from . import example_values
from .dynamo import user_source
from .example_values import ExampleValues


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


class ShapedProxy(fx.Proxy):
    """A Proxy that answers metadata questions (shape, dtype, ...) from its node's example value.

    Everything else stays symbolic; a question about a value (``bool``, ``.item()``) still fails
    the trace, as in plain FX.
    """

    def _example(self):
        return self.tracer.examples.of(self.node)

    def __len__(self):
        return len(self._example())

    def __iter__(self):
        # tuple unpacking of a DiT output (``noise_pred, = dit(...)``) or a shape-sized loop
        return iter([self[i] for i in range(len(self._example()))])

    def __getattr__(self, k):
        return ShapedAttribute(self, k)


def _answered_from_example(name: str, method: bool):
    if method:
        return lambda self, *args, **kwargs: getattr(self._example(), name)(*args, **kwargs)
    return property(lambda self: getattr(self._example(), name))


for _name in ("shape", "ndim", "dtype", "device", "is_cuda"):
    setattr(ShapedProxy, _name, _answered_from_example(_name, method=False))
for _name in ("size", "dim", "numel", "is_floating_point"):
    setattr(ShapedProxy, _name, _answered_from_example(_name, method=True))


class ShapedAttribute(ShapedProxy, fx.proxy.Attribute):
    """``out.sample`` of a DiT output: a lazily created getattr node that also has a shape."""


def _execution_modes() -> tuple:
    """The modes an op runs under that fx does not record: grad, inference, autocast."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))


def _source_prefix(node: fx.Node) -> str:
    where = user_source(node)
    return f"{where}: " if where else ""


class DiTLeafTracer(fx.Tracer):
    """Keeps the DiT (and any wrapper around it) opaque: each call becomes a ``dit_call`` node.

    ``inputs`` are the flattened argument leaves in signature order (one placeholder each), whose
    fake copies seed the example values the ``ShapedProxy`` questions are answered from.
    """

    def __init__(self, dits: list[nn.Module], inputs: list):
        super().__init__()
        self.dits = {id(m): m for m in dits}
        self.installed: dict[str, nn.Module] = {}
        self.examples = ExampleValues(self._root_value, _source_prefix)
        self._inputs = list(reversed(inputs))
        self.modes = _execution_modes()

    def _root_value(self, target: str):
        if target in self.installed:
            return self.installed[target]
        value = self.root
        for part in target.split("."):
            value = getattr(value, part)
        return value

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShapedProxy(node, self)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        # the user's line only (error messages name one line), not fx's record_stack_traces
        node.stack_trace = _user_line()
        if kind != "placeholder" and _execution_modes() != self.modes:
            raise JaggUnsupportedError(
                f"{_source_prefix(node)}this op is traced under another grad or autocast mode than the loss "
                f"was called with (a `with torch.no_grad():`, `torch.autocast(...)` or `@torch.no_grad()` in the "
                f"loss or a function it calls); torch.fx records the op but not the mode, so the compiled loss "
                f"would run it in the caller's mode. Use capture='dynamo'")
        self.examples.add(node)
        if kind == "placeholder":
            self.examples.set_input(node, self._inputs.pop())
        elif is_in_place(node):
            target = node.args[0] if node.args else None
            if isinstance(target, fx.Node) and target.op == "get_attr":
                # `total = torch.zeros(()); total.add_(v)`: the tensor is a real constant of the
                # trace, so its later uses read the unchanged constant (a loss of 0, silently)
                raise JaggUnsupportedError(
                    f"{_source_prefix(node)}the loss writes in place ({node.target if isinstance(node.target, str) else node.target.__name__}) "
                    f"into a tensor it created from constants; torch.fx records the write but every later use "
                    f"reads the unwritten constant. Accumulate out of place (`total = total + x`) or use "
                    f"capture='dynamo'")
            self.examples.run_in_place_op(node)
        return node

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


def _user_line() -> str:
    """The user's frame in traceback format (what ``user_source`` and fx's codegen read), built
    by hand: ``traceback.format_stack`` of the whole stack for every node dominated the trace."""
    frame = _user_frame()
    if frame is None:
        return ""
    code = frame.f_code
    text = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n    {text}\n'


def _where() -> str:
    frame = _user_frame()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}: " if frame is not None else ""


@contextlib.contextmanager
def _refuse_direct_forward(dits: list[nn.Module]):
    """A call through ``dit.forward(...)`` skips module hooks (DDP/FSDP sync): refuse it."""
    saved = []

    def refusing(m: nn.Module):
        original = m.__dict__.get("forward") or type(m).forward.__get__(m)

        def refuse(*args, **kwargs):
            if example_values.running():   # the DiT's own call, run for its output's shape
                return original(*args, **kwargs)
            raise JaggUnsupportedError(
                f"{_where()}the DiT is called through `.forward(...)`; call the module itself, `dit(...)`, so "
                f"that its hooks (DDP/FSDP gradient sync, peft) run and jaggc can see the call")
        return refuse

    for m in dits:
        saved.append((m, m.__dict__.get("forward")))
        m.__dict__["forward"] = refusing(m)
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
        self.original = original = torch.autograd.Function.__dict__["apply"]

        def refuse(cls, *args, **kwargs):
            if example_values.running():   # inside the DiT or an op run for an example value
                return original.__get__(None, cls)(*args, **kwargs)
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
    concrete = concrete_args_for(fn, args, kwargs)
    inputs = [leaf for value in _bind(fn, args, kwargs).arguments.values() for leaf in tree_flatten(value)[0]]
    tracer = DiTLeafTracer(dits, inputs)
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
            f"Control flow on tensor values (`if` on a tensor, `.item()`, `range(int(x))`) needs "
            f"capture='dynamo'; shapes, dtypes and devices may be used freely") from e
    # the DiT and other called modules, and tensors the loss built from constants while tracing
    # (``torch.ones(x.shape[-1])`` once the shape is known), which fx stores as ``_tensor_constant``
    root = {n.target: tracer._root_value(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    return fx.GraphModule(root, graph, class_name="JaggLoss")
