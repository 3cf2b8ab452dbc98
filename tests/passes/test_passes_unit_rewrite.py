"""The transform passes on small hand-built fx graphs (builders in tests/passes/test_passes_unit.py), for
the invariant each module docstring states, and the rewritten graphs run against the originals.

Covered here:
  * compute_weights: knots, basis and time_arg per JAGG window, knot roles; refusal of a call without
    the timestep argument and of a window whose calls read the timestep from different places.
  * rewrite_windows: each JAGG window's calls become one ``jagg_window`` node whose getitems feed the
    old users and carry the CallSites; exact tails keep their ``dit_call`` (now with ``step=``),
    reference calls stay as they are; routed windows become one ``jagg_trajectory``; with
    ``backward="lowmem"`` every window is a ``jagg_lowmem_window``. Numerics: the rewritten graph's
    loss and parameter gradient equal the original graph's with each window's states on its chord
    (AffineJacobianField, float64), and the gradient differs off the chord (JAGG really ran).
  * cleanup: dead pure nodes go; unused DiT calls, runtime nodes (has_side_effect), in-place ops and
    module calls stay; ``flatten_output`` (pure) goes.
  * place_modes: switches rebuilt so every node runs in its ``jagg_grad`` mode (entry mode in and
    out, no redundant switch), a node without the fact is an internal error, and a no-grad diagnostic
    the rewrite moved below a window runs without grad again.
  * place_lowmem_terms: a sum of per-step terms gets one ``jagg_lowmem_term`` per term (window,
    position, coefficient), ``jagg_lowmem_output``, the plans' term counts, the last flag and the
    window order; ``torch.stack(...).mean()``, a tensor coefficient and a term reading another
    trainable input are refused naming the node. Numerics: loss and gradient equal the original's.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from jaggc._compat import DYNAMO_ENTER_AUTOCAST, DYNAMO_EXIT_AUTOCAST, SET_GRAD_ENABLED
from jaggc.errors import JaggGraphError, JaggInputError, JaggInternalError
from jaggc.graph_ops import (RUNTIME_TARGETS, LowMemWindowPlan, WindowPlan, dit_call, flatten_output,
                             jagg_lowmem_output, jagg_lowmem_term, jagg_lowmem_window, jagg_trajectory, jagg_window,
                             set_autocast)
from jaggc.node_meta import AUTOCAST, CALL, GRAD, REQUIRES_GRAD
from jaggc.passes import (assign_windows, cleanup, compute_weights, find_dit_calls, place_modes,
                          place_lowmem_terms, rewrite_windows)
from jaggc.passes.context import Window
from jaggc.passes.modes import is_grad_switch
from jaggc.runtime.autocast import AUTOCAST_OFF, AutocastState
from jaggc.runtime.routing import Routing
from jaggc.runtime.weights import Basis

from test_passes_unit import D, F64, Capture, affine_loss, assert_same, calls_of, context, inputs, loss_and_grad, run

ANALYSES = (find_dit_calls, assign_windows, compute_weights)    # the facts rewrite_windows reads


def nodes_with(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def assert_runs_in_recorded_modes(gm: fx.GraphModule, entry: bool = True, entry_autocast=AUTOCAST_OFF):
    """place_modes' invariant: replaying the switches, every node runs under its jagg_grad and
    jagg_autocast, each switch changes its mode, and the graph returns in its entry modes."""
    mode, autocast = entry, entry_autocast
    for n in gm.graph.nodes:
        if is_grad_switch(n):
            assert n.args[0] != mode, f"{n.name}: a switch that changes nothing"
            mode = n.args[0]
        elif n.op == "call_function" and n.target is set_autocast:
            assert n.args[0] != autocast, f"{n.name}: an autocast switch that changes nothing"
            autocast = n.args[0]
        elif n.op == "output":
            assert mode == entry, "the graph returns in another grad mode than it was entered in"
            assert autocast == entry_autocast, "the graph returns in another autocast state than it was entered in"
        elif n.op not in ("placeholder", "get_attr"):
            assert GRAD.of(n) == mode, f"{n.name} runs with grad {mode}, recorded {GRAD.of(n)}"
            assert AUTOCAST.of(n) == autocast, (
                f"{n.name} runs in autocast {autocast}, recorded {AUTOCAST.of(n)}")


# ----------------------------------------------------------------------------- compute_weights

@pytest.mark.parametrize("weights, knots, basis", [("t", (0, 2), "linear/t"), ("index", (0, 2), "linear/index"),
                                                   (Basis("lagrange", "t"), (0, 1, 2), "lagrange/t")])
def test_compute_weights_sets_knots_basis_time_arg_and_knot_roles(weights, knots, basis):
    gm, _ = affine_loss(7)
    ctx = context(3, weights=weights)
    run(gm, ctx, find_dit_calls, assign_windows, compute_weights)
    for w in ctx.windows[:2]:
        assert (w.knots, w.basis, w.time_arg) == (knots, basis, 1)
        assert [CALL.of(n).role for n in w.nodes] == ["knot" if p in knots else "interior" for p in range(3)]
    tail = ctx.windows[2]
    assert (tail.mode, tail.knots, tail.basis, tail.time_arg) == ("exact", (), "", None)


@pytest.mark.parametrize("time_arg", [None, "t"])
def test_compute_weights_reads_the_timestep_keyword(time_arg):
    c = Capture("zs", "ts", "gs")
    total = 0
    for k in range(3):
        v = c.dit(c.at(c.x.zs, k), **{time_arg or "timestep": c.at(c.x.ts, k)})
        total = c.fn(operator.add, total, c.term(v, k))
    ctx = context(3, time_arg=time_arg)
    run(c.build(total), ctx, find_dit_calls, assign_windows, compute_weights)
    assert ctx.windows[0].time_arg == (time_arg or "timestep")


def test_compute_weights_refuses_calls_without_timestep_naming_step_and_node():
    c = Capture("zs", "ts", "gs")
    total = 0
    for k in range(3):
        total = c.fn(operator.add, total, c.term(c.dit(c.at(c.x.zs, k)), k))
    ctx = context(3)
    gm = run(c.build(total), ctx, find_dit_calls, assign_windows)
    with pytest.raises(JaggInputError, match=r"step 0 \(node dit_call\): the DiT call has no timestep argument 1"):
        compute_weights(gm, ctx)


def _mixed_time_window():
    """A window (built by hand: assign_windows cuts at the structure change) whose step 0 passes the
    timestep at position 1 and whose steps 1, 2 pass it as ``timestep=`` (position 1 is a guidance scale)."""
    c = Capture("zs", "ts", "gs", "guidance")
    total, calls = 0, []
    for k in range(3):
        t = c.at(c.x.ts, k)
        calls.append(c.dit(c.at(c.x.zs, k), t) if k == 0 else c.dit(c.at(c.x.zs, k), c.x.guidance, timestep=t))
        total = c.fn(operator.add, total, c.term(calls[-1], k))
    ctx = context(3)
    gm = run(c.build(total), ctx, find_dit_calls)
    ctx.windows = [Window(index=0, nodes=calls, steps=[0, 1, 2], mode="jagg")]
    return gm, ctx


def test_compute_weights_refuses_timestep_argument_that_differs_within_a_window():
    gm, ctx = _mixed_time_window()
    with pytest.raises(JaggInputError, match=r"node dit_call_1: timestep argument differs within window 0"):
        compute_weights(gm, ctx)


def test_assign_windows_never_builds_the_mixed_timestep_window():
    gm, ctx = _mixed_time_window()
    run(gm, ctx, assign_windows)
    assert [w.steps for w in ctx.windows] == [[0], [1, 2]]


# ----------------------------------------------------------------------------- rewrite_windows

def test_rewrite_windows_replaces_each_jagg_window_by_one_node_feeding_the_old_users():
    gm, trained = affine_loss(7, reference=True)
    ctx = context(3)
    run(gm, ctx, *ANALYSES)
    old = {CALL.of(c).step: ((c.args[1], c.args[2]), set(c.users)) for c in trained}
    gm = run(gm, ctx, rewrite_windows)
    windows = nodes_with(gm, jagg_window)
    assert [w.node for w in ctx.windows[:2]] == windows
    for w, node in zip(ctx.windows[:2], windows):
        plan = getattr(gm, node.args[2].target)
        assert isinstance(plan, WindowPlan) and plan.steps == tuple(w.steps) and plan.options.time_arg == 1
        assert node.args[0].target == "jagg_dit" and node.args[1] == tuple(old[k][0] for k in w.steps)
        outs = sorted(node.users, key=lambda u: u.args[1])
        assert w.nodes == list(node.users) and [u.args[1] for u in outs] == [0, 1, 2]
        for u, step in zip(outs, w.steps):
            assert u.target is operator.getitem and CALL.of(u).step == step and GRAD.of(u)
            assert set(u.users) == old[step][1]                    # the step's glue reads the window output
    remaining = [(CALL.of(c).step, CALL.of(c).role, c.kwargs.get("step")) for c in calls_of(gm)]
    assert remaining == [(None, "reference", None)] * 6 + [(6, "exact", 6), (None, "reference", None)]


@pytest.mark.parametrize("on_chord", [True, False])
def test_rewritten_graph_matches_original_on_the_chord_and_runs_jagg_off_it(on_chord):
    args = inputs(7, 3, on_chord=on_chord)
    original = loss_and_grad(affine_loss(7, reference=True)[0], *args)
    gm, _ = affine_loss(7, reference=True)
    ctx = context(3)
    rewritten = loss_and_grad(run(gm, ctx, *ANALYSES, rewrite_windows), *args)
    assert len(nodes_with(gm, jagg_window)) == 2
    if on_chord:                     # AffineJacobianField: J affine in (z, t), so JAGG is exact on the chord
        assert_same(rewritten, original, tol=1e-10)
    else:                            # values stay exact; the aggregated backward is now an approximation
        torch.testing.assert_close(rewritten[0], original[0], rtol=1e-12, atol=1e-12)
        diff = max((a - b).abs().max().item() for a, b in zip(rewritten[1], original[1]))
        assert diff > 1e-6


def test_rewrite_windows_makes_one_trajectory_node_for_routed_windows():
    gm, _ = affine_loss(8)
    ctx = context(3, routing=Routing(jagg_frac=0.5))
    gm = run(gm, ctx, *ANALYSES, rewrite_windows)
    (node,) = nodes_with(gm, jagg_trajectory)
    assert [len(w) for w in node.args[1]] == [3, 3] and [w.node for w in ctx.windows[:2]] == [node, node]
    assert sorted(CALL.of(u).step for u in node.users) == [0, 1, 2, 3, 4, 5]
    assert [c.kwargs.get("step") for c in calls_of(gm)] == [6, 7]


def test_rewrite_windows_lowmem_makes_every_window_one_lowmem_node():
    gm, _ = affine_loss(5)
    ctx = context(3, backward="lowmem")
    gm = run(gm, ctx, *ANALYSES, rewrite_windows)
    assert calls_of(gm) == [] and gm.jagg_lowmem_plan.num_windows == 2
    plans = [getattr(gm, n.args[2].target) for n in nodes_with(gm, jagg_lowmem_window)]
    assert all(isinstance(p, LowMemWindowPlan) for p in plans)
    assert [(p.steps, p.exact) for p in plans] == [((0, 1, 2), False), ((3, 4), True)]


# ----------------------------------------------------------------------------- cleanup

def test_cleanup_drops_dead_pure_nodes_and_keeps_nodes_with_effects():
    c = Capture("x", "y")
    c.modules["reward"] = nn.Linear(D, 1, dtype=F64)
    c.fn(torch.sin, c.fn(torch.neg, c.x.x))                              # dead pure chain
    c.dit(c.x.x, c.x.y)                                                  # an unused DiT call: runs hooks
    c.method("add_", c.x.x, 1.0)                                         # in place, result unused
    c.fn(operator.setitem, c.x.x, 0, 1.0)
    c.graph.call_module("reward", (c.x.x,))
    kept = {t for t in RUNTIME_TARGETS if t is not flatten_output}
    for target in sorted(RUNTIME_TARGETS, key=lambda t: t.__name__):
        c.fn(target, c.x.x)
    gm = run(c.build(c.x.y), context(), cleanup)
    survivors = {(n.op, n.target) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    assert survivors == {("get_attr", "jagg_dit"), ("call_method", "add_"), ("call_function", operator.setitem),
                         ("call_module", "reward")} | {("call_function", t) for t in kept}
    assert len(nodes_with(gm, dit_call)) == 2                            # the DiT call and the bare target


# ----------------------------------------------------------------------------- place_modes

def fact_graph(facts: list[tuple], stale_switches: dict[int, bool], stale_autocast: dict[int, object] = {}):
    """A chain x -> op_0 -> op_1 ... with the given (name, jagg_grad[, jagg_autocast]) facts and grad /
    autocast switches at the wrong places (autocast as Dynamo's region nodes: an enter at one index,
    its exit at the next one given)."""
    c = Capture("x")
    value = c.x.x
    regions = []
    for i, (name, grad, *autocast) in enumerate(facts):
        if i in stale_switches:
            c.fn(SET_GRAD_ENABLED, stale_switches[i])
        if i in stale_autocast:
            regions.append(c.fn(DYNAMO_ENTER_AUTOCAST, *stale_autocast[i])) if stale_autocast[i] else \
                c.fn(DYNAMO_EXIT_AUTOCAST, regions.pop())
        value = c.fn(getattr(torch, name), value)
        if grad is not None:
            GRAD.set(value, grad)
        AUTOCAST.set(value, autocast[0] if autocast else AUTOCAST_OFF)
    while regions:
        c.fn(DYNAMO_EXIT_AUTOCAST, regions.pop())
    return c.build(value)


@pytest.mark.parametrize("entry", [True, False])
def test_place_modes_puts_every_node_under_its_recorded_mode(entry):
    facts = [("neg", True), ("sin", True), ("cos", False), ("exp", False), ("tanh", True), ("sigmoid", False)]
    gm = fact_graph(facts, stale_switches={0: True, 1: False, 4: False})
    ctx = context()
    ctx.entry_grad = entry
    gm = run(gm, ctx, place_modes)
    assert_runs_in_recorded_modes(gm, entry)
    layout = [f"set({n.args[0]})" if is_grad_switch(n) else n.name for n in gm.graph.nodes][1:-1]
    expected = ["neg", "sin", "set(False)", "cos", "exp", "set(True)", "tanh", "set(False)", "sigmoid"]
    expected = expected + ["set(True)"] if entry else ["set(True)"] + expected
    assert layout == expected


BF16 = AutocastState((("cpu", torch.bfloat16),))


def test_place_modes_puts_every_node_under_its_recorded_autocast_state():
    """Dynamo's enter/exit region nodes sit at stale places: they are dropped and jaggc's absolute
    switches placed from the facts (the grad facts are all True: no grad switch)."""
    facts = [("neg", True), ("sin", True, BF16), ("cos", True, BF16), ("exp", True), ("tanh", True, BF16)]
    gm = fact_graph(facts, stale_switches={}, stale_autocast={0: ("cpu", torch.bfloat16, True, None), 2: ()})
    gm = run(gm, context(), place_modes)
    assert_runs_in_recorded_modes(gm)
    assert not [n for n in gm.graph.nodes if n.target in (DYNAMO_ENTER_AUTOCAST, DYNAMO_EXIT_AUTOCAST)]
    # fx stores the state as a plain tuple (graph constants are rebuilt from their elements)
    layout = [f"autocast({AutocastState(n.args[0]).describe()})" if n.target is set_autocast else n.name
              for n in gm.graph.nodes][1:-1]
    assert layout == ["neg", "autocast(cpu bfloat16)", "sin", "cos", "autocast(off)", "exp", "autocast(cpu bfloat16)",
                      "tanh", "autocast(off)"]
    x = torch.randn(4, 4)
    eager = torch.neg(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = torch.cos(torch.sin(eager))
    eager = torch.exp(eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = torch.tanh(eager)
    torch.testing.assert_close(gm(x), eager, rtol=0, atol=0)


def test_place_modes_refuses_a_node_without_grad_fact():
    gm = fact_graph([("neg", True), ("sin", None)], stale_switches={})
    with pytest.raises(JaggInternalError, match=r"node sin \(.*\) has no grad-mode or autocast fact"):
        place_modes(gm, context())


def test_place_modes_keeps_a_no_grad_diagnostic_moved_by_the_rewrite_without_grad():
    """``with torch.no_grad(): d = v_0.norm()`` reads step 0's output; the rewrite moves it below the
    window node, past its switches, so it would run with grad until the switches are rebuilt."""
    c = Capture("zs", "ts", "gs")
    total, diagnostics = 0, []
    for k in range(3):
        v = c.dit(c.at(c.x.zs, k), c.at(c.x.ts, k))
        with c.no_grad():
            diagnostics.append(c.method("norm", v))
        total = c.fn(operator.add, total, c.term(v, k))
    gm, ctx = c.build((total, diagnostics[0])), context(3)
    gm = run(gm, ctx, *ANALYSES, rewrite_windows, cleanup)
    with pytest.raises(AssertionError, match="norm runs with grad True"):
        assert_runs_in_recorded_modes(gm)
    assert gm(*inputs(3, 3))[1].requires_grad                            # the stale switches: it runs with grad
    gm = run(gm, ctx, place_modes)
    assert_runs_in_recorded_modes(gm)
    loss, d = gm(*inputs(3, 3))
    assert loss.requires_grad and not d.requires_grad


# ----------------------------------------------------------------------------- place_lowmem_terms

def policy_kl_loss(n: int, beta: float = 0.1):
    """Flow-GRPO's shape: ``total = total + (policy_k + beta * kl_k)``, then ``total / n``."""
    c = Capture("zs", "ts", "gs")
    total = 0
    for k in range(n):
        v = c.dit(c.at(c.x.zs, k), c.at(c.x.ts, k))
        kl = c.method("sum", c.fn(operator.mul, v, v))
        total = c.fn(operator.add, total, c.fn(operator.add, c.term(v, k), c.fn(operator.mul, beta, kl)))
    return c.build(c.fn(operator.truediv, total, n))


def test_place_lowmem_terms_marks_each_per_step_term_with_window_position_and_coefficient():
    gm, ctx = policy_kl_loss(5), context(3, backward="lowmem")
    gm = run(gm, ctx, *ANALYSES, rewrite_windows, place_lowmem_terms)
    terms = nodes_with(gm, jagg_lowmem_term)
    assert len(terms) == 10
    for t in terms:
        root, _, window, position, coef, name = t.args
        assert list(root.users) == [t] and name == root.name and root.target == "sum"
        assert t.prev.op == "get_attr" and t.prev.prev is root                # right after it (and its plan)
        out, other = root.args[0].args                                   # (v * gs[k]).sum() or (v * v).sum()
        assert coef == pytest.approx(0.1 / 5 if other is out else 1 / 5)
        assert (window, position) == (CALL.of(out).window, out.args[1])
    (output,) = nodes_with(gm, jagg_lowmem_output)
    assert gm.graph.output_node().args[0] is output and output.args[0].target is operator.truediv
    first, second = nodes_with(gm, jagg_lowmem_window)
    plans = [getattr(gm, n.args[2].target) for n in (first, second)]
    assert [(p.terms, p.last) for p in plans] == [({0: 2, 1: 2, 2: 2}, False), ({0: 2, 1: 2}, True)]
    assert set(second.args[3]) == {t for t in terms if t.args[2] == 0}    # window 1 runs after window 0's terms
    assert any("10 per-step terms" in note for note in ctx.notes)


def test_place_lowmem_terms_graph_matches_original_loss_and_gradient():
    args = inputs(5, 3)
    original = loss_and_grad(policy_kl_loss(5), *args)
    gm, ctx = policy_kl_loss(5), context(3, backward="lowmem")
    gm = run(gm, ctx, *ANALYSES, rewrite_windows, place_lowmem_terms, cleanup, place_modes)
    assert_same(loss_and_grad(gm, *args), original, tol=1e-10)


def _lowmem_refusal(build):
    c = Capture("zs", "ts", "gs", "w")
    vs = [c.dit(c.at(c.x.zs, k), c.at(c.x.ts, k)) for k in range(3)]
    gm, ctx = c.build(build(c, vs)), context(3, backward="lowmem")
    return run(gm, ctx, *ANALYSES, rewrite_windows), ctx


def test_place_lowmem_terms_refuses_a_node_combining_steps_otherwise_than_by_sums():
    gm, ctx = _lowmem_refusal(lambda c, vs: c.method("mean", c.fn(torch.stack, [c.term(v, k) for k, v in
                                                                                   enumerate(vs)])))
    with pytest.raises(JaggGraphError, match=r"node mean: .*this node combines 3 steps' outputs"):
        place_lowmem_terms(gm, ctx)


def test_place_lowmem_terms_refuses_a_tensor_coefficient_naming_the_node():
    def build(c, vs):
        total = c.fn(operator.add, c.term(vs[0], 0), c.fn(operator.add, c.term(vs[1], 1), c.term(vs[2], 2)))
        return c.fn(operator.mul, total, c.x.w)
    gm, ctx = _lowmem_refusal(build)
    with pytest.raises(JaggGraphError, match=r"node mul_3: .*this mul scales them by a tensor"):
        place_lowmem_terms(gm, ctx)


def test_place_lowmem_terms_refuses_a_term_reading_another_trainable_input():
    def build(c, vs):
        REQUIRES_GRAD.set(c.x.w, True)                          # as the FX frontend records it
        total = 0
        for k, v in enumerate(vs):
            total = c.fn(operator.add, total, c.term(c.fn(operator.mul, v, c.x.w) if k == 1 else v, k))
        return total
    gm, ctx = _lowmem_refusal(build)
    with pytest.raises(JaggGraphError, match=r"node sum_2: this term of the loss also depends on the input w"):
        place_lowmem_terms(gm, ctx)
