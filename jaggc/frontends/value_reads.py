"""Tensor values an FX trace reads as Python values, and the guard that re-checks them per call.

Trainers' step functions read schedule tensors as Python numbers: DanceGRPO's
``std_dev_t = eta * math.sqrt(delta_t)`` with ``delta_t`` taken from a sigma-schedule tensor,
Flow-GRPO's ``scheduler.index_for_timestep(t)`` (``.nonzero()``, ``len()``, ``.item()``),
``int(sigma * 1000)``, and jaggc's own input checks (``bool(torch.isfinite(t).all())``). Plain
torch.fx cannot answer such a question; Dynamo breaks the graph on it.

The FX frontend answers it with the real value, computed from the call's real inputs, and bakes
the answer into the trace. That is sound only while the answer stays the same, so every answer
is a *read* recorded with the subgraph that produced it, and ``Guard`` re-runs those subgraphs on
each later call's inputs and compares: an equal answer reuses the graph, any other selects or
traces another one. The re-run costs what the eager loss spends on the same reads (tiny ops on
schedule-sized tensors), never a DiT forward: a read whose value depends on a DiT output, on
another module's output, on a random op or on a tensor written in place is refused.

Shapes that depend on values (``(t == schedule).nonzero()``) are answered the same way: the real
tensor stands in as the example value and its shape is a read.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from .. import _compat
from ..errors import JaggCaptureError, located
from ..graph_ops import dit_call, is_autocast_switch, is_in_place
from ..runtime.autocast import autocast_applied, reset_graph_autocast
from .example_values import running_real_code
from ..node_meta import TRACED_MODES

# ops whose value differs between runs on the same inputs: a read of them cannot be guarded
_RANDOM_NAMES = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
                 "dropout", "uniform", "exponential", "geometric", "cauchy", "log_normal", "random_")

_CONVERT: dict[str, Callable[[Any], Any]] = {
    "bool": bool, "float": float, "int": int, "index": operator.index, "complex": complex,
    "item": lambda t: t.item(), "tolist": lambda t: t.tolist(), "len": len,
    "shape": lambda t: tuple(t.shape), "value": lambda v: v.item() if isinstance(v, torch.Tensor) else v,
}


def _target_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _same(a: Any, b: Any) -> bool:
    """Equal as Python values, NaN equal to NaN (a NaN read must not re-trace on every call)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@dataclass
class Read:
    node: fx.Node
    kind: str
    value: Any
    source: str


class ValueReads:
    """The reads of one trace. ``real_inputs`` maps each placeholder to the real input it stands
    for; ``root_value`` gives a ``get_attr`` target's real object; ``describe`` a node's source."""

    def __init__(self, root_value: Callable[[str], Any], describe: Callable[[fx.Node], str],
                 order: dict[fx.Node, int]):
        self.root_value = root_value
        self.describe = describe
        self.order = order                # trace order of every op node (shared with ExampleValues)
        self.real_inputs: dict[fx.Node, Any] = {}
        self.reads: list[Read] = []
        self.in_place: list[fx.Node] = []      # in-place ops traced so far (they write their first input)
        self._real: dict[fx.Node, Any] = {}

    # --- answering a question ------------------------------------------------------------------
    def read(self, node: fx.Node, kind: str) -> Any:
        """The real answer to ``kind`` (bool, float, item, len, ...) of ``node``; recorded."""
        value = _CONVERT[kind](self.real_value(node, kind))
        self.reads.append(Read(node, kind, value, self.describe(node)))
        return value

    def real_value(self, node: fx.Node, kind: str = "shape") -> Any:
        """The real value of ``node`` on the traced inputs (its ancestors run once, no grad)."""
        if node in self._real:
            return self._real[node]
        todo = [n for n in self._closure(node, kind) if n not in self._real]
        # torch.fx's patches (of nn.Module.__call__ and wrapped functions) only matter to Python
        # code; reverting them costs more than the tensor ops of a typical read
        python_code = any(n.op == "call_function" and not _is_builtin(n.target) for n in todo)
        with torch.no_grad(), running_real_code(), (_compat.fx_patches_reverted() if python_code
                                                     else contextlib.nullcontext()):
            for n in todo:
                self._real[n] = self._run(n)
        return self._real[node]

    def _closure(self, node: fx.Node, kind: str) -> list[fx.Node]:
        """``node`` and its ancestors in graph order; refuses what cannot be re-run as a guard."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            why = None
            if n.op == "call_function" and n.target is dit_call:
                why = "the DiT's output"
            elif n.op == "call_module":
                why = f"the output of module {n.target!r}"
            elif is_in_place(n):
                why = f"a tensor written in place ({_target_name(n)})"
            elif any(part in _target_name(n).lower() for part in _RANDOM_NAMES):
                why = f"a random op ({_target_name(n)})"
            if why is not None:
                what = (f"asks for the shape of a tensor whose shape depends on the values of {why}"
                        if kind in ("shape", "len") else
                        f"reads a tensor as a Python value ({_question(kind)}) that depends on {why}")
                origin = self.describe(n) or f"node {n.name}"
                raise JaggCaptureError(
                    f"the loss {what} (made at {origin}). A compiled graph cannot branch on "
                    f"or bake in such a value, and Dynamo breaks the graph at the same line. Compute it with "
                    f"tensor ops (torch.where, a mask multiplied in) or pass it in as a Python number",
                    path="fx", where=self.describe(node))
            stack.extend(n.all_input_nodes)
            if n is node:
                written = self._written_in_place(n, seen | set(_ancestors(n)))
                if written is not None:
                    stack.append(written)
        # every node was traced before the ones that read it: trace order is a topological order
        return sorted(seen, key=lambda n: (n.op != "placeholder", self.order.get(n, -1)))

    def _written_in_place(self, node: fx.Node, closure: set) -> fx.Node | None:
        """An in-place op that writes a tensor the read depends on, or one derived from it (a view
        of it may alias it): FX recorded the write as a node nobody reads, so the read would see
        the value before it. Returned so ``_closure`` refuses it."""
        for op in self.in_place:
            target = op.args[0] if op.args and isinstance(op.args[0], fx.Node) else None
            if target is not None and (target in closure or closure & set(_ancestors(target))):
                return op
        return None

    def _run(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            return self.real_inputs[n]
        if n.op == "get_attr":
            return self.root_value(n.target)
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), self._real.__getitem__)
        # in the autocast state the op was traced in (a read inside an autocast block)
        with autocast_applied(TRACED_MODES.get(n, (None, None))[1]):
            if n.op == "call_method":
                return getattr(args[0], n.target)(*args[1:], **kwargs)
            return n.target(*args, **kwargs)

    # --- the guard -----------------------------------------------------------------------------
    def guard(self, graph: fx.Graph, root: dict[str, Any]) -> "Guard | None":
        """A guard over every read of this trace (None if there were none)."""
        if not self.reads:
            return None
        g = fx.Graph()
        _compat.copy_input_codegen(graph, g)   # the same argument flattening as the traced graph
        env: dict[fx.Node, fx.Node] = {}
        needed = set()
        for r in self.reads:
            needed.update(self._closure(r.node, r.kind))
        for n in graph.nodes:
            # the autocast switches too: a read inside an autocast block is re-run in it (the traced
            # graph ends in its entry state, so the guard does as well)
            if n.op == "placeholder" or n in needed or is_autocast_switch(n):
                env[n] = g.node_copy(n, env.__getitem__)
        g.output(tuple(env[r.node] for r in self.reads))
        attrs = {n.target: root[n.target] for n in g.nodes if n.op == "get_attr"}
        return Guard(fx.GraphModule(attrs, g, class_name="JaggReadGuard"),
                     [(r.kind, r.value, r.source) for r in self.reads])


class Guard:
    """Re-runs a trace's reads on new inputs and compares the answers (module docstring)."""

    def __init__(self, module: fx.GraphModule, expected: list[tuple[str, Any, str]]):
        self.module = module
        self.expected = expected

    def _values(self, args) -> tuple:
        try:
            with torch.no_grad():
                return self.module(*args)
        finally:
            reset_graph_autocast()    # an evaluation that raised inside an autocast switch

    def check(self, *args) -> bool:
        try:
            values = self._values(args)
            return all(_same(_CONVERT[kind](v), want) for v, (kind, want, _) in zip(values, self.expected))
        except Exception:   # noqa: BLE001 - new values the old reads cannot even evaluate (an empty nonzero)
            return False

    def changed(self, *args) -> list[str]:
        """The reads whose answer changed, as "file:line: kind was X, now Y" (for messages)."""
        try:
            values = self._values(args)
        except Exception as e:  # noqa: BLE001
            return [f"the reads could not be evaluated ({type(e).__name__}: {e})"]
        out = []
        for v, (kind, want, source) in zip(values, self.expected):
            now = _CONVERT[kind](v)
            if not _same(now, want):
                out.append(located(f"{_question(kind)} was {want!r}, now {now!r}", source))
        return out

    def __len__(self) -> int:
        return len(self.expected)


def _is_builtin(fn) -> bool:
    return type(fn).__name__ in ("builtin_function_or_method", "method_descriptor", "wrapper_descriptor")


def _ancestors(node: fx.Node):
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            yield n
            stack.extend(n.all_input_nodes)


def _question(kind: str) -> str:
    return {"bool": "bool(x)", "float": "float(x)", "int": "int(x)", "index": "x used as an index",
            "complex": "complex(x)", "item": "x.item()", "tolist": "x.tolist()", "len": "len(x)",
            "shape": "x.shape", "value": "a number computed from x"}[kind]
