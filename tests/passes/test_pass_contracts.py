"""The passes' contracts (passes/infra.py): every pass declares what it requires and provides and
has an executable ``ensures``; the pipeline's order is checked from the declarations; an ensures
fails on a graph that breaks its invariant. (conftest.py runs every ensures in every compile.)"""

from __future__ import annotations

import os

import pytest
import torch

import jaggc
from jaggc.errors import JaggInternalError
from jaggc.graph_ops import set_autocast
from jaggc.node_meta import CALL, FACTS
from jaggc.passes import DEFAULT_PASSES, GraphPass, check_order, passes_for
from jaggc.passes import infra, pipeline
from jaggc.passes.infra import RUNNABLE, Fact
from jaggc.verify.fields import AffineJacobianField


def _loss(dit, zs, ts, gs):
    return sum((dit(zs[k], ts[k]) * gs[k]).sum() for k in range(zs.shape[0]))


def _inputs(T=6, B=2, D=3):
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    return (torch.randn(T, B, D, generator=g, dtype=torch.float64), torch.stack([t, 0.9 * t], 1),
            torch.randn(T, B, D, generator=g, dtype=torch.float64))


def test_every_pass_declares_its_contract_and_has_an_ensures():
    for p in DEFAULT_PASSES:
        assert isinstance(p, GraphPass)
        assert p.provides, p.__name__
        assert p.ensures is not infra._nothing, f"{p.__name__} has no ensures"
        # a docstring that says what the pass does: a sentence of its own, not the module's name
        doc = (p.__doc__ or "").strip()
        assert len(doc.split()) >= 5 and doc.split()[0] != p.__name__, f"{p.__name__}: no docstring saying what it does"


def test_the_suite_runs_every_ensures():
    assert os.environ.get(pipeline.CHECK_ENV) == "1"


def test_the_default_order_meets_every_requirement_and_a_wrong_order_is_refused():
    check_order(DEFAULT_PASSES)
    order = list(DEFAULT_PASSES)
    swapped = [p for p in order if p is not jaggc.passes.assign_windows]
    swapped.insert(swapped.index(jaggc.passes.find_dit_calls), jaggc.passes.assign_windows)
    with pytest.raises(JaggInternalError, match=r"pass assign_windows requires \['dit_calls'"):
        check_order(swapped)
    # the CFG split adds calls the first tagging never saw: without the second tag_modes the
    # order is refused
    second = [i for i, p in enumerate(order) if p is jaggc.passes.tag_modes][1]
    with pytest.raises(JaggInternalError, match=r"pass find_dit_calls requires \['modes'\]"):
        check_order(order[:second] + order[second + 1:])


def _moved(order, mover, before):
    order = [p for p in order if p is not mover]
    order.insert(order.index(before), mover)
    return order


def test_cleanup_before_the_rewrite_is_refused_by_check_order_and_by_run_passes():
    moved = _moved(DEFAULT_PASSES, jaggc.passes.cleanup, jaggc.passes.rewrite_windows)
    with pytest.raises(JaggInternalError, match=r"pass cleanup requires \['lowmem_terms', 'rewritten'\]"):
        check_order(moved)
    model = AffineJacobianField(3, seed=1)
    compiled = jaggc.jagg_compile(_loss, window=3)
    compiled(model, *_inputs())
    ctx = jaggc.passes.PassContext(config=compiled.config, dit=model, frontend="fx")
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    code = gm.code
    with pytest.raises(JaggInternalError, match=r"pass cleanup requires"):
        pipeline.run_passes(gm, ctx, passes=moved)
    assert gm.code == code                      # refused before any pass ran
    # mode placement before the cleanup, and an order that stops before the graph is runnable
    with pytest.raises(JaggInternalError, match=r"pass place_modes requires \['clean'\]"):
        check_order(_moved(DEFAULT_PASSES, jaggc.passes.place_modes, jaggc.passes.cleanup))
    with pytest.raises(JaggInternalError, match=r"end without \['clean', 'placed_modes'\]"):
        pipeline.run_passes(gm, ctx, passes=DEFAULT_PASSES[:-3])


def test_every_provided_fact_is_required_later_or_by_the_runnable_graph():
    for i, p in enumerate(DEFAULT_PASSES):
        later = set(RUNNABLE).union(*(q.requires for q in DEFAULT_PASSES[i + 1:]))
        assert p.provides <= later, f"{p.__name__} provides {sorted(p.provides - later)}, which nothing requires"
    assert all(isinstance(f, Fact) for p in DEFAULT_PASSES for f in p.requires | p.provides | p.invalidates)
    with pytest.raises(ValueError):
        infra.graph_pass(provides={"not_a_fact"})(lambda gm, ctx: gm)      # a misspelt fact fails at import


def test_requires_are_checked_while_the_passes_run():
    infra.check_requires(jaggc.passes.cleanup, {Fact.REWRITTEN, Fact.LOWMEM_TERMS})
    with pytest.raises(JaggInternalError, match=r"pass cleanup requires \['lowmem_terms'\], which do not hold"):
        infra.check_requires(jaggc.passes.cleanup, {Fact.REWRITTEN})


def test_the_low_memory_pass_applies_only_in_its_mode():
    config = jaggc.jagg_compile(_loss).config
    ctx = jaggc.passes.PassContext(config=config)
    assert jaggc.passes.place_lowmem_terms not in passes_for(ctx)
    ctx = jaggc.passes.PassContext(config=jaggc.jagg_compile(_loss, backward="lowmem").config)
    assert jaggc.passes.place_lowmem_terms in passes_for(ctx)


@pytest.mark.parametrize("backward", ["joint", "per_window", "lowmem"])
def test_every_ensures_holds_on_a_real_compile(backward):
    model = AffineJacobianField(3, seed=1)
    compiled = jaggc.jagg_compile(_loss, window=3, backward=backward,
                                  options=jaggc.Options(check_passes=True))
    compiled(model, *_inputs()).backward()
    assert compiled.report.path == "fx"


def test_an_ensures_fails_on_a_broken_graph():
    """Break what a pass promised and its ensures names it."""
    model = AffineJacobianField(3, seed=1)
    compiled = jaggc.jagg_compile(_loss, window=3)
    compiled(model, *_inputs())
    gm = compiled.report.graph_module
    ctx = jaggc.passes.PassContext(config=compiled.config, dit=model, frontend="fx")
    # place_modes: a switch to the mode already in force
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_before(first):
        extra = gm.graph.call_function(set_autocast, (ctx.entry_autocast,))
    for fact in FACTS:
        if fact.on(first):
            fact.set(extra, fact.of(first))
    with pytest.raises(JaggInternalError, match="place_modes broke its invariant"):
        jaggc.passes.place_modes.ensures(gm, ctx)
    gm.graph.erase_node(extra)
    # cleanup: a dead node
    with gm.graph.inserting_before(first):
        gm.graph.call_function(torch.add, (1, 2))
    with pytest.raises(JaggInternalError, match="cleanup broke its invariant"):
        jaggc.passes.cleanup.ensures(gm, ctx)


def test_a_missing_fact_names_the_node_and_its_writer():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    node = next(iter(gm.graph.nodes))
    with pytest.raises(JaggInternalError, match=r"node x has no jagg_call .* find_dit_calls writes it"):
        CALL.of(node)
    assert CALL.get(node) is None and not CALL.on(node)
