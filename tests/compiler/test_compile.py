"""``@jagg_compile`` end to end: values, gradients, pass counts, caching and the report.

What is checked:
  * on every built-in example loss (``jaggc_studies.example_losses``: Flow-GRPO SD3, DanceGRPO Flux with
    ``.sample``, CFG-doubled SD3 with a detached unconditional half, SD3 with a no-grad KL
    reference call), captured by Dynamo:
      - the loss value is bit-identical to the undecorated function with ``interior_chunk=1,
        batch_knots=False`` and allclose in the default (batched) mode;
      - W=2 and ``jagg_frac=0`` give the exact gradient;
      - at W=4 the compiled gradient equals a runtime-level JAGG gradient built by hand: the
        same loss function is first run with a recording stand-in for the DiT, the recorded
        grad-enabled calls are run through ``jaggc.runtime.run_window``, and the loss is run
        again with a stand-in that hands back those window outputs;
      - one DiT backward per JAGG window (batch 2B, 4B for CFG); no-grad reference calls stay
        plain ``dit_call`` nodes outside every window;
  * float64 fields whose Jacobian is affine in (z, t), with each window's states on the chord
    (spec §2.1, E1): the compiled gradient equals the exact one to 1e-10;
  * the FX and Dynamo frontends agree on an FX-friendly loss;
  * caching: no re-trace on a second call or after optimizer steps, a re-trace for a new
    number of steps;
  * the report: window table, stage diff, networkx/DOT exports, ``explain``.
"""

from __future__ import annotations

import pytest
import torch

import jaggc
from jaggc_studies import example_losses
from jaggc import grpo, jagg_compile
from jaggc.graph_ops import dit_call, jagg_window
from jaggc.node_meta import CALL, WINDOW
from jaggc.runtime import DitCall, count_dit_passes, partition, run_window
from jaggc.verify.fields import AffineJacobianField, CurvedField

from helpers import grads, rel_err, zero_grads

NUM_STEPS = 4          # trained steps per example: one JAGG window at W=4 (compile time grows per call)
B = 2
NAMES = list(example_losses.EXAMPLES)


# every test compiles the same few functions again: keep Dynamo's per-code cache (and its
# recompile limit) from carrying over between tests
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Ref:
    """Per example: the example itself, its eager loss and exact gradient (computed once)."""

    def __init__(self, name: str):
        self.ex = example_losses.build_example(name, num_steps=NUM_STEPS, batch=B, seed=0)
        zero_grads(self.ex.model)
        self.loss = self.ex.loss_fn(self.ex.model, self.ex.batch)
        self.loss.backward()
        self.grad = grads(self.ex.model).clone()
        self.loss = self.loss.detach()
        zero_grads(self.ex.model)


@pytest.fixture(scope="module")
def refs():
    cache: dict[str, _Ref] = {}

    def get(name: str) -> _Ref:
        if name not in cache:
            cache[name] = _Ref(name)
        return cache[name]

    return get


def run_compiled(compiled, ex, *, backward: bool = True):
    """Loss, flat gradient and DiT pass counts of one compiled call. The first call compiles
    (Dynamo runs the opaque DiT on fake tensors then, which fires its forward hooks), so the
    passes are counted on a second, warm call."""
    zero_grads(ex.model)
    compiled(ex.model, ex.batch)
    with count_dit_passes(ex.model) as counts:
        loss = compiled(ex.model, ex.batch)
        if backward:
            loss.backward()
    g = grads(ex.model).clone()
    zero_grads(ex.model)
    return loss.detach(), g, counts


# --------------------------------------------------------------------------- hand-built JAGG


class _Recorder:
    """Stands in for the DiT: records every call (and its grad mode), returns the real output."""

    def __init__(self, dit):
        self.dit = dit
        self.calls: list[tuple[DitCall, bool]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((DitCall(args, kwargs), torch.is_grad_enabled()))
        return self.dit(*args, **kwargs)


class _Replayer:
    """Stands in for the DiT: grad-enabled calls get the precomputed window outputs, in order;
    no-grad (reference) calls run the real DiT, as the user wrote them."""

    def __init__(self, dit, calls: list[DitCall], outs: list):
        self.dit = dit
        self.pending = list(zip(calls, outs))

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.dit(*args, **kwargs)
        call, out = self.pending.pop(0)
        assert torch.equal(call.kwargs["hidden_states"], kwargs["hidden_states"])
        return out


def hand_jagg(ex, window: int):
    """Loss and gradient of ``ex.loss_fn`` with its grad-enabled DiT calls run through
    ``run_window`` in consecutive windows of ``window`` steps, by hand."""
    recorder = _Recorder(ex.model)
    ex.loss_fn(recorder, ex.batch)
    trained = [call for call, grad_enabled in recorder.calls if grad_enabled]
    zero_grads(ex.model)
    outs = []
    for idx in partition(len(trained), window):
        outs.extend(run_window(ex.model, [trained[i] for i in idx], steps=idx))
    loss = ex.loss_fn(_Replayer(ex.model, trained, outs), ex.batch)
    loss.backward()
    g = grads(ex.model).clone()
    zero_grads(ex.model)
    return loss.detach(), g


# --------------------------------------------------------------------------- the examples


def test_example_losses_match_grpo_reference_math(refs):
    """The examples' inline trainer math equals jaggc.grpo's step policies and PPO loss."""
    for name in ("flow_grpo_sd3", "dance_flux", "cfg_sd3", "kl_reference_sd3"):
        ex = refs(name).ex
        b = ex.batch
        total = 0.0
        with torch.no_grad():
            for j in range(NUM_STEPS):
                x = b["latents"][:, j]
                if name == "dance_flux":
                    v = ex.model(hidden_states=x, encoder_hidden_states=b["encoder_hidden_states"],
                                 timestep=b["timesteps"][:, j] / 1000, pooled_projections=b["pooled_prompt_embeds"],
                                 txt_ids=b["text_ids"], img_ids=b["image_ids"]).sample
                    step = grpo.dance_flux_step(v, x, b["sigmas"][:, j], b["sigmas_next"][:, j],
                                                eta=example_losses.ETA, prev_sample=b["next_latents"][:, j])
                else:
                    if name == "cfg_sd3":
                        out = ex.model(hidden_states=torch.cat([x] * 2), timestep=torch.cat([b["timesteps"][:, j]] * 2),
                                       encoder_hidden_states=torch.cat([b["negative_prompt_embeds"], b["prompt_embeds"]]),
                                       pooled_projections=torch.cat([b["negative_pooled_prompt_embeds"],
                                                                     b["pooled_prompt_embeds"]]),
                                       return_dict=False)[0]
                        uncond, text = out.chunk(2)
                        v = uncond + example_losses.GUIDANCE_SCALE * (text - uncond)
                    else:
                        v = ex.model(hidden_states=x, timestep=b["timesteps"][:, j],
                                     encoder_hidden_states=b["prompt_embeds"],
                                     pooled_projections=b["pooled_prompt_embeds"], return_dict=False)[0]
                    step = grpo.flow_grpo_sde_step(v, x, b["sigmas"][:, j], b["sigmas_next"][:, j],
                                                   noise_level=example_losses.NOISE_LEVEL,
                                                   sigma_max=float(b["sigma_max"]), prev_sample=b["next_latents"][:, j])
                ratio = torch.exp(step.log_prob - b["log_probs"][:, j])
                # off-policy, but far inside the clip range: no sample sits on a clipping boundary
                assert bool(((ratio - 1).abs() < example_losses.CLIP_RANGE / 2).all()), (name, j, ratio)
                assert bool(((ratio - 1).abs() > 0).any()), (name, j)
                per_sample = grpo.ppo_clip_loss(step.log_prob, b["log_probs"][:, j], b["advantages"][:, j],
                                                clip_range=example_losses.CLIP_RANGE,
                                                adv_clip_max=example_losses.ADV_CLIP_MAX)
                total = total + per_sample.mean() / NUM_STEPS
        torch.testing.assert_close(refs(name).loss, total, rtol=1e-5, atol=1e-8, msg=name)


def test_build_example_rejects_unknown_name():
    with pytest.raises(jaggc.JaggInputError, match="flow_grpo_sd3"):
        example_losses.build_example("nope")


# Bit-identity with the eager loss and the 2B-batch counts hold for the rewrite itself; the CFG
# split (tests/passes/test_cfg.py) changes the calls' batch and so the values by batch-size roundoff.
UNSPLIT = dict(options=jaggc.Options(split_batches=False))


@pytest.mark.parametrize("name", NAMES)
def test_loss_value_bit_identical_unbatched(refs, name):
    ref = refs(name)
    compiled = jagg_compile(ref.ex.loss_fn, window=4, capture="dynamo", interior_chunk=1, batch_knots=False,
                            **UNSPLIT)
    loss, _, _ = run_compiled(compiled, ref.ex, backward=False)
    assert compiled.report.path == "dynamo"
    assert [w.mode for w in compiled.report.windows] == ["jagg"]
    assert torch.equal(loss, ref.loss), (loss.item(), ref.loss.item())


@pytest.mark.parametrize("name", NAMES)
def test_jagg_gradient_matches_runtime_by_hand(refs, name):
    """W=4, default (batched) mode: values allclose, gradient = hand-built run_window JAGG,
    one joint DiT backward of batch 2B (4B with CFG), reference calls untouched."""
    ref = refs(name)
    ex = ref.ex
    compiled = jagg_compile(ex.loss_fn, window=4, capture="dynamo", **UNSPLIT)
    loss, g, counts = run_compiled(compiled, ex)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-4, atol=1e-7)

    hand_loss, hand_grad = hand_jagg(ex, window=4)
    assert torch.equal(loss, hand_loss)
    assert rel_err(g, hand_grad) < 1e-6, rel_err(g, hand_grad)
    assert rel_err(g, ref.grad) > 1e-4      # JAGG really ran: not the exact gradient

    report = compiled.report
    num_windows = len(partition(NUM_STEPS, 4))
    assert [w.mode for w in report.windows] == ["jagg"] * num_windows
    call_batch = 2 * B if name == "cfg_sd3" else B
    assert counts.backwards == num_windows
    assert counts.backward_batches == [2 * call_batch] * num_windows
    assert counts.grad_forwards == num_windows

    gm = report.graph_module
    assert sum(n.target is jagg_window for n in gm.graph.nodes) == num_windows
    references = [n for n in gm.graph.nodes if getattr(CALL.get(n), "role", None) == "reference"]
    if name == "kl_reference_sd3":
        assert report.reference_calls == NUM_STEPS == len(references)
        for node in references:
            assert node.target is dit_call and "step" not in node.kwargs
            assert CALL.of(node).window is None and CALL.of(node).step is None
            assert not WINDOW.on(node)
        # the reference calls run as plain no-grad forwards, next to the interior forwards
        assert counts.nograd_forwards == NUM_STEPS + num_windows
    else:
        assert report.reference_calls == 0 and not references
        assert counts.nograd_forwards == num_windows
    steps = sorted(s for w in report.windows for s in w.steps)
    assert steps == list(range(NUM_STEPS))


@pytest.mark.parametrize("name", NAMES)
def test_window_two_is_exact(refs, name):
    ref = refs(name)
    compiled = jagg_compile(ref.ex.loss_fn, window=2, capture="dynamo", **UNSPLIT)
    loss, g, counts = run_compiled(compiled, ref.ex)
    assert [w.mode for w in compiled.report.windows] == ["exact"] * (NUM_STEPS // 2)
    assert torch.equal(loss, ref.loss)
    assert rel_err(g, ref.grad) < 1e-6
    assert counts.backwards == NUM_STEPS


@pytest.mark.parametrize("name", NAMES)
def test_jagg_frac_zero_is_exact(refs, name):
    ref = refs(name)
    compiled = jagg_compile(ref.ex.loss_fn, window=4, capture="dynamo", routing=jaggc.Routing(jagg_frac=0.0), **UNSPLIT)
    loss, g, counts = run_compiled(compiled, ref.ex)
    assert {w.mode for w in compiled.report.windows} == {"exact"}
    assert compiled.report.backward_after == NUM_STEPS
    assert torch.equal(loss, ref.loss)
    assert rel_err(g, ref.grad) < 1e-6
    assert counts.backwards == NUM_STEPS


# --------------------------------------------------------------------------- exact cases


def _chord_states(times: torch.Tensor, window: int, dim: int, seed: int) -> torch.Tensor:
    """States (T, B, D) with every window's interior states on the chord between its endpoints,
    at the t-weights alpha_k = (t_k - t_a)/(t_b - t_a) of each sample."""
    g = torch.Generator().manual_seed(seed)
    num_steps, batch = times.shape
    zs = torch.empty(num_steps, batch, dim, dtype=torch.float64)
    for idx in partition(num_steps, window):
        a, b = idx[0], idx[-1]
        za = torch.randn(batch, dim, generator=g, dtype=torch.float64)
        zb = torch.randn(batch, dim, generator=g, dtype=torch.float64)
        for k in idx:
            alpha = ((times[k] - times[a]) / (times[b] - times[a]))[:, None] if b > a else 0.0
            zs[k] = (1 - alpha) * za + alpha * zb
    return zs


def grpo_like_loss(dit, zs, ts, g):
    """A nonlinear per-step loss of each velocity, step count from the state tensor (Dynamo)."""
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        ratio = torch.exp((v * g[k]).mean(dim=tuple(range(1, v.ndim))))
        total = total + torch.mean(-ratio * torch.tanh(v).sum(dim=1))
    return total


def test_affine_jacobian_collinear_states_exact_float64():
    torch.manual_seed(0)
    field = AffineJacobianField(3, seed=1)
    num_steps, window = 7, 3          # windows 0-2, 3-5 (JAGG) and 6 (exact tail)
    base = torch.tensor([1.0, 0.93, 0.81, 0.66, 0.5, 0.31, 0.12], dtype=torch.float64)
    times = torch.stack([base, base * 0.9 + 0.05], 1)     # per-sample schedules, both decreasing
    zs = _chord_states(times, window, 3, seed=2)
    g = torch.randn(num_steps, B, 3, dtype=torch.float64)

    zero_grads(field)
    exact_loss = grpo_like_loss(field, zs, times, g)
    exact_loss.backward()
    exact = grads(field).clone()

    compiled = jagg_compile(grpo_like_loss, window=window, weights="t")     # the paper's plain JAGG (E1)
    zero_grads(field)
    with count_dit_passes(field) as counts:
        loss = compiled(field, zs, times, g)
        loss.backward()
    assert compiled.report.path == "fx"          # capture="auto" takes FX first
    assert [w.mode for w in compiled.report.windows] == ["jagg", "jagg", "exact"]
    assert counts.backwards == 3
    torch.testing.assert_close(loss, exact_loss, rtol=1e-12, atol=1e-12)
    assert rel_err(grads(field), exact) < 1e-10, rel_err(grads(field), exact)


def fx_friendly_loss(dit, zs, ts, g, n: int):
    """FX-traceable: the step count is an int argument and reductions name their dims."""
    total = 0.0
    for k in range(n):
        v = dit(zs[k], ts[k])
        total = total + (torch.exp(-(v * g[k]).sum(dim=1)) * ts[k]).mean()
    return total


def _fx_friendly_inputs(num_steps: int = 6, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.1, num_steps, dtype=torch.float64)
    ts = torch.stack([t, t * 0.95], 1)
    zs = torch.randn(num_steps, B, 3, generator=g, dtype=torch.float64)
    gs = torch.randn(num_steps, B, 3, generator=g, dtype=torch.float64)
    return zs, ts, gs


def test_fx_and_dynamo_frontends_agree():
    field = CurvedField(3, seed=4)
    zs, ts, gs = _fx_friendly_inputs()
    zero_grads(field)
    fx_friendly_loss(field, zs, ts, gs, 6).backward()
    exact = grads(field).clone()
    results = {}
    for capture in ("fx", "dynamo"):
        torch._dynamo.reset()
        compiled = jagg_compile(fx_friendly_loss, window=3, capture=capture)
        zero_grads(field)
        with count_dit_passes(field) as counts:
            loss = compiled(field, zs, ts, gs, 6)
            loss.backward()
        assert compiled.report.path == capture
        assert counts.backwards == 2
        results[capture] = (loss.detach(), grads(field).clone(), compiled.report.table())
    (l_fx, g_fx, t_fx), (l_dy, g_dy, t_dy) = results["fx"], results["dynamo"]
    assert torch.equal(l_fx, l_dy)     # the same runtime ops on the same batches: bit for bit on any CPU
    assert rel_err(g_fx, g_dy) < 1e-12
    assert t_fx == t_dy
    assert rel_err(g_fx, exact) > 1e-6       # a curved field: JAGG is an approximation here


class OptionalArgsField(torch.nn.Module):
    """A DiT-like module with optional arguments a trainer passes as None (``guidance=None``,
    ``joint_attention_kwargs=None``)."""

    def __init__(self):
        super().__init__()
        self.field = AffineJacobianField(3, seed=7)

    def forward(self, x, timestep, guidance=None, *, joint_attention_kwargs=None, return_dict=False):
        assert guidance is None and joint_attention_kwargs is None
        return self.field(x, timestep)


def none_args_loss(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k], None, joint_attention_kwargs=None, return_dict=False)
        total = total + (v * g[k]).sum()
    return total


def test_none_arguments_pass_through_dynamo_capture():
    model = OptionalArgsField()
    zs, ts, gs = _fx_friendly_inputs(3)
    zero_grads(model)
    eager = none_args_loss(model, zs, ts, gs)
    compiled = jagg_compile(none_args_loss, window=3, capture="dynamo")
    loss = compiled(model, zs, ts, gs)
    # W=3 batches its two knots (2B): eager's value to float64 roundoff, not bit for bit
    torch.testing.assert_close(loss, eager, rtol=1e-14, atol=0)
    (node,) = [n for n in compiled.report.graph_module.graph.nodes if n.target is jagg_window]
    for args, kwargs in node.args[1]:
        assert args[2] is None and kwargs["joint_attention_kwargs"] is None


# --------------------------------------------------------------------------- caching


@pytest.mark.parametrize("capture", ["dynamo", "fx"])
def test_trace_cache_and_retrace_on_new_step_count(capture):
    field = AffineJacobianField(3, seed=5)
    compiled = jagg_compile(fx_friendly_loss, window=3, capture=capture)
    zs, ts, gs = _fx_friendly_inputs(6)
    first = compiled(field, zs, ts, gs, 6)
    second = compiled(field, zs, ts, gs, 6)
    assert torch.equal(first, second)
    assert compiled.traces == 1
    assert len(compiled.report.windows) == 2

    zs9, ts9, gs9 = _fx_friendly_inputs(9)
    compiled(field, zs9, ts9, gs9, 9)
    assert compiled.traces == 2
    assert len(compiled.report.windows) == 3
    assert compiled.report.backward_before == 9 and compiled.report.backward_after == 3

    # back to 6 steps: the cached graph runs again, and the report is that graph's
    compiled(field, zs, ts, gs, 6)
    assert compiled.traces == 2
    assert [w.steps for w in compiled.report.windows] == [[0, 1, 2], [3, 4, 5]]


def test_no_recompile_across_optimizer_steps(refs):
    ex = example_losses.build_example("flow_grpo_sd3", num_steps=NUM_STEPS, batch=B, seed=1)
    compiled = jagg_compile(ex.loss_fn, window=4, capture="dynamo")
    opt = torch.optim.SGD(ex.model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss = compiled(ex.model, ex.batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert compiled.traces == 1
    assert len(set(losses)) == 5           # the parameters (and so the loss) did change
    # and the compiled loss still tracks the current parameters
    with torch.no_grad():
        eager = ex.loss_fn(ex.model, ex.batch)
    torch.testing.assert_close(compiled(ex.model, ex.batch).detach(), eager, rtol=1e-4, atol=1e-7)
    assert compiled.traces == 1


# --------------------------------------------------------------------------- the report


def test_report_table_diff_exports(tmp_path):
    field = AffineJacobianField(3, seed=6)
    zs, ts, gs = _fx_friendly_inputs(6)
    compiled = jagg_compile(fx_friendly_loss, window=3, weights="t", capture="dynamo")
    compiled(field, zs, ts, gs, 6).backward()
    report = compiled.report
    assert len(report.windows) == 2

    table = report.table()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["window", "steps", "mode"]
    assert "0-2" in lines[2] and "jagg" in lines[2] and "K i K" in lines[2] and "linear/t" in lines[2]
    assert "3-5" in lines[3] and "K i K" in lines[3]
    assert "1, 0.82, 0.64" in lines[2]            # the first sample's timesteps of the window
    assert "0.46, 0.28, 0.1" in lines[3]
    assert lines[-1].split() == ["total", "6", "->", "2"]

    diff = report.diff()
    assert "jagg_window" in diff and diff.startswith("--- capture (dynamo)")
    assert "+++ place_modes" in diff

    g = report.to_networkx()
    windows = {data["window"] for _, data in g.nodes(data=True) if data["window"] is not None}
    assert windows == {0, 1}
    window_nodes = [n for n, d in g.nodes(data=True) if d["target"] == "jagg_window"]
    assert sorted(g.nodes[n]["window"] for n in window_nodes) == [0, 1]
    steps = sorted(d["step"] for _, d in g.nodes(data=True) if d["step"] is not None)
    assert steps == list(range(6))

    dot = report.to_dot()
    assert dot.count("subgraph cluster_window_") == 2
    assert "subgraph cluster_window_0 {" in dot and "subgraph cluster_window_1 {" in dot

    out = report.render(str(tmp_path / "g.dot"))
    assert out == str(tmp_path / "g.dot")
    text = (tmp_path / "g.dot").read_text()
    assert text.startswith("digraph jagg {") and text == dot


def test_explain_runs_no_backward(refs):
    ex = refs("flow_grpo_sd3").ex
    zero_grads(ex.model)
    report = jaggc.explain(ex.loss_fn, ex.model, ex.batch, window=4)
    assert isinstance(report, jaggc.Report)
    assert report.path == "fx" and report.traces == 1
    assert [(w.mode, w.roles()) for w in report.windows] == [("jagg", "K i i K")]
    assert report.windows[0].timesteps == pytest.approx((ex.batch["timesteps"][0, :4]).tolist())
    assert all(p.grad is None for p in ex.model.parameters())
    assert "window" in str(report)


def test_explain_takes_a_compiled_loss_with_its_own_options(refs):
    ex = refs("flow_grpo_sd3").ex
    decorated = jaggc.jagg_compile(window=2)(ex.loss_fn)
    report = jaggc.explain(decorated, ex.model, ex.batch)
    assert report is decorated.report and {w.mode for w in report.windows} == {"exact"}
    with pytest.raises(jaggc.JaggInputError, match=r"already compiled.*\['window'\].*__wrapped__"):
        jaggc.explain(decorated, ex.model, ex.batch, window=4)


def test_another_module_of_the_same_class_is_not_served_the_first_ones_graph():
    """A compiled loss traced with module a, then called with module b: b's loss and b's gradient."""
    a, b = AffineJacobianField(3, seed=1), AffineJacobianField(3, seed=2)
    zs, ts, gs = _fx_friendly_inputs(6)
    compiled = jagg_compile(fx_friendly_loss, window=3, capture="dynamo")
    compiled(a, zs, ts, gs, 6)
    zero_grads(a)
    zero_grads(b)
    loss_b = compiled(b, zs, ts, gs, 6)
    loss_b.backward()
    assert all(p.grad is None for p in a.parameters())
    got = grads(b).clone()
    zero_grads(b)
    fresh = jagg_compile(fx_friendly_loss, window=3, capture="dynamo")
    want_loss = fresh(b, zs, ts, gs, 6)
    want_loss.backward()
    assert torch.equal(loss_b.detach(), want_loss.detach())
    assert rel_err(got, grads(b)) < 1e-12


@pytest.mark.parametrize("capture", ["dynamo", "fx"])
def test_a_dropped_model_is_freed(capture):
    """jaggc's tables of opaque call slots are weak-keyed by the module; their functions once
    held the module strongly, so every model ever called through a compiled loss stayed alive."""
    import gc
    import weakref

    field = AffineJacobianField(3, seed=5)
    alive = weakref.ref(field)
    compiled = jagg_compile(fx_friendly_loss, window=3, capture=capture)
    compiled(field, *_fx_friendly_inputs(6), 6).backward()
    del compiled, field
    torch._dynamo.reset()          # Dynamo's code cache holds the compiled graph (and the module) until then
    gc.collect()
    assert alive() is None
