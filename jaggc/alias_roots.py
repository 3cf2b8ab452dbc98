"""Alias roots: which storages a graph node's value may share, and whether a graph writes into its inputs.

FX and Dynamo record an in-place write (``x.add_(y)``, ``x[i] = y``) as a node whose effect lives in
the storage it writes. A node's value may share storage with a loss input (the inputs grouped by the
storage their traced values share), a parameter or attribute (``get_attr``, ``live_tensor``), or a
tensor the loss made (the node that made it); views and ops that may return their input (``to``,
``reshape``, indexing) pass their input's roots on, anything else makes a new root.

Two layers read it: the effects pass (passes/effects.py) orders every write against the reads of what
it writes, and the graph frontends recheck, per call, that the inputs share storage as they did when
traced whenever ``input_writes(gm)`` (so it lives here, below both, not in the passes).
"""

from __future__ import annotations

import operator
from typing import Hashable

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from .graph_ops import is_in_place, live_tensor
from .node_meta import STORAGE

# no data is read: the result is an alias of the input
PURE_VIEWS = frozenset({
    "view", "view_as", "squeeze", "unsqueeze", "transpose", "t", "permute", "expand", "expand_as", "narrow",
    "select", "slice", "chunk", "split", "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit",
    "unbind", "unfold", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "as_strided", "detach",
    "real", "imag", "view_as_real", "view_as_complex", "adjoint", "alias", "unflatten", "broadcast_to",
    "flatten_output"})
# may return an alias of the input, or read it into a copy: both a read and an alias
MAYBE_VIEWS = frozenset({
    "reshape", "reshape_as", "flatten", "ravel", "contiguous", "to", "type", "type_as", "float", "double",
    "half", "bfloat16", "int", "long", "bool", "cpu", "cuda", "getitem", "__getitem__", "getattr", "conj",
    "resolve_conj", "resolve_neg", "atleast_1d", "atleast_2d", "atleast_3d", "requires_grad_"})
METADATA_QUERIES = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "is_floating_point", "element_size",
                       "nelement", "data_ptr", "storage_offset", "get_device"})


def op_name(node: fx.Node) -> str:
    if node.op in ("call_method", "call_module", "get_attr"):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def input_root(node: fx.Node) -> Hashable:
    """The storage a loss input lives in (inputs sharing storage share a root)."""
    storage = STORAGE.get(node)
    value = node.meta.get("example_value", node.meta.get("val"))
    if storage is None and isinstance(value, torch.Tensor):
        storage = StorageWeakRef(value.untyped_storage())
    return ("input", storage if storage is not None else node.name)


def alias_roots(gm: fx.GraphModule) -> dict[fx.Node, frozenset]:
    """For each node, the storages its value may share (module docstring)."""
    roots: dict[fx.Node, frozenset] = {}
    for node in gm.graph.nodes:
        name = op_name(node)
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if node.op == "placeholder":
            roots[node] = frozenset({input_root(node)})
        elif node.op == "get_attr":
            roots[node] = frozenset({("attr", node.target)})
        elif node.op == "call_function" and node.target is live_tensor:
            roots[node] = frozenset({("attr", node.args[0].target, node.args[1])})
        elif first is not None and (is_in_place(node) or name in PURE_VIEWS or name in MAYBE_VIEWS
                                    or node.target is operator.getitem):
            roots[node] = roots.get(first, frozenset({("node", first.name)}))
        else:
            roots[node] = frozenset({("node", node.name)})
    return roots


def input_writes(gm: fx.GraphModule) -> bool:
    """Whether the graph writes in place into storage one of its inputs holds."""
    roots = None
    for node in gm.graph.nodes:
        if is_in_place(node) and isinstance(node.args[0], fx.Node):
            roots = roots if roots is not None else alias_roots(gm)
            if any(r[0] == "input" for r in roots[node.args[0]]):
                return True
    return False


__all__ = ["MAYBE_VIEWS", "METADATA_QUERIES", "PURE_VIEWS", "alias_roots", "input_root", "input_writes", "op_name"]
