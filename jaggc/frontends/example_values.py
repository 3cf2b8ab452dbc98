"""Fake-tensor values of FX-traced nodes, computed only when the loss asks for a shape.

Plain torch.fx cannot trace a real GRPO loss: Flow-GRPO's ``sigma.view(-1, *[1] * (x.ndim - 1))``
and ``range(batch["timesteps"].shape[1])`` ask a Proxy for its shape. The FX frontend answers
such questions (shape, ndim, size(), dim(), numel(), dtype, device, len()) with concrete values
taken from a fake-tensor run of the node's ancestors. That is exact for the inputs traced: every
shape, dtype and device in the graph is a function of the input tensors' metadata, the module's
parameters' metadata and the constant arguments, and all of them are in the FX cache key
(``fx_runner.structure_key``). An op whose output shape depends on tensor *values* (``nonzero``,
``masked_select``) cannot be run on fake tensors; asking for its shape is refused.

Values are computed lazily: a loss asks about a handful of nodes (the DiT output's ``ndim``, a
placeholder's ``shape[1]``), and only those and their ancestors run. Each op runs once per signature
of its inputs' metadata (``fake_cache``): a 50-step Flow-GRPO loss runs one step's ops and one
DiT forward on fake tensors, not fifty.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
from torch import fx, nn

from .. import _compat
from .._compat import tree_map
from ..errors import JaggCaptureError, JaggError, JaggInternalError
from ..graph_ops import dit_call, is_in_place, live_tensor
from ..runtime.autocast import autocast_applied, autocast_cache_disabled
from .dynamo import is_distributed, real_run_as_fake
from .fake_cache import TensorMeta, cached_fake_call
from ..node_meta import TRACED_MODES


_RUNNING = [0]


def running() -> bool:
    """True while an example value is computed: the FX frontend's refusals (``dit.forward``,
    ``Function.apply``) are about the user's loss, not about the code run for a shape."""
    return _RUNNING[0] > 0


@contextlib.contextmanager
def running_real_code():
    _RUNNING[0] += 1
    try:
        yield
    finally:
        _RUNNING[0] -= 1


class ExampleValues:
    """node -> example value, for the nodes of one trace (see module docstring).

    A value is a fake tensor, a ``TensorMeta`` (the recorded output metadata of an op already run
    on inputs with the same metadata: a 50-step loss repeats its first step's ops 49 times, and
    running an op on fake tensors costs more than tracing it) or a plain Python value.
    """

    def __init__(self, root_value: Callable[[str], Any], describe: Callable[[fx.Node], str],
                 concrete: Callable[[fx.Node], Any] | None = None,
                 guard_value: Callable[[fx.Node], None] | None = None):
        # allow_non_fake_inputs: the DiT's real parameters meet fake activations in its fake run
        self.mode = _compat.new_fake_mode(allow_non_fake_inputs=True)
        self.values: dict[fx.Node, Any] = {}
        self.order: dict[fx.Node, int] = {}
        self.root_value = root_value      # get_attr target -> the real object
        self.describe = describe          # node -> "file:line" of the user code that made it (or "")
        # node -> its real value, for an op fake tensors cannot run: one whose output shape
        # depends on values (``nonzero``: the caller guards the shape, value_reads.py), or a
        # Python number made from a tensor (``math.sqrt(delta_t)``, which fx records as a node)
        self.concrete = concrete
        # such a number stands in for a traced value: harmless in arithmetic, but if a shape could
        # depend on it (``torch.arange(n)``, ``x[:n]``) ``guard_value`` records it as a read
        self.guard_value = guard_value
        self.standins: set[fx.Node] = set()
        self._real_code: contextlib.ExitStack | None = None

    def add(self, node: fx.Node) -> None:
        self.order[node] = len(self.order)

    def set_input(self, node: fx.Node, value: Any) -> None:
        self.values[node] = self.mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    def of(self, node: fx.Node) -> Any:
        """The example value of ``node``, computing every ancestor not yet computed (in trace order)."""
        if node in self.values:
            return self.values[node]
        pending, stack, seen = [], [node], set()
        while stack:   # iterative: a 100-step loss is a chain of thousands of nodes
            n = stack.pop()
            if n in self.values or n in seen:
                continue
            seen.add(n)
            pending.append(n)
            stack.extend(n.all_input_nodes)
        with contextlib.ExitStack() as self._real_code:
            for n in sorted(pending, key=self.order.__getitem__):
                self.values[n] = self._compute_in_traced_modes(n)
        self._real_code = None
        return self.values[node]

    def _compute_in_traced_modes(self, node: fx.Node) -> Any:
        """The value computed in the grad mode and autocast state ``node`` was traced in: a value
        asked for after the loss left an autocast block (``noise_pred.dtype`` below it) is the
        block's value, as in eager code."""
        modes = TRACED_MODES.get(node)
        if modes is None:
            return self._compute_tracking_standins(node)
        grad, autocast = modes
        with torch.set_grad_enabled(grad), autocast_applied(autocast):
            return self._compute_tracking_standins(node)

    def _compute_tracking_standins(self, node: fx.Node) -> Any:
        standin_inputs = [a for a in node.all_input_nodes if a in self.standins]
        if standin_inputs and not _shape_independent_of_scalars(node) and self.guard_value is not None:
            for a in standin_inputs:
                self.guard_value(a)
                self.standins.discard(a)
            standin_inputs = []
        value = self._compute(node)
        if standin_inputs and not isinstance(value, (torch.Tensor, TensorMeta)):
            self.standins.add(node)      # a number computed from a stand-in is one too
        return value

    def run_in_place_op(self, node: fx.Node) -> None:
        """An in-place op (``v.unsqueeze_(0)``) changes its input's metadata from here on: every
        node traced before it gets its value now (as eager code would compute them), then the op
        runs on its input's stored fake tensor."""
        earlier = [n for n in self.order if n not in self.values and n is not node]
        for n in earlier:
            self.of(n)
        self.of(node)

    def _enter_real_code(self, unpatched: bool) -> None:
        """Once per ``of``, and only if some op really runs: enter the fake mode and, if ``fn``
        may call a module, undo fx's patches (of ``nn.Module.__call__`` among others: reverting
        and reapplying them costs more than running an op)."""
        stack = self._real_code
        if not getattr(stack, "entered", False):
            stack.enter_context(self.mode)
            stack.enter_context(running_real_code())
            # fake casts of the real parameters must not reach autocast's weight-cast cache: the
            # loss's real ops in the same autocast region would compute with them (autocast.py)
            stack.enter_context(autocast_cache_disabled())
            stack.entered = True
        if unpatched and not getattr(stack, "unpatched", False):
            stack.enter_context(_compat.fx_patches_reverted())
            stack.unpatched = True

    def _really(self, fn: Callable) -> Callable:
        """``fn`` run on fake tensors: recorded metadata among its inputs is materialised first."""
        unpatched = not _is_builtin_op(fn)

        def run(*args, **kwargs):
            self._enter_real_code(unpatched)
            args, kwargs = tree_map(lambda v: v.fresh() if isinstance(v, TensorMeta) else v, (args, kwargs))
            return fn(*args, **kwargs)
        return run

    def _compute(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            raise JaggInternalError(f"placeholder {node.name} has no example value")
        if node.op == "get_attr":
            value = self.root_value(node.target)
            return self.mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
        if self.concrete is not None and _value_dependent_shape(node):
            # a fake run would only fail (and failing costs more than the real op)
            return self.mode.from_tensor(self.concrete(node))
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.values.__getitem__)
        if node.op == "call_function" and node.target is live_tensor:
            return self.mode.from_tensor(live_tensor(*args))     # a parameter read at run time
        try:
            if node.op == "call_function" and node.target is dit_call:
                module, dit_args, dit_kwargs = args
                return cached_fake_call(module, self._really(_fake_dit_run(module)), dit_args, dit_kwargs,
                                        mode=self.mode, as_metadata=True)
            if node.op == "call_module":
                return self._really(self.root_value(node.target))(*args, **kwargs)
            if node.op == "call_function":
                owner, fn = node.target, node.target
            elif node.op == "call_method":
                owner, fn = ("method", node.target), _call_method(node.target)
            else:
                raise JaggInternalError(f"no example value for {node.op} node {node.name}")
            if is_in_place(node):
                # an in-place op changes its input's metadata (unsqueeze_): run it on the stored
                # fake input itself, never from the cache
                for arg in node.all_input_nodes:
                    self.values[arg] = self._really(lambda v: v)(self.values[arg])
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.values.__getitem__)
                return self._really(fn)(*args, **kwargs)
            return cached_fake_call(owner, self._really(fn), args, kwargs, mode=self.mode, as_metadata=True)
        except JaggError:
            raise
        except Exception as e:  # data-dependent output shapes, ops without a fake kernel, ...
            if self.concrete is not None and _is_data_dependent(e):
                real = self.concrete(node)
                if isinstance(real, torch.Tensor):
                    return self.mode.from_tensor(real)
                self.standins.add(node)
                return real
            raise JaggCaptureError(
                f"the loss asks for a shape, dtype or device that depends on "
                f"{node.format_node()}, which cannot be computed from the inputs' shapes "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", path="fx",
                where=self.describe(node)) from e


# ops whose output shape does not depend on the value of a Python-number argument
_SCALAR_SAFE_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.pos, operator.abs, torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.where,
    torch.clamp, torch.exp, torch.log, torch.sqrt, torch.maximum, torch.minimum, torch.full_like})
_SCALAR_SAFE_METHODS = frozenset({
    "add", "sub", "mul", "div", "pow", "neg", "rsub", "clamp", "clamp_min", "clamp_max", "exp", "log", "sqrt",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__pow__", "__rpow__", "__neg__", "to", "float", "double"})


def _shape_independent_of_scalars(node: fx.Node) -> bool:
    """True if the output shape of ``node`` cannot depend on the value of a number it takes."""
    if node.op == "call_method":
        return node.target in _SCALAR_SAFE_METHODS
    if node.op != "call_function":
        return False
    return node.target in _SCALAR_SAFE_FUNCTIONS or getattr(node.target, "__module__", None) == "math"


_VALUE_DEPENDENT_SHAPE_OPS = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"})


def _value_dependent_shape(node: fx.Node) -> bool:
    """Ops whose output shape depends on input values (Flow-GRPO's step lookup uses ``nonzero``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in _VALUE_DEPENDENT_SHAPE_OPS


def _is_data_dependent(e: Exception) -> bool:
    """A fake-tensor failure because the output shape depends on input values (``nonzero``)."""
    return type(e).__name__ in ("DynamicOutputShapeException", "DataDependentOutputException")


def _is_builtin_op(fn) -> bool:
    """A C function (``torch.add``, ``operator.mul``) or tensor method: it cannot call a module."""
    return type(fn).__name__ in ("builtin_function_or_method", "method_descriptor") or getattr(fn, "_tensor_method", False)


def _call_method(name: str):
    def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)
    call._tensor_method = True   # x.float(), x.mean(...): the receiver is a tensor's example value
    return call


def _fake_dit_run(module: nn.Module) -> Callable:
    """How the DiT's output metadata is learned: its own call on fake inputs, except that a
    DDP/FSDP wrapper (whose hooks talk to the other ranks and keep state) runs for real on zeros."""
    if is_distributed(module):
        return lambda *args, **kwargs: real_run_as_fake(module, args, kwargs)
    return module
