"""split_cfg_batches: run the batch slices of a DiT call that carry no gradient without grad.

Flow-GRPO trains with classifier-free guidance as ONE DiT call on ``[uncond; cond]`` (batch 2B),
``noise_pred.chunk(2)``, and the uncond half ``.detach()``ed: half of the DiT's backward (and of its
saved activations) then computes zeros. A DiT never mixes samples across the batch, so the call
can be cut into its chunks: a chunk whose every use is ``.detach()`` or runs under no_grad becomes
a no-grad call on its slice of the inputs (a reference call: never in a window, served by the
rollout cache), the others stay trained calls of batch B that the windows take as usual. Values
are the unsplit call's up to batch-size roundoff; gradients are the same, since the detached slice
contributed none.

Pattern (FX and Dynamo captures): ``dit_call`` -> its primary output (``[0]`` of a tuple,
``.sample``, Dynamo's ``flatten_output(...)[0]``, or the call itself when the DiT returns a tensor)
-> ``.chunk(n)`` along dim 0 -> ``[i]`` for constant i, with no other use of the output. Calls of
another shape are left as they are.

Invariant after: every split call is gone; for each, one trained ``dit_call`` on the chunks with
gradient (concatenated, its output chunked back) and one no-grad ``dit_call`` per other used chunk,
on inputs sliced by ``batch_chunk`` (a tensor input is sliced iff its leading dim is the call's
batch), the no-grad chunks' nodes marked ``jagg_grad=False`` between grad-mode switches, every new node in
the call's autocast state, the chunk getitems replaced by the new calls' primary outputs; ``ctx.splits`` records (source, chunks, no-grad indices).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from jaggc._compat import SET_GRAD_ENABLED, tree_flatten, tree_unflatten
from jaggc.graph_ops import batch_chunk, dit_call, flatten_output, is_graph_value, user_source
from jaggc.node_meta import AUTOCAST, GRAD
from jaggc.runtime.calls import argument_at, state_position

from .context import PassContext
from .infra import Fact, ensure, graph_pass


@dataclass
class Split:
    source: str
    chunks: int
    no_grad: tuple[int, ...]
    reason: str


def _primary_output(call: fx.Node) -> fx.Node | None:
    """The node holding the call's velocity, if it is the call's only use (the call itself when
    the DiT returns a tensor and it is chunked directly)."""
    users = list(call.users)
    if len(users) != 1:
        return None
    (user,) = users
    if (user.op == "call_method" and user.target == "chunk") or (
            user.op == "call_function" and user.target is torch.chunk):
        return call
    if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
        return user
    if user.op == "call_function" and getattr(user.target, "__name__", "") == "getattr" and user.args[1] == "sample":
        return user
    if user.op == "call_function" and user.target is flatten_output and len(user.users) == 1:
        (first,) = user.users
        if first.op == "call_function" and first.target is operator.getitem and first.args[1] == 0:
            return first
    if user.op == "call_method" and user.target == "__getitem__" and user.args[1] == 0:
        return user
    return None


def _chunking(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the chunk node, n) if ``node``'s only use is ``.chunk(n)`` / ``torch.chunk(x, n)`` on dim 0."""
    users = list(node.users)
    if len(users) != 1:
        return None
    (chunk,) = users
    is_chunk = (chunk.op == "call_method" and chunk.target == "chunk") or (
        chunk.op == "call_function" and chunk.target is torch.chunk)
    if not is_chunk:
        return None
    n = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    if not isinstance(n, int) or n < 2 or dim != 0:
        return None
    if any(not (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int))
           for u in chunk.users):
        return None
    return chunk, n


def _carries_no_gradient(piece: fx.Node) -> bool:
    """Every use is ``.detach()`` or runs without grad: the slice's gradient is zero."""
    for use in piece.users:
        detached = (use.op == "call_method" and use.target == "detach") or (
            use.op == "call_function" and use.target is torch.detach)
        if not (detached or GRAD.get(use) is False):
            return False
    return True


def _split_of(call: fx.Node):
    """(primary output, pieces, chunk count, no-grad chunks, unused chunks) of a grad-enabled DiT
    call whose output is chunked with chunks that carry no gradient, else None."""
    if not GRAD.of(call) or call.kwargs:
        return None
    primary = _primary_output(call)
    found = _chunking(primary) if primary is not None else None
    if found is None:
        return None
    chunk, n = found
    pieces = {u.args[1] % n: [] for u in chunk.users}
    for u in chunk.users:
        pieces[u.args[1] % n].append(u)
    no_grad = tuple(sorted(i for i, us in pieces.items() if all(_carries_no_gradient(u) for u in us)))
    unused = tuple(sorted(set(range(n)) - set(pieces)))
    if len(no_grad) == len(pieces) or not (no_grad or unused):
        return None            # no gradient at all (a reference call already), or nothing to save
    return primary, pieces, n, no_grad, unused


def _ensure_split(gm: fx.GraphModule, ctx: PassContext) -> None:
    if not ctx.config.split_batches:
        return
    for call in gm.graph.nodes:
        if call.op == "call_function" and call.target is dit_call and GRAD.on(call):
            ensure(_split_of(call) is None, "split_cfg_batches",
                   f"{call.name}: no trained DiT call still computes a chunk without gradient")


@graph_pass(requires={Fact.CANONICAL, Fact.MODES}, provides={Fact.SPLITS}, invalidates={Fact.MODES}, ensures=_ensure_split,
            applies=lambda ctx: ctx.config.split_batches)
def split_cfg_batches(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Run the batch slices of a DiT call that carry no gradient (a detached CFG half) without grad."""
    graph = gm.graph
    for call in [n for n in graph.nodes if n.op == "call_function" and n.target is dit_call]:
        found = _split_of(call)
        if found is None:
            continue
        primary, pieces, n, no_grad, unused = found
        _rewrite(gm, call, primary, pieces, n, no_grad)
        reasons = ["detached or only used without grad"] * bool(no_grad) + [f"chunks {list(unused)} unused"] * bool(unused)
        ctx.splits.append(Split(source=user_source(call), chunks=n, no_grad=no_grad, reason="; ".join(reasons)))
    return gm


def _rewrite(gm: fx.GraphModule, call: fx.Node, primary: fx.Node, pieces: dict, n: int, no_grad: tuple) -> None:
    graph = gm.graph
    module, args, kwargs = call.args
    leaves, spec = tree_flatten((args, kwargs))
    state = argument_at(args, kwargs, state_position(args, kwargs, is_graph_value))
    # the chunks with gradient stay ONE trained call (on their slices, concatenated), so a step
    # keeps one trained call; each no-grad chunk becomes its own reference call
    trained = tuple(i for i in sorted(pieces) if i not in no_grad)
    groups = [trained] * bool(trained) + [(i,) for i in sorted(pieces) if i in no_grad]
    anchor = call
    for group in sorted(groups):
        grad = group == trained
        new_nodes = []
        if not grad:
            with graph.inserting_after(anchor):
                anchor = graph.call_function(SET_GRAD_ENABLED, (False,))
            new_nodes.append(anchor)
        sliced = []
        for leaf in leaves:
            if isinstance(leaf, fx.Node):
                with graph.inserting_after(anchor):
                    leaf = graph.call_function(batch_chunk, (leaf, state, n, group if len(group) > 1 else group[0]))
                anchor = leaf
                new_nodes.append(leaf)
            sliced.append(leaf)
        new_args, new_kwargs = tree_unflatten(sliced, spec)
        with graph.inserting_after(anchor):
            piece_call = graph.call_function(dit_call, (module, new_args, new_kwargs))
        piece_call.meta.update({k: v for k, v in call.meta.items() if k in ("stack_trace", "nn_module_stack")})
        piece_call.stack_trace = call.stack_trace
        if primary is call:
            out = piece_call
        else:
            with graph.inserting_after(piece_call):
                out = _same_access(graph, primary, piece_call)
        anchor = out
        new_nodes += [piece_call] + (_chain(out, piece_call) if out is not piece_call else [])
        outs = {group[0]: out}
        if len(group) > 1:
            with graph.inserting_after(anchor):
                rechunk = anchor = graph.call_method("chunk", (out, len(group)))
            new_nodes.append(rechunk)
            for k, index in enumerate(group):
                with graph.inserting_after(anchor):
                    anchor = outs[index] = graph.call_function(operator.getitem, (rechunk, k))
                new_nodes.append(anchor)
        if not grad:
            with graph.inserting_after(anchor):
                anchor = graph.call_function(SET_GRAD_ENABLED, (True,))
            new_nodes.append(anchor)
        for node in new_nodes:
            GRAD.set(node, grad if node.target is not SET_GRAD_ENABLED else node.args[0])
            AUTOCAST.set(node, AUTOCAST.of(call))   # the pieces run as the call did
        for index in group:
            for use in pieces[index]:
                use.replace_all_uses_with(outs[index])
    # the chunk getitems, the chunk, the primary access and the call itself are now unused
    chunk = next(iter(primary.users))
    for use in [u for us in pieces.values() for u in us]:
        graph.erase_node(use)
    graph.erase_node(chunk)
    if primary is not call:
        via = primary.args[0]
        graph.erase_node(primary)
        if via is not call:
            graph.erase_node(via)
    graph.erase_node(call)


def _same_access(graph: fx.Graph, primary: fx.Node, piece_call: fx.Node) -> fx.Node:
    """The piece call's primary output, reached the way the original one was."""
    via = primary.args[0]
    if via.target is flatten_output:
        flat = graph.call_function(flatten_output, (piece_call,))
        with graph.inserting_after(flat):
            return graph.call_function(operator.getitem, (flat, 0))
    return graph.create_node(primary.op, primary.target, (piece_call,) + tuple(primary.args[1:]), dict(primary.kwargs))


def _chain(out: fx.Node, piece_call: fx.Node) -> list[fx.Node]:
    """The nodes between ``piece_call`` and ``out`` (for their grad-mode facts)."""
    chain, node = [out], out
    while node.args and node.args[0] is not piece_call and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        chain.append(node)
    return chain
