"""The window runtime on real diffusers DiTs (SD3 and Flux transformers at tiny sizes).

What is checked, per window of W consecutive calls on stored (detached) states:
  * values: every step's output equals the plain per-step call (fp32 roundoff with batched
    interior/knot forwards, bit-identical with ``interior_chunk=1, batch_knots=False``), for
    ``return_dict=False`` tuples and ``return_dict=True`` ``Transformer2DModelOutput``s;
  * gradients: W=2 equals the exact per-step gradient; W>=3 equals the JAGG reference
    J_aᵀ G_a + J_bᵀ G_b built by hand from two separate knot forwards (per-sample t-weights);
  * pass counts: one joint DiT backward of batch 2B per window, one no-grad forward per interior
    chunk;
  * the training stack around the DiT: peft LoRA (``add_adapter`` and ``get_peft_model``),
    diffusers gradient checkpointing, CPU bf16 autocast.

Timesteps follow diffusers' FlowMatchEulerDiscreteScheduler with shift 3 (16 steps). SD3 takes
``timestep = sigma * 1000``; Flux takes ``sigma`` (the Flux pipeline passes ``timestep / 1000``
and the transformer multiplies by 1000 itself). Both as one value per sample, shape (B,).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from jaggc import models
from jaggc.runtime import DitCall, WindowOptions, count_dit_passes, run_exact, run_window
from jaggc.runtime.aggregate import aggregate_knots

from helpers import cosine, flat, rel_err

B = 2
START = 3  # first step of the window in the 16-step schedule
MODELS = ("sd3", "flux")


def _sigmas() -> torch.Tensor:
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(16)
    return sched.sigmas.to(torch.float32)  # 17 values, 1.0 ... 0.0


SIGMAS = _sigmas()


# --------------------------------------------------------------------------- helpers


def build(kind: str, seed: int = 0):
    return getattr(models, kind)(seed=seed)


def conditioning(kind: str, model) -> dict:
    if kind == "sd3":
        return models.sd3_conditioning(model, B, seed=1).kwargs
    return models.flux_conditioning(model, B, seed=1).kwargs


def latent_shape(kind: str, model) -> tuple[int, ...]:
    if kind == "sd3":
        return models.sd3_latent_shape(model, B)
    return models.flux_latent_shape(model, B)


def timestep(kind: str, sigma: torch.Tensor) -> torch.Tensor:
    return sigma * 1000.0 if kind == "sd3" else sigma.clone()


def make_calls(kind: str, model, num_steps: int, *, return_dict: bool = False, start: int = START,
               per_sample_offsets: tuple[int, ...] = (0,) * B, seed: int = 2) -> list[DitCall]:
    """``num_steps`` DiT calls on stored random states; sample b sits at schedule step
    ``start + per_sample_offsets[b] + k`` at window position k."""
    g = torch.Generator().manual_seed(seed)
    cond = conditioning(kind, model)
    shape = latent_shape(kind, model)
    calls = []
    for k in range(num_steps):
        sigma = torch.stack([SIGMAS[start + off + k] for off in per_sample_offsets])
        kwargs = dict(hidden_states=torch.randn(shape, generator=g), timestep=timestep(kind, sigma),
                      return_dict=return_dict, **cond)
        calls.append(DitCall((), kwargs))
    return calls


def value(out) -> torch.Tensor:
    """The velocity tensor of a DiT output (``return_dict`` False or True)."""
    return out[0] if isinstance(out, tuple) else out.sample


def upstream(calls: list[DitCall], kind: str, model, seed: int = 3) -> list[torch.Tensor]:
    """A fixed random upstream signal g_k per step (the ∂L/∂v_k of a GRPO loss)."""
    g = torch.Generator().manual_seed(seed)
    shape = latent_shape(kind, model)
    return [torch.randn(shape, generator=g) for _ in calls]


def surrogate(outs, gs) -> torch.Tensor:
    """L = Σ_k <v_k, g_k>: its gradient is Σ_k J_kᵀ g_k, the structure of a GRPO loss."""
    return sum((value(o).float() * g).sum() for o, g in zip(outs, gs))


def trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in trainable(model).items()}


def window_grad(model, calls, gs, *, options=WindowOptions(), exact=False, autocast=False):
    model.zero_grad(set_to_none=True)
    run = run_exact if exact else run_window
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = run(model, calls, options=options)
    surrogate(outs, gs).backward()
    return grads_of(model), outs


def times_of(calls) -> torch.Tensor:
    return torch.stack([c.kwargs["timestep"].double() for c in calls])  # (W, B)


def manual_jagg_grad(model, calls, gs) -> dict[str, torch.Tensor]:
    """J_aᵀ G_a + J_bᵀ G_b with α_k = (t_k - t_a)/(t_b - t_a) per sample, from two separate
    plain forwards of the endpoints (no jaggc code involved)."""
    t = times_of(calls)
    alpha = ((t - t[0]) / (t[-1] - t[0])).float()  # (W, B)
    shape = (B,) + (1,) * (gs[0].ndim - 1)
    g_a = sum((1 - alpha[k]).view(shape) * gs[k] for k in range(len(calls)))
    g_b = sum(alpha[k].view(shape) * gs[k] for k in range(len(calls)))
    model.zero_grad(set_to_none=True)
    loss = (value(calls[0](model)) * g_a).sum() + (value(calls[-1](model)) * g_b).sum()
    loss.backward()
    return grads_of(model)


@pytest.fixture(scope="module")
def dits():
    torch.manual_seed(0)
    return {kind: build(kind) for kind in MODELS}


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("return_dict", [False, True], ids=["tuple", "dict"])
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("kind", MODELS)
def test_window_values_match_per_step(dits, kind, W, return_dict):
    model = dits[kind]
    calls = make_calls(kind, model, W, return_dict=return_dict)
    with torch.no_grad():
        ref = [c(model) for c in calls]
    outs = run_window(model, calls)
    assert len(outs) == W
    for k, (o, r) in enumerate(zip(outs, ref)):
        assert type(o) is type(r), f"step {k}: output type {type(o)} != per-step {type(r)}"
        assert value(o).shape == value(r).shape
        # batched forwards (2B knots, (W-2)B interior) differ from B-batch calls by fp32 roundoff only
        torch.testing.assert_close(value(o), value(r), rtol=1e-5, atol=1e-5, msg=f"step {k}")
    # the velocities carry grad at every step (interior steps through the aggregation node)
    if W >= 3:
        assert all(value(o).requires_grad for o in outs)


@pytest.mark.parametrize("return_dict", [False, True], ids=["tuple", "dict"])
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("kind", MODELS)
def test_window_values_bit_identical_unbatched(dits, kind, W, return_dict):
    model = dits[kind]
    calls = make_calls(kind, model, W, return_dict=return_dict)
    with torch.no_grad():
        ref = [c(model) for c in calls]
    outs = run_window(model, calls, options=WindowOptions(interior_chunk=1, batch_knots=False))
    for k, (o, r) in enumerate(zip(outs, ref)):
        assert torch.equal(value(o), value(r)), (
            f"step {k}: max |diff| {float((value(o) - value(r)).abs().max()):.3g} with unbatched calls")


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("return_dict", [False, True], ids=["tuple", "dict"])
@pytest.mark.parametrize("kind", MODELS)
def test_w2_gradient_equals_exact(dits, kind, return_dict):
    model = dits[kind]
    calls = make_calls(kind, model, 2, return_dict=return_dict)
    gs = upstream(calls, kind, model)
    jagg, _ = window_grad(model, calls, gs)
    # the exact gradient, computed the way Flow-GRPO does it: one backward per step
    model.zero_grad(set_to_none=True)
    for c, g in zip(calls, gs):
        (value(c(model)) * g).sum().backward()
    exact = grads_of(model)
    assert set(jagg) == set(exact)
    assert rel_err(jagg, exact) < 1e-6
    for n in exact:
        torch.testing.assert_close(jagg[n], exact[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("return_dict", [False, True], ids=["tuple", "dict"])
@pytest.mark.parametrize("W", [3, 4])
@pytest.mark.parametrize("kind", MODELS)
def test_jagg_gradient_equals_knot_reference(dits, kind, W, return_dict):
    """W>=3: the runtime's single joint backward equals J_aᵀG_a + J_bᵀG_b computed by hand,
    with per-sample timesteps (sample 1 sits two schedule steps later than sample 0)."""
    model = dits[kind]
    calls = make_calls(kind, model, W, return_dict=return_dict, per_sample_offsets=(0, 2))
    gs = upstream(calls, kind, model)
    jagg, _ = window_grad(model, calls, gs)
    ref = manual_jagg_grad(model, calls, gs)
    assert rel_err(jagg, ref) < 1e-5
    # and it is an approximation, not the exact gradient (the test would catch a silent fallback)
    exact, _ = window_grad(model, calls, gs, exact=True)
    assert rel_err(jagg, exact) > 1e-4


@pytest.mark.parametrize("kind", MODELS)
def test_batched_and_unbatched_windows_agree_in_gradient(dits, kind):
    model = dits[kind]
    calls = make_calls(kind, model, 4)
    gs = upstream(calls, kind, model)
    batched, _ = window_grad(model, calls, gs)
    unbatched, _ = window_grad(model, calls, gs, options=WindowOptions(interior_chunk=1, batch_knots=False))
    assert rel_err(batched, unbatched) < 1e-5


# --------------------------------------------------------------------------- pass counts


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("kind", MODELS)
def test_pass_counts(dits, kind, W):
    model = dits[kind]
    calls = make_calls(kind, model, W)
    gs = upstream(calls, kind, model)
    with count_dit_passes(model) as c:
        window_grad(model, calls, gs)
    if W == 2:
        # a window of two steps is all knots and runs as plain per-step autograd (exact)
        assert (c.grad_forwards, c.nograd_forwards, c.backwards) == (2, 0, 2)
        assert c.backward_batches == [B, B]
        return
    assert c.grad_forwards == 1 and c.grad_forward_batches == [2 * B]
    assert c.backwards == 1 and c.backward_batches == [2 * B]
    assert c.nograd_forwards == 1 and c.nograd_forward_batches == [(W - 2) * B]

    with count_dit_passes(model) as c:
        window_grad(model, calls, gs, options=WindowOptions(interior_chunk=1))
    assert c.nograd_forwards == W - 2 and c.nograd_forward_batches == [B] * (W - 2)
    assert c.backwards == 1 and c.backward_batches == [2 * B]

    if W == 4:
        with count_dit_passes(model) as c:
            window_grad(model, calls, gs, options=WindowOptions(interior_chunk=2))
        assert c.nograd_forward_batches == [2 * B]
        # batch_knots=False: the knots run as two forwards, hence two backwards of B each
        with count_dit_passes(model) as c:
            window_grad(model, calls, gs, options=WindowOptions(batch_knots=False))
        assert c.grad_forward_batches == [B, B] and c.backward_batches == [B, B]


# --------------------------------------------------------------------------- peft LoRA

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def lora_config():
    peft = pytest.importorskip("peft")
    # init_lora_weights=False: lora_B is random, not zero, so lora_A gets a nonzero gradient too
    return peft.LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False)


def add_lora(kind: str):
    model = build(kind)
    model.requires_grad_(False)  # as GRPO trainers do before adding the adapter
    model.add_adapter(lora_config())
    return model


def check_lora_grads(model, grads: dict[str, torch.Tensor]):
    names_with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert names_with_grad, "no parameter got a gradient"
    assert all("lora_" in n for n in names_with_grad), sorted(n for n in names_with_grad if "lora_" not in n)
    assert names_with_grad == set(grads) == {n for n, p in model.named_parameters() if "lora_" in n}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().max() > 0 for g in grads.values()), [n for n, g in grads.items() if g.abs().max() == 0]


@pytest.mark.parametrize("kind", MODELS)
def test_lora_add_adapter(kind):
    model = add_lora(kind)
    calls = make_calls(kind, model, 2)
    gs = upstream(calls, kind, model)
    jagg, _ = window_grad(model, calls, gs)
    check_lora_grads(model, jagg)
    model.zero_grad(set_to_none=True)
    for c, g in zip(calls, gs):
        (value(c(model)) * g).sum().backward()
    exact = grads_of(model)
    assert rel_err(jagg, exact) < 1e-6

    calls = make_calls(kind, model, 4)
    gs = upstream(calls, kind, model)
    jagg, outs = window_grad(model, calls, gs)
    check_lora_grads(model, jagg)
    assert rel_err(jagg, manual_jagg_grad(model, calls, gs)) < 1e-5
    with torch.no_grad():
        for o, c in zip(outs, calls):
            torch.testing.assert_close(value(o), value(c(model)), rtol=1e-5, atol=1e-5)


def test_lora_get_peft_model_sd3():
    peft = pytest.importorskip("peft")
    base = build("sd3")
    model = peft.get_peft_model(base, lora_config())  # freezes the base itself
    calls = make_calls("sd3", base, 2)
    gs = upstream(calls, "sd3", base)
    jagg, _ = window_grad(model, calls, gs)
    check_lora_grads(model, jagg)
    model.zero_grad(set_to_none=True)
    for c, g in zip(calls, gs):
        (value(c(model)) * g).sum().backward()
    assert rel_err(jagg, grads_of(model)) < 1e-6

    calls = make_calls("sd3", base, 4)
    gs = upstream(calls, "sd3", base)
    with count_dit_passes(model) as c:
        jagg, _ = window_grad(model, calls, gs)
    check_lora_grads(model, jagg)
    assert c.backwards == 1 and c.backward_batches == [2 * B]
    assert rel_err(jagg, manual_jagg_grad(model, calls, gs)) < 1e-5


# --------------------------------------------------------------------------- gradient checkpointing


@pytest.fixture
def checkpoint_calls(monkeypatch):
    """Counts torch.utils.checkpoint.checkpoint calls (diffusers' default checkpointing function
    looks it up at call time), to prove checkpointing is really engaged."""
    calls = {"n": 0, "use_reentrant": set()}
    original = torch.utils.checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        calls["n"] += 1
        calls["use_reentrant"].add(kwargs.get("use_reentrant"))
        return original(fn, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    return calls


@pytest.mark.parametrize("kind", MODELS)
def test_gradient_checkpointing(kind, checkpoint_calls):
    model = build(kind)
    model.enable_gradient_checkpointing()
    model.train()
    plain = build(kind)  # same seed, same weights, no checkpointing
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))

    calls = make_calls(kind, model, 2)
    gs = upstream(calls, kind, model)
    jagg, _ = window_grad(model, calls, gs)
    assert checkpoint_calls["n"] > 0, "checkpointing was not engaged"
    assert checkpoint_calls["use_reentrant"] == {False}
    model.zero_grad(set_to_none=True)
    for c, g in zip(calls, gs):
        (value(c(model)) * g).sum().backward()
    assert rel_err(jagg, grads_of(model)) < 1e-6

    calls = make_calls(kind, model, 4)
    gs = upstream(calls, kind, model)
    checkpoint_calls["n"] = 0
    with count_dit_passes(model) as c:
        with_ckpt, _ = window_grad(model, calls, gs)
    # only the grad-enabled knot forward is checkpointed (once per block), not the no-grad interior
    blocks = len(model.transformer_blocks) + len(getattr(model, "single_transformer_blocks", []))
    assert checkpoint_calls["n"] == blocks
    assert c.backwards == 1 and c.backward_batches == [2 * B]
    without, _ = window_grad(plain, calls, gs)
    assert rel_err(with_ckpt, without) < 1e-6


# --------------------------------------------------------------------------- bf16 autocast


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("kind", MODELS)
def test_bf16_autocast(dits, kind, W):
    model = dits[kind]
    calls = make_calls(kind, model, W)
    gs = upstream(calls, kind, model)
    fp32, _ = window_grad(model, calls, gs)
    bf16, outs = window_grad(model, calls, gs, autocast=True)
    # the DiT ran in bf16, so the upstream grads reaching the aggregation node are bf16
    assert all(value(o).dtype == torch.bfloat16 for o in outs)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(g).all() for g in bf16.values())
    assert flat(bf16).norm() > 0
    assert cosine(bf16, fp32) > 0.99


def test_aggregate_accepts_bf16_upstream_grads():
    """KnotAggregate accumulates bf16 upstream grads in fp32 and hands back bf16 composites."""
    torch.manual_seed(0)
    W, D = 4, 6
    t = torch.tensor([[0.9, 0.8], [0.7, 0.75], [0.6, 0.5], [0.4, 0.3]], dtype=torch.float64)  # (W, B)
    alpha = (t - t[0]) / (t[-1] - t[0])
    phi = torch.stack([1 - alpha, alpha], 1)  # (W, 2, B)
    knot_out = torch.randn(2 * B, D, dtype=torch.bfloat16, requires_grad=True)
    interior = [None, torch.randn(B, D, dtype=torch.bfloat16), torch.randn(B, D, dtype=torch.bfloat16), None]
    outs = aggregate_knots(phi, knot_out, (0, W - 1), interior)
    gs = [torch.randn(B, D, dtype=torch.bfloat16) for _ in range(W)]
    torch.autograd.backward(outs, gs)
    assert knot_out.grad.dtype == torch.bfloat16
    want = torch.cat([sum(phi[k, j].float()[:, None] * gs[k].float() for k in range(W)) for j in range(2)])
    # fp32 accumulation rounds to bf16 once, at the end: within bf16's unit roundoff (2**-8) of the
    # fp32 sum. Accumulating in bf16 rounds after every step and misses that on these inputs
    # (relative error 4e-2), so this tolerance tells the two apart (the former 1e-2 did not).
    tolerance = dict(rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(knot_out.grad.float(), want, **tolerance)
    bf16_accumulated = torch.cat([sum(phi[k, j].to(torch.bfloat16)[:, None] * gs[k] for k in range(W))
                                  for j in range(2)])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(bf16_accumulated.float(), want, **tolerance)


# --------------------------------------------------------------------------- Flux's shared ids


def test_flux_ids_shared_when_batch_equals_text_len(dits):
    """img_ids/txt_ids are shared by default even when their length equals the batch."""
    model = dits["flux"]
    b = 4
    cond = models.flux_conditioning(model, b, text_len=b, seed=1).kwargs
    g = torch.Generator().manual_seed(2)
    calls = [DitCall((), dict(hidden_states=torch.randn(models.flux_latent_shape(model, b), generator=g),
                              timestep=SIGMAS[START + k].expand(b).clone(), return_dict=False, **cond))
             for k in range(3)]
    with torch.no_grad():
        ref = [c(model) for c in calls]
    outs = run_window(model, calls)
    for o, r in zip(outs, ref):
        torch.testing.assert_close(value(o), value(r), rtol=1e-5, atol=1e-5)


def test_flux_ids_explicit_unbatched_option(dits):
    model = dits["flux"]
    b = 4
    cond = models.flux_conditioning(model, b, text_len=b, seed=1).kwargs
    g = torch.Generator().manual_seed(2)
    calls = [DitCall((), dict(hidden_states=torch.randn(models.flux_latent_shape(model, b), generator=g),
                              timestep=SIGMAS[START + k].expand(b).clone(), return_dict=False, **cond))
             for k in range(3)]
    with torch.no_grad():
        ref = [c(model) for c in calls]
    outs = run_window(model, calls, options=WindowOptions(unbatched=("img_ids", "txt_ids")))
    for o, r in zip(outs, ref):
        torch.testing.assert_close(value(o), value(r), rtol=1e-5, atol=1e-5)
