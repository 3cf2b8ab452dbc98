"""The trainers' autocast blocks as they run on a GPU, tested live on the CPU.

DanceGRPO, MixGRPO and the JAGG author wrap the DiT call in ``torch.autocast("cuda", bf16)``; on a
CPU that block switches itself off, so every test here uses a LIVE CPU bf16 autocast (values
change: a dropped block shows as the fp32 numbers) and asserts the capture path taken:

  * an autocast block in the loss is recorded by the default capture (FX, no fallback warning) and
    every DiT call runs in its recorded state in every backward mode: loss and W=2 gradient equal
    the undecorated loss's (and differ from the fp32 ones), W=4 equals the reference JAGG run under
    the same autocast (bit for bit with per-step knot forwards; batch-size roundoff with the
    batched knot forward), the report shows each call's state;
  * the literal ``torch.autocast("cuda", ...)`` code takes the graph path with the block live under
    ``jaggc.testing.cuda_autocast_on_cpu`` (the decision a GPU run makes);
  * blocks nested in helpers, a block that is switched off inside, a window whose calls differ in
    autocast state (cut there), the rollout cache under autocast (hits, no extra forward);
  * a whole-loss autocast (``accelerator.autocast()``): every capture path returns real tensors
    (no FakeTensor loss or ``.grad``) equal to the undecorated loss's, on the built-in examples
    and a Flow-GRPO log-prob that reads ``.ndim``;
  * the intercept fallback replays each call's autocast: its loss and W=2 gradient are the
    undecorated bf16 ones, never silently fp32;
  * windows fit what is there: MixGRPO's shrinking window 4, 3, 2, 1 through one compiled loss; a
    compiled loss under ``torch.no_grad()`` / ``inference_mode()`` returns the undecorated value.
"""

from __future__ import annotations

import jaggc
import warnings

import pytest
import torch

from helpers import loss_and_grad, reference_jagg, rel_err
from jaggc import RolloutCache, jagg_compile, models
from jaggc_studies import example_losses, trainer_shapes
from jaggc.errors import JaggInternalError
from jaggc.frontends.fake_boundary import check_real_output
from jaggc.runtime import count_dit_passes
from jaggc.runtime.autocast import current_autocast
from jaggc.runtime.module_state import module_state, set_state
from jaggc.testing import cuda_autocast_on_cpu
from jaggc_studies.trainer_check import trainer_form

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)
W2_TOL = 1e-3      # the acceptance bound; per-step calls are in fact bit-identical
BATCH_ROUNDOFF = 5e-3   # bf16 batched knot forward vs per-step calls: about one bf16 rounding


# ----------------------------------------------------------------------------- a MixGRPO-shaped loss


def flux_sample(steps: int = 5, seed: int = 0):
    model = models.flux("tiny", seed=seed)
    cond = models.flux_conditioning(model, 2, seed=seed).kwargs
    g = torch.Generator().manual_seed(seed + 1)
    shape = models.flux_latent_shape(model, 2)
    sigmas = trainer_shapes.sd3_time_shift(3.0, torch.linspace(1, 0, steps + 1))
    sample = dict(latents=torch.randn(2, steps, *shape[1:], generator=g),
                  next_latents=torch.randn(2, steps, *shape[1:], generator=g),
                  log_probs=torch.randn(2, steps, generator=g) * 0.01 - 1.4, advantages=torch.tensor([0.7, -0.7]),
                  timesteps=(sigmas[:steps] * 1000).expand(2, steps).contiguous(), **cond)
    return model, sample, sigmas


def _step(transformer, sample, j, sigmas, device_type="cpu", enabled=True):
    transformer.train()
    with torch.autocast(device_type, torch.bfloat16, enabled=enabled):
        pred = _call(transformer, sample, j)
    _, _, log_prob, _, _ = trainer_shapes.flow_grpo_step(pred, sample["latents"][:, j].float(), 0.7, sigmas, j,
                                                         prev_sample=sample["next_latents"][:, j].float())
    ratio = torch.exp(log_prob - sample["log_probs"][:, j])
    adv = sample["advantages"]
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)).mean()


def _call(transformer, sample, j):
    return transformer(hidden_states=sample["latents"][:, j], encoder_hidden_states=sample["encoder_hidden_states"],
                       pooled_projections=sample["pooled_projections"], timestep=sample["timesteps"][:, j] / 1000,
                       img_ids=sample["img_ids"], txt_ids=sample["txt_ids"], return_dict=False)[0]


def block_loss(transformer, sample, sigmas, enabled=True):
    """MixGRPO's step on a CPU: train() in the step, the DiT call in a live bf16 autocast block
    (``enabled=False``: the fp32 numbers a dropped block would give)."""
    total = 0.0
    for j in range(sample["timesteps"].shape[1]):
        total = total + _step(transformer, sample, j, sigmas, enabled=enabled)
    return total


def cuda_block_loss(transformer, sample, sigmas):
    """The same, with the block written for CUDA as the trainers write it."""
    total = 0.0
    for j in range(sample["timesteps"].shape[1]):
        total = total + _step(transformer, sample, j, sigmas, device_type="cuda")
    return total


def _fp32(args, model):
    model.eval()
    return loss_and_grad(lambda *a: block_loss(*a, enabled=False), args, model)


@pytest.fixture(scope="module")
def flux():
    return flux_sample()


def _compiled(fn, **options):
    return jagg_compile(fn, **options)


def _no_fallback(compiled, args, model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)       # no fallback warning
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight.*")
        return loss_and_grad(compiled, args, model)


@pytest.mark.parametrize("backward", ["joint", "per_window", "lowmem"])
def test_autocast_block_in_the_loss_takes_the_graph_path_in_every_mode(flux, backward):
    model, sample, sigmas = flux
    args = (model, sample, sigmas)
    model.eval()
    eager_loss, eager = loss_and_grad(block_loss, args, model)
    fp32_loss, fp32 = _fp32(args, model)
    assert rel_err(fp32, eager) > 1e-2          # the block changes the numbers: a dropped one shows
    model.eval()
    w2 = _compiled(block_loss, window=2, backward=backward)
    loss, grad = _no_fallback(w2, args, model)
    assert w2.report.path == "fx" and not w2.report.capture_failures
    assert float(abs(loss - eager_loss)) <= 1e-6 * max(1.0, abs(float(eager_loss)))
    assert rel_err(grad, eager) <= W2_TOL, rel_err(grad, eager)
    for batch_knots, tol in ((False, 1e-6), (True, BATCH_ROUNDOFF)):
        model.eval()
        w4 = _compiled(block_loss, window=4, weights="t", backward=backward,
                       options=jaggc.Options(batch_knots=batch_knots))
        loss, grad = _no_fallback(w4, args, model)
        model.eval()
        ref_loss, ref = reference_jagg(block_loss, args, model, 4, time_of=lambda t: t.reshape(-1))
        assert w4.report.path == "fx" and [w.mode for w in w4.report.windows] == ["jagg", "exact"]
        assert [w.autocast for w in w4.report.windows] == ["cpu bfloat16"] * 2
        assert rel_err(grad, ref) <= tol, (batch_knots, rel_err(grad, ref))
        assert rel_err(grad, fp32) > 10 * BATCH_ROUNDOFF
        assert float(abs(loss - ref_loss)) <= 1e-3 * max(1.0, abs(float(ref_loss)))
    assert all(entry.endswith("cpu bfloat16") for entry in w4.report.call_autocast)
    assert "autocast" in w4.report.table()
    assert current_autocast() == ()                # the graph left the caller's state as it was


def test_literal_cuda_block_is_live_under_the_gpu_form(flux):
    """The trainers' ``torch.autocast("cuda", bf16)`` on this CPU: off (fp32, the capture sees no
    block); under cuda_autocast_on_cpu live, recorded, and the same numbers as the CPU block."""
    model, sample, sigmas = flux
    args = (model, sample, sigmas)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        model.eval()
        off_loss, off = loss_and_grad(cuda_block_loss, args, model)
    _, fp32 = _fp32(args, model)
    assert rel_err(off, fp32) < 1e-6
    with cuda_autocast_on_cpu():
        model.eval()
        eager_loss, eager = loss_and_grad(cuda_block_loss, args, model)
        compiled = jagg_compile(cuda_block_loss, window=2)
        model.eval()
        loss, grad = _no_fallback(compiled, args, model)
    assert rel_err(eager, fp32) > 1e-2
    assert compiled.report.path == "fx" and "set_autocast" in compiled.report.stage("capture")
    assert rel_err(grad, eager) <= W2_TOL and float(abs(loss - eager_loss)) < 1e-6


def nested_helper_loss(transformer, sample, sigmas):
    """A helper opens the block; inside it, the log-prob glue switches autocast off again."""
    total = 0.0
    for j in range(sample["timesteps"].shape[1]):
        total = total + _nested_step(transformer, sample, j)
    return total


def _nested_step(transformer, sample, j):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = _call(transformer, sample, j)
        with torch.autocast("cpu", enabled=False):
            ratio = torch.exp((pred.float() * sample["latents"][:, j]).mean(dim=tuple(range(1, pred.ndim))) * 1e-3)
        # this matmul is inside the block: bf16
        return (pred.float() @ pred.float().transpose(1, 2)).mean() * 1e-3 + (ratio * sample["advantages"]).mean()


def test_nested_blocks_in_helpers_run_in_their_states(flux):
    """The matmul of the glue runs in bf16 inside the block, the exp/mean outside it in fp32: loss
    and gradient at W=2 are eager's bit for bit, on FX and on Dynamo."""
    model, sample, sigmas = flux
    args = (model, sample, sigmas)
    eager_loss, eager = loss_and_grad(nested_helper_loss, args, model)
    for capture in ("auto", "dynamo"):
        compiled = jagg_compile(nested_helper_loss, window=2, capture=capture)
        loss, grad = loss_and_grad(compiled, args, model)
        assert compiled.report.path == ("fx" if capture == "auto" else "dynamo")
        torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
        assert rel_err(grad, eager) == 0


def mixed_state_loss(transformer, sample, sigmas):
    """Steps 0-2 under bf16 autocast, steps 3-4 in fp32: no window may pair them."""
    total = 0.0
    for j in range(sample["timesteps"].shape[1]):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=j < 3):
            pred = _call(transformer, sample, j)
        total = total + (pred.float() * sample["next_latents"][:, j]).mean()
    return total


@pytest.mark.parametrize("capture", ["fx", "dynamo", "intercept"])
def test_a_window_is_cut_where_the_autocast_state_changes(flux, capture):
    model, sample, sigmas = flux
    args = (model, sample, sigmas)
    compiled = jagg_compile(mixed_state_loss, window=4, weights="t", capture=capture)
    loss, grad = loss_and_grad(compiled, args, model)
    assert compiled.report.path == capture
    assert [w.steps for w in compiled.report.windows] == [[0, 1, 2], [3, 4]]
    assert [w.autocast for w in compiled.report.windows] == ["cpu bfloat16", "off"]
    ref_loss, ref = reference_jagg(mixed_state_loss, args, model, 3, time_of=lambda t: t.reshape(-1))
    # the reference cuts windows of 3 from the start: the same windows here
    assert rel_err(grad, ref) <= BATCH_ROUNDOFF
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_rollout_cache_under_autocast_serves_the_interior_calls(flux):
    """Recorded under the rollout's bf16 autocast, looked up by the windows in the block's state:
    every interior call is a hit, and the gradient is the one without the cache."""
    model, sample, sigmas = flux
    args = (model, sample, sigmas)
    model.eval()
    cache = RolloutCache(model)
    with torch.no_grad(), cache.record(), torch.autocast(**BF16):
        for j in range(sample["timesteps"].shape[1]):
            model.train()
            _call(model, sample, j)
    model.eval()
    with_cache = jagg_compile(block_loss, window=4, weights="t", options=jaggc.Options(rollout_cache=cache))
    loss, grad = loss_and_grad(with_cache, args, model)
    model.eval()
    without = jagg_compile(block_loss, window=4, weights="t")
    loss0, grad0 = loss_and_grad(without, args, model)
    assert cache.stats.hits == 2 and cache.stats.misses == 0       # the window's two interior calls
    assert rel_err(grad, grad0) <= 1e-6
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- whole-loss autocast


def flow_grpo_ndim_loss(transformer, batch):
    """Flow-GRPO's own reduction ``log_prob.mean(dim=tuple(range(1, log_prob.ndim)))``: a metadata
    question to a traced value (what made fake tensors leak under a whole-loss autocast)."""
    total = 0.0
    for j in range(batch["timesteps"].shape[1]):
        v = transformer(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                        encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"],
                        return_dict=False)[0]
        log_prob = -((batch["next_latents"][:, j] - batch["latents"][:, j] + 0.1 * v.float()) ** 2)
        log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
        total = total + (torch.exp(log_prob - batch["log_probs"][:, j]) * batch["advantages"][:, j]).mean()
    return total


CASES = [(name, None) for name in example_losses.EXAMPLES] + [("flow_grpo_sd3", flow_grpo_ndim_loss)]


@pytest.mark.parametrize("capture", ["auto", "dynamo", "intercept"])
@pytest.mark.parametrize("name, loss_fn", CASES, ids=[c[0] + ("/ndim" if c[1] else "") for c in CASES])
def test_whole_loss_autocast_returns_real_tensors_on_every_path(name, loss_fn, capture):
    ex = example_losses.build_example(name, num_steps=4, batch=2)
    fn = loss_fn or ex.loss_fn
    model, args = ex.model, (ex.model, ex.batch)
    with torch.autocast(**BF16):
        eager_loss, eager = loss_and_grad(fn, args, model)
    _, fp32 = loss_and_grad(fn, args, model)
    assert rel_err(fp32, eager) > 1e-3
    for window in (2, 4):
        compiled = jagg_compile(fn, window=window, weights="t", capture=capture)
        for _ in range(2):           # the traced call and a cached one
            with torch.autocast(**BF16):
                loss, grad = loss_and_grad(compiled, args, model)
            assert type(loss) is torch.Tensor and type(grad) is torch.Tensor
            assert all(type(p.grad) is torch.Tensor for p in model.parameters() if p.grad is not None)
            float(loss)
        assert compiled.report.path == ("fx" if capture == "auto" else capture)
        if window == 2:
            assert rel_err(grad, eager) <= W2_TOL and float(abs(loss - eager_loss)) <= 1e-6
        else:
            with torch.autocast(**BF16):
                ref_loss, ref = reference_jagg(fn, args, model, 4)
            assert rel_err(grad, ref) <= BATCH_ROUNDOFF, rel_err(grad, ref)


def test_the_fake_boundary_refuses_a_fake_output():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(())
    with pytest.raises(JaggInternalError, match="returned a FakeTensor"):
        check_real_output({"loss": fake}, "loss_fn")
    check_real_output((torch.zeros(()), 1.0), "loss_fn")


# ----------------------------------------------------------------------------- the intercept path


def data_dependent_block_loss(transformer, sample, sigmas, enabled=True):
    """FX and Dynamo cannot take it (a branch on a DiT output's value): intercept must."""
    total = 0.0
    for j in range(sample["timesteps"].shape[1]):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            pred = _call(transformer, sample, j)
        term = (pred.float() * sample["next_latents"][:, j]).mean()
        total = total + (term if term.item() > -1e9 else -term)
    return total


def test_intercept_replays_each_calls_autocast(flux):
    """Intercept runs its windows after the loss, outside the loss's block: it must put each call
    back in its recorded bf16 state (it used to return the fp32 gradient), and its recording cache
    must then serve the interior calls."""
    model, sample, sigmas = flux
    args = (model, sample, sigmas)
    eager_loss, eager = loss_and_grad(data_dependent_block_loss, args, model)
    _, fp32 = loss_and_grad(lambda *a: data_dependent_block_loss(*a, enabled=False), args, model)
    assert rel_err(fp32, eager) > 1e-2
    for window in (2, 4):
        compiled = jagg_compile(data_dependent_block_loss, window=window, weights="t")
        with pytest.warns(UserWarning, match="runs through capture path 'intercept'"):
            loss, grad = loss_and_grad(compiled, args, model)
        assert compiled.report.path == "intercept"
        with count_dit_passes(model) as counts:      # the recording cache hits under the replayed state
            compiled(*args).backward()
        model.zero_grad(set_to_none=True)
        # 5 recorded no-grad forwards; then W=2: 5 exact forwards; W=4: the 4-step window's 2 knots in
        # one forward (its interiors from the recording) and the tail's 1 step
        assert (counts.nograd_forwards, counts.grad_forwards) == ((5, 5) if window == 2 else (5, 2))
        assert all(entry.endswith("cpu bfloat16") for entry in compiled.report.call_autocast)
        torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
        if window == 2:
            assert rel_err(grad, eager) <= W2_TOL
        else:
            ref_loss, ref = reference_jagg(data_dependent_block_loss, args, model, 4, time_of=lambda t: t.reshape(-1))
            assert rel_err(grad, ref) <= BATCH_ROUNDOFF


# ----------------------------------------------------------------------------- windows that fit


def test_mix_grpo_shrinking_windows_and_a_no_grad_call_through_one_compiled_loss():
    with trainer_form("gpu"):
        shape = trainer_shapes.mix_grpo_flux()
        transformer, sample, _, sigmas, args = shape.args
        compiled = jagg_compile(shape.loss_fn, dit=transformer, window=4)
        for cur, windows in ((0, [[0, 1, 2, 3]]), (20, [[0, 1, 2]]), (21, [[0, 1]]), (22, [[0]])):
            call = (transformer, sample, trainer_shapes.mix_train_timesteps(cur), sigmas, args)
            transformer.eval()
            eager_loss, eager = loss_and_grad(shape.loss_fn, call, transformer)
            transformer.eval()
            loss, grad = _no_fallback(compiled, call, transformer)
            assert compiled.report.path == "fx"
            assert [w.steps for w in compiled.report.windows] == windows
            assert float(abs(loss - eager_loss)) <= 1e-6 * max(1.0, abs(float(eager_loss)))
            if cur >= 21:            # 2 and 1 steps: every step a knot, the exact gradient
                assert rel_err(grad, eager) <= W2_TOL
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                value = compiled(*call)
            assert not value.requires_grad and float(value) == float(shape.loss_fn(*call))


def test_a_compiled_loss_under_no_grad_returns_the_undecorated_value_before_and_after(flux):
    model, sample, sigmas = flux
    args = (model, sample, sigmas)
    compiled = jagg_compile(block_loss, window=4)
    for phase in ("before", "after"):
        with torch.no_grad():
            assert float(compiled(*args)) == float(block_loss(*args)), phase
        with torch.inference_mode():
            assert float(compiled(*args)) == float(block_loss(*args)), phase
        if phase == "before":
            compiled(*args).backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("capture", ["auto", "intercept"])
@pytest.mark.parametrize("name", ["mix_grpo_flux", "dance_grpo_flux"])
def test_trainer_shapes_under_a_whole_loss_autocast_are_exact_at_w2(name, capture):
    """``accelerator.autocast()`` around the trainers' step code: W=2 gives the undecorated bf16
    gradient bit for bit. (Regression: a trace inside the caller's region used to leave weight casts
    in its cache, which the graph's first run then shared: 3e-3 off on 4 steps.)"""
    with trainer_form("cpu"):
        shape = trainer_shapes.SHAPES[name]()
        model = shape.model
        entry = module_state(model)
        with torch.autocast(**BF16):
            eager_loss, eager = loss_and_grad(shape.loss_fn, shape.args, model)
        compiled = jagg_compile(shape.loss_fn, dit=model, window=2, capture=capture)
        for _ in range(2):
            set_state(model, entry)
            with warnings.catch_warnings(), torch.autocast(**BF16):
                warnings.simplefilter("ignore")
                loss, grad = loss_and_grad(compiled, shape.args, model)
            assert compiled.report.path == ("fx" if capture == "auto" else capture)
            assert rel_err(grad, eager) == 0 and float(loss) == float(eager_loss)


def test_mix_grpo_gpu_form_through_the_intercept_fallback_is_not_fp32():
    """Forced onto the intercept path, MixGRPO's GPU-form step code keeps its bf16 block: loss and
    W=2 gradient are the undecorated bf16 ones (the fallback used to return the fp32 gradient)."""
    with trainer_form("gpu"):
        shape = trainer_shapes.mix_grpo_flux()
        model = shape.model
        entry = module_state(model)
        eager_loss, eager = loss_and_grad(shape.loss_fn, shape.args, model)
        compiled = jagg_compile(shape.loss_fn, dit=model, window=2, capture="intercept")
        set_state(model, entry)
        loss, grad = loss_and_grad(compiled, shape.args, model)
    assert compiled.report.path == "intercept"
    assert rel_err(grad, eager) <= W2_TOL and float(loss) == float(eager_loss)
    with trainer_form("cpu"):
        set_state(model, entry)
        _, fp32 = loss_and_grad(shape.loss_fn, shape.args, model)
    assert rel_err(grad, fp32) > 1e-2
