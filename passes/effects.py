"""The order of in-place writes, and check_window_inputs: a window's calls never wait for each other.

FX and Dynamo record an in-place write (``x.add_(y)``, ``x[i] = y``, ``x += y``) as a node whose
effect lives in the storage it writes, not in its output. The rewrite moves DiT calls (a window's
calls all run at its last call) and re-sorts the graph by dataflow; without more edges a write
would move across the reads of the storage it writes. ``effect_edges`` finds, for every in-place
node, the storages it may write (its alias roots, below) and every node that reads or writes one of
them, and keeps each such pair in its traced order: an edge from the earlier to the later node.
Three users read the edges:

* ``check_independence`` follows a write's edges to the later readers as dataflow: a DiT output
  added with its gradient into a stored state that a later call reads makes that call depend on
  the earlier one (a final refusal naming both steps and the write's line);
* ``check_window_inputs`` (this pass) refuses a window one of whose calls needs, through data or
  effect edges, a value an earlier call of the same window produces: a detached DiT output written
  into the next stored state, or a state computed from the previous step's detached output. A
  window runs its calls together, so no order can honour that; the intercept path, which records
  the calls one by one, takes such a loss (a ``JaggCaptureError``: ``auto`` falls back to it);
* ``restore_topological_order`` (rewrite.py) keeps the edges when it re-sorts the rewritten graph,
  so every accepted write runs exactly where it ran in the traced loss.

The storages a node's value may share (its alias roots) are ``jaggc/alias_roots.py``'s, which the
frontends read too (``input_writes``).

Invariant after ``check_window_inputs``: contracting each rewritten window (all routed windows as
one, every window in the low-memory mode) to one node leaves the graph, with effect edges, acyclic.
"""

from __future__ import annotations

from typing import Hashable

import networkx as nx
import torch
from torch import fx

from jaggc._compat import traced_input_value
from jaggc.errors import JaggCaptureError
from jaggc.graph_ops import dit_call, is_in_place, live_tensor, user_source
from jaggc.alias_roots import METADATA_QUERIES, PURE_VIEWS, alias_roots, input_root, op_name
from jaggc.node_meta import CALL

from .context import PassContext
from .infra import Fact, ensure, graph_pass

def _accesses(node: fx.Node, roots: dict, param_roots: frozenset) -> tuple[frozenset, frozenset]:
    """(roots read, roots written) by ``node``; a pure view or a metadata query touches no data."""
    name = op_name(node)
    if node.op in ("placeholder", "get_attr") or name in PURE_VIEWS or name in METADATA_QUERIES:
        return frozenset(), frozenset()
    if node.op == "call_function" and node.target is live_tensor:
        return frozenset(), frozenset()
    read = frozenset().union(*(roots[i] for i in node.all_input_nodes))
    if node.op == "call_function" and node.target is dit_call:
        read |= param_roots          # the DiT reads its parameters, which are no arguments of the call
    written = roots[node.args[0]] if is_in_place(node) and isinstance(node.args[0], fx.Node) else frozenset()
    return read, written


def effect_edges(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(earlier, later, write) for every pair that must keep its traced order: a write and a
    later read or write of a storage it may write, or a read and a later write. Computed once per
    graph (``ctx.effects``); empty when the loss writes nothing in place."""
    if ctx.effects is not None:
        return ctx.effects
    ctx.effects = []
    writes = [n for n in gm.graph.nodes if is_in_place(n)]
    if not writes:
        return ctx.effects
    roots = alias_roots(gm)
    written_roots = frozenset().union(*(roots[w.args[0]] for w in writes if isinstance(w.args[0], fx.Node)))
    # what a DiT call reads without taking it as an argument: written parameters (FX reads them
    # with get_attr / live_tensor; Dynamo lifts a parameter the loss touches to an input)
    param_roots = frozenset(r for r in written_roots if r[0] == "attr") | frozenset(
        input_root(n) for n in gm.graph.nodes if n.op == "placeholder" and input_root(n) in written_roots
        and isinstance(traced_input_value(n), torch.nn.Parameter))
    last_write: dict[Hashable, fx.Node] = {}
    reads_since: dict[Hashable, list[fx.Node]] = {}
    edges = set()
    for node in gm.graph.nodes:
        read, written = _accesses(node, roots, param_roots)
        for r in (read | written) & written_roots:
            if r in last_write:
                edges.add((last_write[r], node, last_write[r]))
        for r in written & written_roots:
            for reader in reads_since.get(r, []):
                if reader is not node:
                    edges.add((reader, node, node))
            last_write[r], reads_since[r] = node, []
        for r in (read - written) & written_roots:
            reads_since.setdefault(r, []).append(node)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    ctx.effects = sorted(edges, key=lambda e: (position[e[0]], position[e[1]]))
    return ctx.effects


def written_outputs(gm: fx.GraphModule) -> set[fx.Node]:
    """The DiT calls whose output the loss writes in place (``v.mul_(0.5)``, ``v[:, 0] = 0``)."""
    calls = {("node", n.name): n for n in gm.graph.nodes if n.op == "call_function" and n.target is dit_call}
    writes = [n for n in gm.graph.nodes if is_in_place(n) and isinstance(n.args[0], fx.Node)]
    if not calls or not writes:
        return set()
    roots = alias_roots(gm)
    return {calls[r] for w in writes for r in roots[w.args[0]] if r in calls}


def effect_order(ctx: PassContext) -> list[tuple[fx.Node, fx.Node]]:
    """The effect edges on the rewritten graph: a rewritten call stands for the node that runs it."""
    if not ctx.effects:
        return []
    out = []
    for a, b, _ in ctx.effects:
        a, b = ctx.replaced.get(a, a), ctx.replaced.get(b, b)
        if a is not b:
            out.append((a, b))
    return out


def rewritten_groups(ctx: PassContext) -> list[list[fx.Node]]:
    """The DiT calls each rewritten node runs together: every JAGG window; all routed windows (one
    ``jagg_trajectory`` node); in the low-memory mode every window, exact ones too."""
    lowmem = ctx.config.options.backward.support.backward_in_forward
    groups = [list(w.nodes) for w in ctx.windows if w.mode == "jagg" or (lowmem and w.mode != "routed")]
    routed = [n for w in ctx.windows if w.mode == "routed" for n in w.nodes]
    return groups + ([routed] if routed else [])


def _ensure_acyclic_windows(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Re-checked with networkx: the graph with each rewritten group contracted is a DAG."""
    groups = rewritten_groups(ctx)
    group_of = {n: i for i, g in enumerate(groups) for n in g}

    def key(n):
        return ("window", group_of[n]) if n in group_of else n.name

    g = nx.DiGraph()
    g.add_nodes_from(key(n) for n in gm.graph.nodes)
    g.add_edges_from((key(a), key(b)) for b in gm.graph.nodes for a in b.all_input_nodes if key(a) != key(b))
    g.add_edges_from((key(a), key(b)) for a, b, _ in effect_edges(gm, ctx) if key(a) != key(b))
    ensure(nx.is_directed_acyclic_graph(g), "check_window_inputs", "the contracted window graph is acyclic")


@graph_pass(requires={Fact.WINDOWS}, provides={Fact.EFFECTS}, analysis=True, ensures=_ensure_acyclic_windows)
def check_window_inputs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Refuse a window whose calls wait for each other (a value or an in-place write between them)."""
    groups = rewritten_groups(ctx)
    if not groups:
        return gm
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    edges = effect_edges(gm, ctx)

    def key(n):
        return ("window", group_of[n]) if n in group_of else n

    pairs = [(inp, node) for node in gm.graph.nodes for inp in node.all_input_nodes] + [(a, b) for a, b, _ in edges]
    contracted = {(key(a), key(b)): (a, b) for a, b in pairs if key(a) != key(b)}
    if _acyclic({key(n) for n in gm.graph.nodes}, contracted):
        return gm
    g = nx.DiGraph()
    for (ka, kb), (a, b) in contracted.items():
        g.add_edge(ka, kb, via=(a, b))
    raise _window_cycle_error(nx.find_cycle(g), g, {(a, b): w for a, b, w in edges}, ctx.frontend)


def _acyclic(keys: set, edges) -> bool:
    """Kahn's algorithm on the contracted graph (networkx only describes a cycle once found)."""
    waiting = dict.fromkeys(keys, 0)
    after: dict = {}
    for a, b in edges:
        waiting[b] += 1
        after.setdefault(a, []).append(b)
    ready = [k for k, n in waiting.items() if n == 0]
    done = 0
    while ready:
        k = ready.pop()
        done += 1
        for b in after.get(k, ()):
            waiting[b] -= 1
            if waiting[b] == 0:
                ready.append(b)
    return done == len(waiting)


def _window_cycle_error(cycle, g: nx.DiGraph, via, frontend: str) -> JaggCaptureError:
    """Name the two calls of one window that wait for each other, and what links them: a value
    computed from the earlier call's output (through a detached value or an in-place write), or a
    read that must come before an in-place write that the later call must come after."""
    path = [g.edges[u, v]["via"] for u, v, *_ in cycle]
    start = next(i for i, (u, _) in enumerate(cycle) if isinstance(u, tuple) and u[0] == "window")
    path = path[start:] + path[:start]
    producer, consumer = path[0][0], path[-1][1]
    a, b = CALL.of(producer), CALL.of(consumer)
    if a.step > b.step:
        a, b = b, a
        producer, consumer = consumer, producer
    anti = [e for e in path if e in via and via[e] is e[1] and not is_in_place(e[0])]
    writes = [via[e] for e in path if e in via]

    def line(n):
        return user_source(n) or f"node {n.name}"

    if anti:
        reader, write = anti[0]
        why = (f"the loss reads a tensor at {line(reader)} ({reader.name}, which needs step {a.step}'s output) "
               f"before the in-place write at {line(write)} ({write.name}) into its storage, and step {b.step} "
               f"reads that storage after the write")
    else:
        through = f"the in-place write at {line(writes[0])} ({writes[0].name})" if writes else "a detached value"
        why = f"step {b.step}'s input is computed from the output of step {a.step} through {through}"
    err = JaggCaptureError(
        f"step {b.step} ({b.source or 'node ' + consumer.name}) and step {a.step} ({a.source or 'node ' + producer.name}) "
        f"are in the same JAGG window, but {why}. A window runs its calls together at its last call, so that order "
        f"cannot be kept. Read the stored states (not states recomputed from this pass's DiT outputs or written in "
        f"place around them), use window=2, or let the intercept path take the loss (capture='auto' or 'intercept': "
        f"it records the calls one by one)", path=frontend)
    err.where = b.source or a.source      # the message names both steps' lines itself: no prefix
    return err
