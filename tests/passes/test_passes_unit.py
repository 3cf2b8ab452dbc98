"""Each analysis pass (and the CFG batch split) on a small fx graph built by hand, for the invariant
its module docstring states. The graphs look like the FX frontend's captures (see
``jaggc.explain(...).stages[0].code``): one placeholder per loss input, a ``get_attr`` of the DiT per
call, ``dit_call(module, args, kwargs)``, ``_set_grad_enabled`` switches around ``torch.no_grad()``
blocks, no example values (Dynamo's captures carry ``meta["example_value"]``; the placement test
supplies them). A pass runs with only the passes whose ``node.meta`` facts it reads.

Covered here:
  * check_frontend: a canonical graph passes; a DiT call not taking its module from ``get_attr``,
    and the DiT left as a ``call_module`` node, are refused naming the node.
  * split_cfg_batches: a ``[uncond; cond]`` call whose uncond chunk is only detached becomes a
    no-grad call and a trained call on ``batch_chunk`` slices (value and gradient unchanged); a call
    whose chunks all carry gradient, or with ``split_batches=False``, is left alone.
  * find_dit_calls: grad mode on every node, consecutive steps for trained calls, "reference" for
    no-grad calls, "other" for other modules; refusals (no call, only no-grad calls, two trained
    modules, a mis-placed input seen through example values) name what is wrong.
  * check_independence: an input computed from an earlier output is refused naming both steps and
    the path; detached or no-grad dataflow is accepted.
  * assign_windows: windows of W with a shorter tail (exact at <= 2 steps), spanning reference calls,
    cut at a change of call structure, one window set per CFG stream; modes under jagg_frac/routing;
    refusals for a window larger than the calls or fewer than 2 trained calls; the report notes every
    cut, also one that keeps the window count.

tests/passes/test_passes_unit_rewrite.py covers compute_weights, rewrite_windows, cleanup, place_modes
and place_lowmem_terms, with numerics.
"""

from __future__ import annotations

import contextlib
import operator
from types import SimpleNamespace

import pytest
import torch
from torch import fx, nn

from jaggc._compat import SET_GRAD_ENABLED
from jaggc.errors import JaggGraphError, JaggInputError
from jaggc.graph_ops import batch_chunk, dit_call
from jaggc.node_meta import CALL, GRAD
from jaggc.passes import (CompileConfig, PassContext, assign_windows, check_frontend, check_independence,
                          find_dit_calls, split_cfg_batches)
from jaggc.passes.modes import is_grad_switch
from jaggc.passes import tag_modes
from jaggc.runtime.routing import Routing
from jaggc.runtime.window import WindowOptions, partition
from jaggc.verify.fields import AffineJacobianField

D, B = 3, 2
F64 = torch.float64


# ----------------------------------------------------------------------------- graph building

class Capture:
    """An fx graph written the way the FX frontend records a loss."""

    def __init__(self, *inputs: str, dit: nn.Module | None = None):
        self.graph = fx.Graph()
        self.modules = {"jagg_dit": dit if dit is not None else AffineJacobianField(D, seed=0)}
        self.x = SimpleNamespace(**{name: self.graph.placeholder(name) for name in inputs})

    def fn(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def method(self, name: str, *args) -> fx.Node:
        return self.graph.call_method(name, args)

    def at(self, value: fx.Node, k) -> fx.Node:
        return self.fn(operator.getitem, value, k)

    def dit(self, *args, module: str = "jagg_dit", **kwargs) -> fx.Node:
        """``dit(*args, **kwargs)`` as the frontends canonicalise it."""
        return self.fn(dit_call, self.graph.get_attr(module), tuple(args), dict(kwargs))

    @contextlib.contextmanager
    def no_grad(self):
        self.fn(SET_GRAD_ENABLED, False)
        yield
        self.fn(SET_GRAD_ENABLED, True)

    def term(self, v: fx.Node, k: int) -> fx.Node:
        """Step k's loss term ``(v * gs[k]).sum()``."""
        return self.method("sum", self.fn(operator.mul, v, self.at(self.x.gs, k)))

    def build(self, out) -> fx.GraphModule:
        self.graph.output(out)
        root = nn.Module()
        for name, module in self.modules.items():
            setattr(root, name, module)
        return fx.GraphModule(root, self.graph)


def affine_loss(n: int, *, reference: bool = False, kwargs_from: int | None = None):
    """``sum_k (dit(zs[k], ts[k]) * gs[k]).sum()`` (``0 + s_0 + s_1 ...``, as FX records ``sum``).
    ``reference``: each step subtracts a no-grad ``dit(zs[k], ts[k])``; ``kwargs_from``: calls from
    that step on pass ``scale=2.0`` (another call structure). Returns (gm, trained calls)."""
    c = Capture("zs", "ts", "gs")
    total, calls = 0, []
    for k in range(n):
        extra = {"scale": 2.0} if kwargs_from is not None and k >= kwargs_from else {}
        v = c.dit(c.at(c.x.zs, k), c.at(c.x.ts, k), **extra)
        calls.append(v)
        if reference:
            with c.no_grad():
                ref = c.dit(c.at(c.x.zs, k), c.at(c.x.ts, k))
            v = c.fn(operator.sub, v, ref)
        total = c.fn(operator.add, total, c.term(v, k))
    return c.build(total), calls


def cfg_loss(n: int, *, detach_uncond: bool = True):
    """Flow-GRPO's one-call CFG: ``u, c = dit(cat[z, z], cat[t, t]).chunk(2)``, ``u.detach() + 2 (c - u.detach())``."""
    c = Capture("zs", "ts", "gs")
    total = 0
    for k in range(n):
        z, t = c.at(c.x.zs, k), c.at(c.x.ts, k)
        out = c.dit(c.fn(torch.cat, [z, z]), c.fn(torch.cat, [t, t]))
        chunk = c.method("chunk", out, 2)
        uncond, cond = c.at(chunk, 0), c.at(chunk, 1)
        u = c.method("detach", uncond) if detach_uncond else uncond
        guided = c.fn(operator.add, u, c.fn(operator.mul, 2.0, c.fn(operator.sub, cond, u)))
        total = c.fn(operator.add, total, c.term(guided, k))
    return c.build(total)


def inputs(n: int, window: int, *, seed: int = 0, on_chord: bool = True):
    """(zs, ts, gs) in float64 with decreasing per-sample timesteps; ``on_chord``: each window's
    states on the chord of its end states by t (where JAGG is exact for AffineJacobianField)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.95, 0.2, n, dtype=F64)
    ts = torch.stack([t, 0.9 * t], 1)
    zs = torch.randn(n, B, D, generator=g, dtype=F64)
    for idx in partition(n, window) if on_chord else []:
        a, b = idx[0], idx[-1]
        if b > a + 1:
            alpha = ((ts[idx] - ts[a]) / (ts[b] - ts[a]))[..., None]
            zs[idx] = (1 - alpha) * zs[a] + alpha * zs[b]
    return zs, ts, torch.randn(n, B, D, generator=g, dtype=F64)


def context(window: int = 3, *, backward: str = "joint", dit=None, **config) -> PassContext:
    """The context jagg_compile builds (jaggc/api.py ``_rewrite``)."""
    options = WindowOptions(weights=config.pop("weights", "t"), time_arg=config.pop("time_arg", None), backward=backward)
    return PassContext(config=CompileConfig(window=window, options=options, **config), dit=dit, frontend="fx")


def run(gm: fx.GraphModule, ctx: PassContext, *passes) -> fx.GraphModule:
    """The named passes, each followed by its ensures; the modes tagged first where a pass needs
    them and the test has not set them by hand (DEFAULT_PASSES names tag_modes where it runs)."""
    for p in passes:
        if "modes" in p.requires and not any(GRAD.on(n) for n in gm.graph.nodes):
            gm = tag_modes(gm, ctx)
        gm = p(gm, ctx)
        p.ensures(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm


def calls_of(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is dit_call]


def sites(gm: fx.GraphModule) -> list[tuple]:
    return [(s.step, s.role, s.window) for s in (CALL.of(n) for n in calls_of(gm))]


def loss_and_grad(gm: fx.GraphModule, *args):
    loss = gm(*args)
    return loss.detach(), torch.autograd.grad(loss, list(gm.jagg_dit.parameters()))


def assert_same(a, b, tol=1e-12):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- check_frontend

def test_check_frontend_accepts_canonical_calls_and_other_leaf_modules():
    c = Capture("zs", "ts", "gs")
    c.modules["reward"] = nn.Linear(D, 1, dtype=F64)
    v = c.dit(c.at(c.x.zs, 0), c.at(c.x.ts, 0))
    gm = c.build(c.graph.call_module("reward", (v,)))
    before = [(n, n.args) for n in gm.graph.nodes]
    assert check_frontend(gm, context(dit=gm.jagg_dit)) is gm
    assert [(n, n.args) for n in gm.graph.nodes] == before


def test_check_frontend_refuses_dit_call_whose_module_is_not_get_attr():
    c = Capture("dit", "zs", "ts")
    c.fn(dit_call, c.x.dit, (c.at(c.x.zs, 0), c.at(c.x.ts, 0)), {})
    with pytest.raises(JaggGraphError, match=r"node dit_call: a DiT call must take its module from get_attr"):
        check_frontend(c.build(None), context())


def test_check_frontend_refuses_dit_left_as_call_module():
    c = Capture("zs", "ts")
    c.graph.call_module("jagg_dit", (c.at(c.x.zs, 0), c.at(c.x.ts, 0)))
    gm = c.build(None)
    with pytest.raises(JaggGraphError, match=r"node jagg_dit: the DiT is still a call_module node"):
        check_frontend(gm, context(dit=gm.jagg_dit))


# ----------------------------------------------------------------------------- split_cfg_batches

def test_split_cfg_batches_runs_detached_uncond_half_without_grad():
    gm, ctx = cfg_loss(2), context()
    original = loss_and_grad(cfg_loss(2), *inputs(2, 2))
    gm = run(gm, ctx, split_cfg_batches)
    nodes = list(gm.graph.nodes)
    assert not [n for n in nodes if n.op == "call_method" and n.target == "chunk"]
    calls = calls_of(gm)
    assert len(calls) == 4                                     # per step: no-grad uncond, trained cond
    for ref, trained in zip(calls[::2], calls[1::2]):
        assert [a.target for a in ref.args[1]] == [batch_chunk] * 2 and [a.args[3] for a in ref.args[1]] == [0, 0]
        assert [a.args[3] for a in trained.args[1]] == [1, 1]
        off, on = nodes[nodes.index(ref.args[1][0]) - 1], nodes[nodes.index(ref) + 1]
        assert is_grad_switch(off) and off.args == (False,) and is_grad_switch(on) and on.args == (True,)
        assert not GRAD.of(ref) and not any(GRAD.of(a) for a in ref.args[1])
        assert GRAD.of(trained) and {u.target for u in ref.users} == {"detach"}
        assert operator.sub in {u.target for u in trained.users}
    assert [(s.chunks, s.no_grad) for s in ctx.splits] == [(2, (0,)), (2, (0,))]
    assert_same(loss_and_grad(gm, *inputs(2, 2)), original)
    assert sites(run(gm, ctx, find_dit_calls)) == [(None, "reference", None), (0, None, None),
                                                   (None, "reference", None), (1, None, None)]


@pytest.mark.parametrize("detach_uncond, split_batches", [(False, True), (True, False)])
def test_split_cfg_batches_leaves_calls_alone_when_every_chunk_has_gradient_or_disabled(detach_uncond, split_batches):
    gm = cfg_loss(2, detach_uncond=detach_uncond)
    before = [(n, n.target, n.args) for n in gm.graph.nodes]
    ctx = context(split_batches=split_batches)
    run(gm, ctx, split_cfg_batches)
    assert [(n, n.target, n.args) for n in gm.graph.nodes] == before and ctx.splits == []


# ----------------------------------------------------------------------------- find_dit_calls

def test_find_dit_calls_tags_trained_steps_references_and_grad_mode():
    gm = run(affine_loss(3, reference=True)[0], context(), find_dit_calls)
    assert sites(gm) == [(0, None, None), (None, "reference", None), (1, None, None), (None, "reference", None),
                         (2, None, None), (None, "reference", None)]
    assert [CALL.of(n).index for n in calls_of(gm)] == list(range(6))
    assert all(CALL.of(n).grad_enabled == GRAD.of(n) for n in calls_of(gm))
    mode = True                                                  # replay the switches: every node tagged
    for n in gm.graph.nodes:
        mode = n.args[0] if is_grad_switch(n) else mode
        assert GRAD.of(n) is mode, n.name


def test_find_dit_calls_entry_mode_no_grad_makes_calls_before_enable_grad_references():
    c = Capture("zs", "ts", "gs")
    c.dit(c.at(c.x.zs, 0), c.at(c.x.ts, 0))
    c.fn(SET_GRAD_ENABLED, True)
    v = c.dit(c.at(c.x.zs, 1), c.at(c.x.ts, 1))
    ctx = context()
    ctx.entry_grad = False
    gm = run(c.build(c.term(v, 1)), ctx, find_dit_calls)
    assert sites(gm) == [(None, "reference", None), (0, None, None)]


def test_find_dit_calls_marks_other_modules_other_when_the_dit_is_given():
    dit = AffineJacobianField(D, seed=0)
    c = Capture("zs", "ts", "gs", dit=dit)
    c.modules["jagg_dit_1"] = AffineJacobianField(D, seed=1)      # a second module argument (a reward model)
    v = c.dit(c.at(c.x.zs, 0), c.at(c.x.ts, 0))
    r = c.dit(v, c.at(c.x.ts, 0), module="jagg_dit_1")
    gm = run(c.build(c.term(r, 0)), context(dit=dit), find_dit_calls)
    assert sites(gm) == [(0, None, None), (None, "other", None)]


def test_find_dit_calls_refuses_two_trained_modules_without_dit_given():
    c = Capture("zs", "ts", "gs")
    c.modules["jagg_dit_1"] = AffineJacobianField(D, seed=1)
    v = c.dit(c.at(c.x.zs, 0), c.at(c.x.ts, 0))
    r = c.dit(v, c.at(c.x.ts, 0), module="jagg_dit_1")
    with pytest.raises(JaggGraphError, match=r"2 module arguments with grad \(AffineJacobianField \(jagg_dit, 1 calls\), "
                                             r"AffineJacobianField \(jagg_dit_1, 1 calls\)\).*dit=model\)"):
        run(c.build(c.term(r, 0)), context(), find_dit_calls)


def test_find_dit_calls_leaves_a_loss_without_trained_dit_call_as_it_is():
    """No DiT call (an empty trajectory) or only no-grad calls: nothing to rewrite, a note says so,
    and the calls stay plain reference calls (the loss runs as written)."""
    c = Capture("zs", "ts", "gs")
    ctx = context()
    gm = run(c.build(c.method("sum", c.x.zs)), ctx, find_dit_calls)
    assert ctx.trained_calls(gm) == [] and "no DiT call (watched: none): nothing to rewrite" in ctx.notes[0]
    c = Capture("zs", "ts", "gs")
    with c.no_grad():
        v = c.dit(c.at(c.x.zs, 0), c.at(c.x.ts, 0))
    ctx = context()
    gm = run(c.build(c.term(v, 0)), ctx, find_dit_calls)
    assert ctx.trained_calls(gm) == [] and "only called without grad" in ctx.notes[0]
    assert [CALL.of(n).role for n in ctx.dit_calls(gm)] == ["reference"]


def test_find_dit_calls_checks_placement_from_example_values_naming_the_step():
    """Dynamo's captures carry example values: a float32 state for a float64 DiT is refused at
    the step that takes it (the FX frontend's graphs have none and are checked at run time)."""
    gm, calls = affine_loss(3)
    zs, ts, _ = inputs(3, 3)
    for k, call in enumerate(calls):
        z, t = call.args[1]
        z.meta["example_value"] = zs[k].float() if k == 1 else zs[k]
        t.meta["example_value"] = ts[k]
    with pytest.raises(JaggInputError, match=r"step 1, input .*the state is torch.float32 but the DiT's "
                                             r"parameters are torch.float64"):
        run(gm, context(), find_dit_calls)


# ----------------------------------------------------------------------------- check_independence

def euler_loss(n: int, *, cut: str | None):
    """Step k's state is zs[k] + 0.1 * (step k-1's output), passed through ``cut`` ("detach", "no_grad" or None)."""
    c = Capture("zs", "ts", "gs")
    total, v = 0, None
    for k in range(n):
        z = c.at(c.x.zs, k)
        if v is not None:
            if cut == "no_grad":
                with c.no_grad():
                    z = c.fn(operator.add, z, c.fn(operator.mul, v, 0.1))
            else:
                z = c.fn(operator.add, z, c.fn(operator.mul, c.method("detach", v) if cut == "detach" else v, 0.1))
        v = c.dit(z, c.at(c.x.ts, k))
        total = c.fn(operator.add, total, c.term(v, k))
    return c.build(total)


def test_check_independence_refuses_input_computed_from_earlier_output_naming_both_steps():
    gm, ctx = euler_loss(3, cut=None), context()
    run(gm, ctx, find_dit_calls)
    with pytest.raises(JaggGraphError, match=r"step 1 \(node dit_call_1, no source line\) takes an input that "
                                             r"depends on the output of step 0 \(node dit_call\) through "
                                             r"dit_call -> mul_1 -> add_1 -> dit_call_1\. JAGG needs stored"):
        check_independence(gm, ctx)


def test_check_independence_names_the_earliest_step_reaching_a_later_one():
    c = Capture("zs", "ts", "gs")
    v0 = c.dit(c.at(c.x.zs, 0), c.at(c.x.ts, 0))
    v1 = c.dit(c.at(c.x.zs, 1), c.at(c.x.ts, 1))
    v2 = c.dit(c.fn(operator.add, v0, v1), c.at(c.x.ts, 2))
    gm, ctx = c.build(c.term(v2, 2)), context()
    run(gm, ctx, find_dit_calls)
    with pytest.raises(JaggGraphError, match=r"step 2 \(node dit_call_2.*output of step 0 \(node dit_call\)"):
        check_independence(gm, ctx)


@pytest.mark.parametrize("cut", ["detach", "no_grad"])
def test_check_independence_accepts_states_detached_or_computed_without_grad(cut):
    gm, ctx = euler_loss(3, cut=cut), context()
    assert check_independence(run(gm, ctx, find_dit_calls), ctx) is gm


# ----------------------------------------------------------------------------- assign_windows

def windows_of(ctx: PassContext) -> list[tuple[list[int], str]]:
    return [(w.steps, w.mode) for w in ctx.windows]


@pytest.mark.parametrize("n, expected", [
    (7, [([0, 1, 2], "jagg"), ([3, 4, 5], "jagg"), ([6], "exact")]),
    (5, [([0, 1, 2], "jagg"), ([3, 4], "exact")]),
])
def test_assign_windows_cuts_consecutive_steps_into_windows_of_w_with_shorter_tail(n, expected):
    gm, trained = affine_loss(n)
    ctx = context(3)
    run(gm, ctx, find_dit_calls, assign_windows)
    assert windows_of(ctx) == expected
    assert [w.nodes for w in ctx.windows] == [[trained[k] for k in steps] for steps, _ in expected]
    for w in ctx.windows:
        assert [CALL.of(n).window for n in w.nodes] == [w.index] * len(w.nodes)
        assert {CALL.of(n).role for n in w.nodes} == {"interior" if w.mode == "jagg" else "exact"}


def test_assign_windows_spans_reference_calls_and_leaves_them_out():
    gm, _ = affine_loss(3, reference=True)
    ctx = context(3)
    run(gm, ctx, find_dit_calls, assign_windows)
    assert windows_of(ctx) == [([0, 1, 2], "jagg")]
    refs = [n for n in calls_of(gm) if CALL.of(n).step is None]
    assert len(refs) == 3 and all(CALL.of(n).window is None for n in refs)
    assert not any(ref in w.nodes for w in ctx.windows for ref in refs)


@pytest.mark.parametrize("n, window, cut, expected", [
    (6, 4, 3, [([0, 1, 2], "jagg"), ([3, 4, 5], "jagg")]),                    # not [0..3], [4, 5]
    (6, 3, 4, [([0, 1, 2], "jagg"), ([3], "exact"), ([4, 5], "exact")]),
])
def test_assign_windows_cuts_runs_where_the_call_structure_changes(n, window, cut, expected):
    gm, _ = affine_loss(n, kwargs_from=cut)            # from step `cut` on, calls pass scale=2.0
    ctx = context(window)
    run(gm, ctx, find_dit_calls, assign_windows)
    assert windows_of(ctx) == expected
    if len(expected) > len(partition(n, window)):
        assert any("windows were cut" in note for note in ctx.notes)


def test_assign_windows_notes_every_cut_at_a_structure_change():
    gm, _ = affine_loss(6, kwargs_from=3)
    ctx = context(4)
    run(gm, ctx, find_dit_calls, assign_windows)
    assert any("windows were cut" in note for note in ctx.notes)


def test_assign_windows_never_mixes_cfg_streams():
    """Two calls per sampling step on the same state and timestep (uncond, then cond)."""
    c = Capture("zs", "ts", "gs", "null", "emb")
    total = 0
    for k in range(6):
        z, t = c.at(c.x.zs, k), c.at(c.x.ts, k)
        u = c.dit(z, t, encoder_hidden_states=c.x.null)
        v = c.dit(c.at(c.x.zs, k), c.at(c.x.ts, k), encoder_hidden_states=c.x.emb)   # same value, new nodes
        total = c.fn(operator.add, total, c.term(c.fn(operator.sub, v, u), k))
    ctx = context(3)
    run(c.build(total), ctx, find_dit_calls, assign_windows)
    assert windows_of(ctx) == [([0, 2, 4], "jagg"), ([6, 8, 10], "jagg"), ([1, 3, 5], "jagg"), ([7, 9, 11], "jagg")]
    assert any("one window per stream" in note for note in ctx.notes)


@pytest.mark.parametrize("config, mode", [({"routing": Routing(jagg_frac=0.0)}, "exact"),
                                          ({"routing": Routing(jagg_frac=0.5)}, "routed")])
def test_assign_windows_mode_follows_jagg_frac_and_routing(config, mode):
    gm, _ = affine_loss(5)
    ctx = context(3, **config)
    run(gm, ctx, find_dit_calls, assign_windows)
    assert windows_of(ctx) == [([0, 1, 2], mode), ([3, 4], "exact")]


@pytest.mark.parametrize("n, window, expected", [
    (3, 4, [([0, 1, 2], "jagg")]),     # window is the largest window: 3 calls make one of 3
    (2, 4, [([0, 1], "exact")]),
    (1, 2, [([0], "exact")]),          # one call: nothing to aggregate, it runs exactly
])
def test_assign_windows_fits_windows_to_the_calls_there_are(n, window, expected):
    gm, _ = affine_loss(n)
    ctx = context(window)
    run(gm, ctx, find_dit_calls, assign_windows)
    assert windows_of(ctx) == expected


def test_assign_windows_refuses_a_window_below_two():
    gm, _ = affine_loss(3)
    ctx = context(1)
    run(gm, ctx, find_dit_calls)
    with pytest.raises(JaggInputError, match=r"window=1: a JAGG window needs an int of at least 2 steps"):
        assign_windows(gm, ctx)
