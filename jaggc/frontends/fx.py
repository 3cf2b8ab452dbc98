"""torch.fx capture with the DiT as a leaf: Python loops unroll, each DiT call is one node.

Plain torch.fx cannot trace a trainer's loss; this tracer records what plain FX loses:

- **questions about a traced value's metadata** (``x.ndim``, ``range(batch["timesteps"].shape[1])``)
  get concrete answers from fake-tensor example values (``example_values.py``); the cache key holds
  every input's shape, dtype and device;
- **questions about a traced value's value** (``math.sqrt(delta_t)``, ``float(sigma)``,
  ``t.item()``, ``bool(torch.isfinite(t).all())``, Flow-GRPO's ``index_for_timestep``) get the real
  answer from the call's inputs, baked in and re-checked on every later call by a guard
  (``value_reads.py``); a value that depends on a DiT output is refused;
- **grad mode**: a ``with torch.no_grad():`` block (a KL reference call, a diagnostic) is recorded
  as ``_set_grad_enabled`` nodes, as Dynamo records it (plain FX drops it and changes gradients);
  ``torch.inference_mode()`` is recorded the same way (no grad: the same values);
- **autocast**: a ``with torch.autocast(...):`` block (the trainers' CUDA bf16 block around the DiT
  call, a CPU block in tests, nested in helpers or not) is recorded as ``set_autocast`` switch
  nodes holding the state the following ops run in; every node also keeps the grad and autocast
  state it was traced in (``node_meta.TRACED_MODES``), so its example value and any value read
  through it are computed in that state, as eager code would;
- **module state**: a DiT call traced in another state than the loss was entered in (inside peft's
  ``disable_adapter()``, after ``dit.train()``) is replayed in that state (``set_module_state``
  nodes, and a ``state`` on the reference call); FX alone would run every call in whatever state
  the module has, and the KL reference would be the policy itself. Tracing runs the loss's state
  changes on the real module (``dit.eval()`` before ``return``); the module is put back in its entry
  state after the trace, refused or not, so the graph's first run (or the next capture path)
  starts where the loss was entered, not in the state set after the last call;
- arguments are bound to the function's signature: tensors (also inside dicts, lists and tuples)
  become placeholders, everything else is baked in (the cache key holds it, ``fx_guards.py``).

Still refused, as ``JaggCaptureError`` (another path may take the loss): raw
``autograd.Function.apply`` (FX loses its backward), in-place writes into trace constants, shapes
that cannot be computed. Calling the DiT through ``.forward`` is a final refusal.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import traceback
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn

from .. import _compat
from .._compat import SET_GRAD_ENABLED, fake_mode_suspended, tree_flatten, tree_unflatten
from ..errors import JaggCaptureError, JaggGraphError
from ..graph_ops import dit_call, is_in_place, set_autocast, user_source
from ..source import frame_location, frame_traceback_line, traceback_location, user_frame
from ..runtime.autocast import autocast_cache_disabled, current_autocast
from ..runtime.module_state import ModuleState, module_state
from . import example_values
from .example_values import ExampleValues
from .aliasing import storage_of
from .contract import Captured, bind_loss, direct_forward_error, instance_slots, refuse_checkpoint_region
from .fx_module_states import place_module_states, restore_entry_states
from .live_tensors import LiveTensors
from .value_reads import ValueReads
from ..node_meta import REQUIRES_GRAD, STORAGE, TRACED_CALL, TRACED_MODES, TracedCall


def concrete_args_for(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Tensor leaves -> fx.PH (placeholders); everything else stays concrete."""
    concrete = {}
    for name, value in bind_loss(fn, args, kwargs, defaults=True).arguments.items():
        leaves, spec = tree_flatten(value)
        concrete[name] = tree_unflatten([fx.PH if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    return concrete


class ShapedProxy(fx.Proxy):
    """A Proxy that answers metadata questions from its node's example value, and value questions
    (``float(x)``, ``x.item()``, ``bool(x)``) with a guarded read of the real value."""

    def _example(self):
        return self.tracer.examples.of(self.node)

    def __len__(self):
        return len(self._example())

    def __iter__(self):
        # tuple unpacking of a DiT output (``noise_pred, = dit(...)``) or a shape-sized loop
        return iter([self[i] for i in range(len(self._example()))])

    def __getattr__(self, k):
        if k.startswith("__") and k.endswith("__"):
            # protocol probes (``__cuda_array_interface__``, ``__array__``): a traced tensor has none
            raise AttributeError(k)
        return ShapedAttribute(self, k)

    def __float__(self):
        return self.tracer.reads.read(self.node, "float")

    def __int__(self):
        return self.tracer.reads.read(self.node, "int")

    def __index__(self):
        return self.tracer.reads.read(self.node, "index")

    def __complex__(self):
        return self.tracer.reads.read(self.node, "complex")

    def item(self):
        return self.tracer.reads.read(self.node, "item")

    def __setitem__(self, key, value):
        # ``x[:, 0] = 0``: an in-place node like ``x.copy_``; the effects analysis keeps its order
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def tolist(self):
        return self.tracer.reads.read(self.node, "tolist")


def _answered_from_example(name: str, method: bool):
    def example(self):
        try:
            return self._example()
        except AttributeError as e:
            # raised inside a property, an AttributeError would make Python fall back to
            # __getattr__ and silently hand the loss a Proxy instead of the answer
            raise JaggCaptureError(f"computing the {name} of {self.node.name} failed: AttributeError: {e}",
                                   path="fx", where=user_source(self.node)) from e

    if method:
        return lambda self, *args, **kwargs: getattr(example(self), name)(*args, **kwargs)
    return property(lambda self: getattr(example(self), name))


for _name in ("shape", "ndim", "dtype", "device", "is_cuda"):
    setattr(ShapedProxy, _name, _answered_from_example(_name, method=False))
for _name in ("size", "dim", "numel", "is_floating_point"):
    setattr(ShapedProxy, _name, _answered_from_example(_name, method=True))


class ShapedAttribute(ShapedProxy, fx.proxy.Attribute):
    """``out.sample`` of a DiT output: a lazily created getattr node that also has a shape."""


class DiTLeafTracer(fx.Tracer):
    """Keeps the DiT (and any wrapper around it) opaque: each call becomes a ``dit_call`` node.

    ``inputs`` are the flattened argument leaves in signature order (one placeholder each): their
    fake copies seed the example values, the real ones the value reads.
    """

    def __init__(self, dits: list[nn.Module], inputs: list):
        super().__init__()
        self.dits = {id(m): m for m in dits}
        self.installed: dict[str, nn.Module] = {}
        self.reads: ValueReads | None = None
        self.examples = ExampleValues(self._root_value, user_source, self._concrete,
                                      lambda node: self.reads.read(node, "value"))
        self.reads = ValueReads(self._root_value, user_source, self.examples.order)
        self._inputs = list(reversed(inputs))
        # the modes the recorded nodes run under, and those the loss was entered in
        self.grad_mode = self.entry_grad = torch.is_grad_enabled()
        self.autocast = self.entry_autocast = current_autocast()
        self.live: LiveTensors | None = None           # set by capture_fx (live_tensors.py)

    def _root_value(self, target: str):
        if target in self.installed:
            return self.installed[target]
        value = self.root
        for part in target.split("."):
            value = getattr(value, part)
        return value

    def _concrete(self, node: fx.Node):
        """The real value of a node fake tensors cannot run: a tensor of value-dependent shape
        (``nonzero``: its shape becomes a guarded read) or a number (``math.sqrt(delta_t)``)."""
        with fake_mode_suspended():
            real = self.reads.real_value(node)
            if isinstance(real, torch.Tensor):
                self.reads.read(node, "shape")
            return real

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShapedProxy(node, self)

    def to_bool(self, obj: fx.Proxy) -> bool:
        return self.reads.read(obj.node, "bool")

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        # the tracer's own tensor code (fake copies of inputs, example values) is not the loss's
        with self.live.suspended() if self.live is not None else contextlib.nullcontext():
            return self._create_traced_node(kind, target, args, kwargs, name, type_expr)

    def create_arg(self, a):
        if self.live is not None and self.live.is_live(a):
            return self.live.proxy_of(a).node      # a parameter as an op's argument: read at run time
        return super().create_arg(a)

    def _create_traced_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        if kind != "placeholder":
            self._record_modes()
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        # the user's line only (error messages name one line), not fx's record_stack_traces
        node.stack_trace = _user_line()
        TRACED_MODES.set(node, (self.grad_mode, self.autocast))
        self.examples.add(node)
        if kind == "placeholder":
            value = self._inputs.pop()
            REQUIRES_GRAD.set(node, isinstance(value, torch.Tensor) and value.requires_grad)
            if isinstance(value, torch.Tensor):
                # inputs sharing storage share an alias root (passes/effects.py); aliasing.py rechecks it
                STORAGE.set(node, storage_of(value))
            self.examples.set_input(node, value)
            self.reads.real_inputs[node] = value
        elif is_in_place(node):
            self.reads.in_place.append(node)
            target = node.args[0] if node.args else None
            if isinstance(target, fx.Node) and target.op == "get_attr":
                # `total = torch.zeros(()); total.add_(v)`: the tensor is a real constant of the
                # trace, so its later uses read the unchanged constant (a loss of 0, silently)
                raise JaggCaptureError(
                    f"the loss writes in place ({node.target if isinstance(node.target, str) else node.target.__name__}) "
                    f"into a tensor it created from constants; torch.fx records the write but every later use "
                    f"reads the unwritten constant. Accumulate out of place (`total = total + x`)",
                    path="fx", where=user_source(node))
            self.examples.run_in_place_op(node)
        return node

    def _record_modes(self) -> None:
        """A ``_set_grad_enabled`` / ``set_autocast`` node wherever the grad mode / the autocast
        state changed since the last node (inference mode is a grad mode of False here: the
        graph's replay computes the same values without grad)."""
        mode = torch.is_grad_enabled()
        if mode != self.grad_mode:
            switch = super().create_node("call_function", SET_GRAD_ENABLED, (mode,), {})
            switch.stack_trace = _user_line()
            self.grad_mode = mode
        autocast = current_autocast()
        if autocast != self.autocast:
            switch = super().create_node("call_function", set_autocast, (autocast,), {})
            switch.stack_trace = _user_line()
            self.autocast = autocast

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
            refuse_checkpoint_region(m)     # its window forwards would run outside the region
            dit = self.create_proxy("get_attr", self._attr_name(m), (), {})
            proxy = self.create_proxy("call_function", dit_call, (dit, tuple(args), dict(kwargs)), {})
            proxy.node.stack_trace = _user_stack()  # fx would name this frame, not the user's call
            TRACED_CALL.set(proxy.node, TracedCall(m, module_state(m), torch.is_grad_enabled()))
            return proxy
        return self.create_proxy("call_module", self.path_of_module(m), args, kwargs)


def _user_frame():
    """The innermost frame outside torch and jaggc's machinery (source.py): the user's line."""
    return user_frame(inspect.currentframe())


def _user_stack() -> str:
    frame = _user_frame()
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


def _user_line() -> str:
    """The user's frame in traceback format (what ``node_location`` and fx's codegen read), built
    by hand: ``traceback.format_stack`` of the whole stack for every node dominated the trace."""
    return frame_traceback_line(_user_frame())


def _where() -> str:
    """``file:line`` of the user's frame now running (empty if none is)."""
    return frame_location(_user_frame()) or ""


def _refuse_direct_forward(dits: list[nn.Module]):
    """A call through ``dit.forward(...)`` skips module hooks (DDP/FSDP sync): refuse it."""
    def refusing(m: nn.Module):
        original = m.__dict__.get("forward") or type(m).forward.__get__(m)

        def refuse(*args, **kwargs):
            if example_values.running():   # the DiT's own call, run for its output's shape
                return original(*args, **kwargs)
            raise direct_forward_error(_where(), m)
        return refuse

    return instance_slots((m, "forward", refusing(m)) for m in dits)


class _RefuseFunctionApply:
    """FX runs ``Function.apply`` on proxies and loses the custom backward: refuse it."""

    def __enter__(self):
        # the raw classmethod object: restoring the bound method would break every Function
        self.original = original = torch.autograd.Function.__dict__["apply"]

        def refuse(cls, *args, **kwargs):
            if example_values.running():   # inside the DiT or an op run for an example value
                return original.__get__(None, cls)(*args, **kwargs)
            raise JaggCaptureError(
                f"the loss calls {cls.__name__}.apply; torch.fx would inline its forward and silently drop "
                f"its custom backward. Wrap the call in a module-level function decorated with "
                f"@torch.fx.wrap, or use capture='dynamo' (Dynamo keeps the custom backward)",
                path="fx", where=_where())

        torch.autograd.Function.apply = classmethod(refuse)
        return self

    def __exit__(self, *exc):
        torch.autograd.Function.apply = self.original


class _RandomDrawsRefused(_compat.dispatch_mode_base()):
    """A random op the loss runs on real tensors while FX traces (``torch.randn(shape)``: no traced
    input, so FX runs it once and bakes the draw into the graph as a constant) is refused; random
    ops on traced values (``torch.randn_like(mean)``) are graph nodes and draw on every call."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and not example_values.running():
            raise JaggCaptureError(
                f"the loss draws random numbers ({func.name()}) from values torch.fx does not trace; "
                f"the draw would be baked into the graph and repeat on every call. Draw the noise outside "
                f"the loss and pass it in, or let Dynamo capture the loss (capture='dynamo')",
                path="fx", where=_where())
        return func(*args, **(kwargs or {}))


def capture_fx(fn: Callable, args: tuple, kwargs: dict, dits: list[nn.Module]) -> Captured:
    """Trace ``fn(*args, **kwargs)`` into a GraphModule with ``dit_call`` nodes."""
    concrete = concrete_args_for(fn, args, kwargs)
    inputs = [leaf for value in bind_loss(fn, args, kwargs, defaults=True).arguments.values() for leaf in tree_flatten(value)[0]]
    tracer = DiTLeafTracer(dits, inputs)
    tracer.live = LiveTensors(tracer, dits, _where, tracer._attr_name)
    entry = {id(m): module_state(m) for m in dits}
    try:
        return _traced(fn, concrete, tracer, dits, entry)
    finally:
        # tracing ran the loss's own state changes (``dit.eval()`` before ``return``) on the real
        # module; the graph replays them, and its first run (or the next capture path, if this one
        # refuses) must start where the loss was entered, or every call would run in the state the
        # loss set after it
        restore_entry_states(dits, entry)


def _traced(fn: Callable, concrete: dict, tracer: DiTLeafTracer, dits: list[nn.Module],
            entry: dict[int, ModuleState]) -> Captured:
    try:
        # nothing the trace runs may leave casts in the caller's autocast weight-cast cache: the
        # graph's first run in the same region would share them (autocast.py)
        with _refuse_direct_forward(dits), _RefuseFunctionApply(), _RandomDrawsRefused(), tracer.live, \
                warnings.catch_warnings(), autocast_cache_disabled():
            # fx cannot add an assertion for a module-valued concrete argument; the cache key has its id
            warnings.filterwarnings("ignore", message="Was not able to add assertion")
            graph = tracer.trace(fn, concrete_args=concrete)
    except (JaggCaptureError, JaggGraphError):
        raise
    except Exception as e:  # noqa: BLE001
        # TraceError, an isinstance(x, torch.Tensor) check on a Proxy, or an error the loss raised
        # on a traced stand-in: another path, running the loss on real tensors, decides (a real
        # error raised by the loss surfaces there)
        raise JaggCaptureError(
            f"the FX frontend cannot trace {getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}",
            path="fx", where=_where_in_traceback(e)) from e
    exits = {id(m): module_state(m) for m in dits}
    for node in graph.nodes:
        if node.op == "placeholder":
            # the graph is always called with every argument bound (defaults applied); a default
            # kept on the placeholder breaks fx's pytree codegen (``enabled_1 = True, = ...``)
            node.args = ()
    # the DiT and other called modules, and tensors the loss built from constants while tracing
    # (``torch.ones(x.shape[-1])`` once the shape is known), which fx stores as ``_tensor_constant``
    root = {n.target: tracer._root_value(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    place_module_states(graph, root, entry, exits)
    guard = tracer.reads.guard(graph, root)
    return Captured(fx.GraphModule(root, graph, class_name="JaggLoss"), entry_grad=tracer.entry_grad,
                    entry_autocast=tracer.entry_autocast, guard=guard)


def _where_in_traceback(e: BaseException) -> str:
    """``file:line`` of the innermost user frame of an exception raised while tracing (or empty)."""
    return traceback_location(e) or ""
