"""The module-state changes a loss makes while FX traces it, replayed by its graph (``fx.py``).

Tracing runs the loss on the real modules, so its ``dit.train()``, ``dit.eval()``, peft adapter
switches and ``requires_grad_`` calls change the real DiT as the trace goes. The graph must replay
them (``set_module_state`` nodes before the calls that ran in another state, a ``state`` on a
reference call, an epilogue that leaves the module as the loss leaves it), and the trace's own run of
them must be undone before the graph runs: a ``dit.eval()`` before ``return`` would otherwise leave
every call of the graph's first run in eval mode.
"""

from __future__ import annotations

import warnings

from torch import fx, nn

from ..errors import JaggCaptureError
from ..graph_ops import dit_call, set_module_state, user_source
from ..node_meta import TRACED_CALL
from ..runtime.module_state import ModuleState, applicable, difference, module_state, set_state


def restore_entry_states(dits: list[nn.Module], entry: dict[int, ModuleState]) -> None:
    """Put each DiT back in the state the loss was entered in (flags only: ``applicable``)."""
    for m in dits:
        now = module_state(m)
        if now != entry[id(m)] and applicable(now, entry[id(m)]):
            set_state(m, entry[id(m)])


def place_module_states(graph: fx.Graph, root: dict, entry: dict[int, ModuleState],
                         exits: dict[int, ModuleState]) -> None:
    """Replay the module-state changes the loss made while it was traced (module docstring).

    The trained (grad-enabled) calls of a module must share one state, the graph's base state for
    that module: a prologue sets it if the loss changed it before them (``dit.train()``). A call
    traced in another state (a no-grad reference under ``disable_adapter()``) runs in its own
    state; an epilogue leaves the module as the loss left it."""
    by_module: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is dit_call:
            by_module.setdefault(id(TRACED_CALL.of(node).module), []).append(node)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    output = next(n for n in graph.nodes if n.op == "output")
    count = 0

    def state_attr(state: ModuleState, before: fx.Node) -> fx.Node:
        nonlocal count
        name = f"jagg_module_state_{count}"
        count += 1
        root[name] = state
        with graph.inserting_before(before), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # get_attr of a plain object
            return graph.get_attr(name)

    for calls in by_module.values():
        module = TRACED_CALL.of(calls[0]).module
        trained = [n for n in calls if TRACED_CALL.of(n).grad_enabled]
        states = {TRACED_CALL.of(n).state for n in trained}
        if len(states) > 1:
            a, b = trained[0], next(n for n in trained if TRACED_CALL.of(n).state != TRACED_CALL.of(trained[0]).state)
            raise JaggCaptureError(
                f"this grad-enabled DiT call runs in another module state than the one at "
                f"{user_source(a)} ({difference(TRACED_CALL.of(a).state, TRACED_CALL.of(b).state)}); "
                f"a JAGG window pairs the Jacobians of its calls, which is only meaningful for one module state. "
                f"Keep the trained calls in one state (reference calls may differ if run under torch.no_grad())",
                path="fx", where=user_source(b))
        base = states.pop() if states else entry[id(module)]
        for node, state in [(first, base)] + [(n, TRACED_CALL.of(n).state) for n in calls] + [(output, exits[id(module)])]:
            frm = entry[id(module)] if node is first else base
            if state != frm and not applicable(frm, state):
                raise JaggCaptureError(
                    f"the DiT is called in another state than the loss was "
                    f"entered in ({difference(frm, state)}); a compiled graph can replay train/eval, requires_grad "
                    f"and peft adapter switches, not changed hooks or merged adapters",
                    path="fx", where=user_source(node) or "the loss")
        dit_name = calls[0].args[0].target
        if base != entry[id(module)]:
            attr = state_attr(base, first)
            with graph.inserting_after(attr):
                dit_attr = graph.get_attr(dit_name)
            with graph.inserting_after(dit_attr):
                graph.call_function(set_module_state, (dit_attr, attr))
        for node in calls:
            state = TRACED_CALL.of(node).state
            if state != base:
                node.kwargs = {**node.kwargs, "state": state_attr(state, node)}
        if exits[id(module)] != base:
            attr = state_attr(exits[id(module)], output)
            with graph.inserting_before(output):
                dit_attr = graph.get_attr(dit_name)
                graph.call_function(set_module_state, (dit_attr, attr))
