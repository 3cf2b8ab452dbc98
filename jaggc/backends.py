"""Hand the rewritten graph to a torch.compile backend, keeping jaggc's runtime nodes opaque.

A backend cannot compile a ``jagg_window`` node: it is Python that calls the DiT module and a
custom autograd Function. So the graph is split (``torch.fx.passes.split_module``) into maximal
segments of *glue* (the user's loss arithmetic: log-probs, ratios, clipping, reductions) and
*runtime* segments (``dit_call`` / ``jagg_window`` nodes, their ``getitem`` readers and
``flatten_output``). Glue segments are compiled with the backend the first time they run (with the
real inputs as example inputs: Dynamo's graphs have tensor-only inputs, so every glue segment
does); runtime segments run eagerly, exactly as with ``backend=None``. Autograd connects the
segments as usual, so the compiled glue's backward feeds the runtime's JAGG backward.

The DiT itself is not compiled here (compile it with ``torch.compile(dit)`` if wanted: jaggc
calls it as a module, so a compiled module works).
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from . import _compat
from .errors import JaggUnsupportedError
from .graph_ops import is_runtime_target

BACKENDS = ("aot_eager", "inductor")


def is_runtime_node(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if is_runtime_target(node):
        return True
    # the (nested) readers of a runtime node's tuple output belong with it: glue gets tensors only
    return (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and is_runtime_node(node.args[0]))


def assign_segments(gm: fx.GraphModule) -> dict[str, tuple[int, bool]]:
    """Node name -> (segment id, is runtime): a new segment starts whenever the kind changes."""
    segments: dict[str, tuple[int, bool]] = {}
    current, kind = 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        runtime = is_runtime_node(node)
        if kind is not None and runtime != kind:
            current += 1
        kind = runtime
        segments[node.name] = (current, runtime)
    return segments


class LazyCompiledGlue(nn.Module):
    """A glue segment compiled by ``backend`` on its first call (its inputs are the examples)."""

    def __init__(self, segment: fx.GraphModule, backend: str):
        super().__init__()
        self.segment = segment
        self.backend = backend
        self.compiled = None

    def forward(self, *args):
        if self.compiled is None:
            bad = [type(a).__name__ for a in args if not isinstance(a, (torch.Tensor, int, float, bool))]
            if bad:
                raise JaggUnsupportedError(
                    f"backend={self.backend!r}: a glue segment of the loss takes non-tensor values ({bad}); "
                    f"only Dynamo-captured graphs can be compiled by a backend. Use backend=None")
            self._single = not isinstance(self.segment.graph.output_node().args[0], (tuple, list))
            self.compiled = _compat.lookup_dynamo_backend(self.backend)(_tuple_output(self.segment), list(args))
        out = self.compiled(*args)
        return out[0] if self._single else out


def _tuple_output(segment: fx.GraphModule) -> fx.GraphModule:
    """Dynamo backends expect graphs that return a tuple."""
    output = segment.graph.output_node()
    if not isinstance(output.args[0], (tuple, list)):
        output.args = ((output.args[0],),)
        segment.recompile()
    return segment


def compile_glue(gm: fx.GraphModule, backend: str) -> fx.GraphModule:
    """The rewritten graph with its glue segments compiled by ``backend`` (module docstring)."""
    if backend not in BACKENDS:
        raise JaggUnsupportedError(f"backend={backend!r}: use None (eager) or one of {BACKENDS}")
    segments = assign_segments(gm)
    split = split_module(gm, None, lambda node: segments[node.name][0], keep_original_order=True)
    runtime_ids = {sid for sid, runtime in segments.values() if runtime}
    for name, child in list(split.named_children()):
        sid = int(name.rsplit("_", 1)[-1])
        if sid not in runtime_ids:
            setattr(split, name, LazyCompiledGlue(child, backend))
    split.jaggc_segments = {"glue": len(set(s for s, r in segments.values() if not r)), "runtime": len(runtime_ids)}
    return split
