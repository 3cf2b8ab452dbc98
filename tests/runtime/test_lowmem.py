"""backward="lowmem": each window's joint backward runs inside the loss's forward as soon as the
loss's per-step terms give its upstream gradients (runtime/lowmem.py, passes/lowmem_terms.py).

  * gradients and loss equal the joint mode's: float64 to 1e-12 (an affine-Jacobian field, where
    both are exact), the built-in Flow-GRPO / DanceGRPO / CFG / KL losses in float32 to 1e-6;
  * peak saved activations are one window's (below the joint mode's, at most 2.2x the per-step loop);
    the pass counts are the joint mode's (no knot forward twice, unlike the per-window mode);
  * ``grad_output`` scales everything (a GradScaler's scale, a manual factor); micro-batches
    accumulate in ``.grad``; the rollout cache serves interior steps as in the joint mode;
  * refused, naming the node: a loss that mixes steps otherwise than by +/-/number factors, a tensor
    coefficient, a term with another trainable input, a non-tensor return; routing;
  * FSDP2 on one rank equals the plain module (2 ranks, FSDP1 and FSDP2: test_sharded.py).
"""

from __future__ import annotations

import pytest
import torch

import jaggc
from helpers import grads, loss_and_grad, rel_err, zero_grads
from jaggc import JaggGraphError, JaggUnsupportedError, jagg_compile
from jaggc_studies import example_losses
from jaggc.runtime import count_dit_passes
from jaggc.runtime.memory import track_saved_tensors
from jaggc.verify.fields import AffineJacobianField

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

T, B = 10, 2


def chord_inputs(seed: int = 0, window: int = 4):
    """States on each window's chord (spec E1): JAGG is exact on an affine-Jacobian field."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    ts = torch.stack([t, 0.95 * t], 1)
    zs = torch.empty(T, B, 3, dtype=torch.float64)
    for start in range(0, T, window):
        idx = list(range(start, min(start + window, T)))
        a, b = torch.randn(2, B, 3, generator=g, dtype=torch.float64)
        for k in idx:
            alpha = ((ts[k] - ts[idx[0]]) / (ts[idx[-1]] - ts[idx[0]])) if len(idx) > 1 else torch.zeros(B)
            zs[k] = (1 - alpha[:, None]) * a + alpha[:, None] * b
    return zs, ts, torch.randn(T, B, 3, generator=g, dtype=torch.float64)


def grpo_like(dit, zs, ts, g):
    """Nonlinear glue per step, a no-grad reference term, summed and averaged like Flow-GRPO."""
    total = 0.0
    for k in range(zs.shape[0]):
        v = dit(zs[k], ts[k])
        with torch.no_grad():
            ref = dit(zs[k], ts[k]) * 0.9
        logp = -((v - g[k]) ** 2).mean(dim=1)
        ratio = torch.exp(logp - logp.detach() + 0.01 * k)
        policy = torch.maximum(-ratio, -torch.clamp(ratio, 0.8, 1.2)).mean()
        total = total + policy + 0.04 * ((v - ref) ** 2).mean()
    return total / zs.shape[0]


@pytest.mark.parametrize("window", [3, 4])
def test_float64_equal_to_joint_and_exact_on_the_chord(window):
    model = AffineJacobianField(3, seed=1)
    args = (model, *chord_inputs(window=window))
    exact_loss, exact = loss_and_grad(grpo_like, args, model)
    joint_loss, joint = loss_and_grad(jagg_compile(grpo_like, window=window), args, model)
    low = jagg_compile(grpo_like, window=window, backward="lowmem")
    low_loss, lowmem = loss_and_grad(low, args, model)
    assert low.report.path == "fx" and "place_lowmem_terms" in [s.name for s in low.report.stages]
    torch.testing.assert_close(low_loss, joint_loss, rtol=1e-14, atol=1e-14)
    assert rel_err(lowmem, joint) < 1e-12
    assert rel_err(lowmem, exact) < 1e-10          # E1: JAGG is exact here, so lowmem is too


@pytest.mark.parametrize("name", list(example_losses.EXAMPLES))
def test_example_losses_equal_joint_in_float32(name):
    ex = example_losses.build_example(name, num_steps=8, batch=2, seed=0)
    _, joint = loss_and_grad(jagg_compile(ex.loss_fn, window=4), (ex.model, ex.batch), ex.model)
    _, lowmem = loss_and_grad(jagg_compile(ex.loss_fn, window=4, backward="lowmem"), (ex.model, ex.batch), ex.model)
    assert rel_err(lowmem, joint) < 1e-6


def test_one_window_of_activations_and_the_joint_pass_counts():
    ex = example_losses.build_example("flow_grpo_sd3", num_steps=16, batch=2, seed=0)
    args = (ex.model, ex.batch)
    peaks, counts = {}, {}
    for mode, fn in (("joint", jagg_compile(ex.loss_fn, window=4, weights="t")),
                     ("lowmem", jagg_compile(ex.loss_fn, window=4, weights="t", backward="lowmem"))):
        fn(*args)                                    # trace outside the measurement
        zero_grads(ex.model)
        with track_saved_tensors() as stats, count_dit_passes(ex.model) as c:
            fn(*args).backward()
        peaks[mode], counts[mode] = stats.peak_bytes, c
    # Flow-GRPO's per-step loop: one step's activations at a time
    zero_grads(ex.model)
    with track_saved_tensors() as stats:
        for k in range(16):
            one = {key: (v[:, k:k + 1] if key in ("latents", "next_latents", "timesteps", "sigmas", "sigmas_next",
                                                    "log_probs", "advantages") else v) for key, v in ex.batch.items()}
            (ex.loss_fn(ex.model, one) / 16).backward()
    peaks["per_step"] = stats.peak_bytes
    assert peaks["lowmem"] < peaks["joint"] / 2.5          # four windows -> one
    assert peaks["lowmem"] <= 2.2 * peaks["per_step"]
    for field in ("grad_forwards", "nograd_forwards", "backwards", "backward_samples"):
        assert getattr(counts["lowmem"], field) == getattr(counts["joint"], field), field


def test_grad_output_scaling_and_accumulation():
    model = AffineJacobianField(3, seed=2)
    args = (model, *chord_inputs(1))
    low = jagg_compile(grpo_like, window=4, backward="lowmem")
    _, once = loss_and_grad(low, args, model)
    zero_grads(model)
    (low(*args) * 1024.0).backward()                    # what GradScaler.scale(loss).backward() does
    assert rel_err(grads(model), 1024.0 * once) < 1e-13
    zero_grads(model)
    low(*args).backward()
    low(*args).backward()                               # two micro-batches accumulate in .grad
    assert rel_err(grads(model), 2 * once) < 1e-13


def test_grad_scaler():
    ex = example_losses.build_example("flow_grpo_sd3", num_steps=8, batch=2, seed=0)
    _, joint = loss_and_grad(jagg_compile(ex.loss_fn, window=4), (ex.model, ex.batch), ex.model)
    low = jagg_compile(ex.loss_fn, window=4, backward="lowmem")
    optimizer = torch.optim.SGD(ex.model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    zero_grads(ex.model)
    scaler.scale(low(ex.model, ex.batch)).backward()
    scaler.unscale_(optimizer)
    assert rel_err(grads(ex.model), joint) < 1e-6


def test_rollout_cache_serves_the_interior_steps():
    ex = example_losses.build_example("flow_grpo_sd3", num_steps=8, batch=2, seed=0)
    cache = jaggc.RolloutCache(ex.model)
    with torch.no_grad(), cache.record():
        ex.loss_fn(ex.model, ex.batch)                  # records every step's output, as a rollout would
    _, joint = loss_and_grad(jagg_compile(ex.loss_fn, window=4), (ex.model, ex.batch), ex.model)
    low = jagg_compile(ex.loss_fn, window=4, backward="lowmem", options=jaggc.Options(rollout_cache=cache))
    low(ex.model, ex.batch)
    with count_dit_passes(ex.model) as counts:
        _, got = loss_and_grad(low, (ex.model, ex.batch), ex.model)
    assert counts.nograd_forwards == 0 and cache.stats.hits > 0
    assert rel_err(got, joint) < 1e-6


def stacked(dit, zs, ts, g):
    losses = [((dit(zs[k], ts[k]) - g[k]) ** 2).mean() for k in range(zs.shape[0])]
    return torch.stack(losses).mean()


def weighted(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        total = total + ((dit(zs[k], ts[k]) - g[k]) ** 2).mean() * ts[k].mean()      # a tensor coefficient
    return total


def with_info(dit, zs, ts, g):
    total = 0.0
    for k in range(zs.shape[0]):
        total = total + ((dit(zs[k], ts[k]) - g[k]) ** 2).mean()
    return total, {"steps": zs.shape[0]}


@pytest.mark.parametrize("loss, message", [
    (stacked, r"node mean_\d+ .*test_lowmem.py:\d+\): backward='lowmem' needs the loss to be a sum of per-step "
              r"terms, each depending on one step's DiT output; this node combines 10 steps' outputs"),
    (weighted, r"node mul_?\d* .*test_lowmem.py:\d+\): backward='lowmem' needs .* Python-number coefficients; "
               r"this mul scales them by a tensor"),
    (with_info, r"needs the loss function to return one tensor"),
], ids=["stack_mean", "tensor_coefficient", "tuple_return"])
def test_non_additive_losses_are_refused(loss, message):
    model = AffineJacobianField(3, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(JaggGraphError, match=message):
        jagg_compile(loss, window=4, backward="lowmem")(model, *chord_inputs())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_another_trainable_input_is_refused():
    model = AffineJacobianField(3, seed=3)
    scale = torch.ones((), dtype=torch.float64, requires_grad=True)

    def loss(dit, zs, ts, g, s):
        return sum(((dit(zs[k], ts[k]) - g[k]) ** 2).mean() * 1.0 + (s * 0.0) * 0 for k in range(zs.shape[0]))

    def coupled(dit, zs, ts, g, s):
        return sum((((dit(zs[k], ts[k]) - g[k]) ** 2) * s).mean() for k in range(zs.shape[0]))

    with pytest.raises(JaggGraphError, match=r"also depends on the input s_?\d*, which requires grad"):
        jagg_compile(coupled, window=4, backward="lowmem")(model, *chord_inputs(), scale)
    with pytest.raises(JaggGraphError, match=r"gradient path that does not go through a DiT output"):
        jagg_compile(loss, window=4, backward="lowmem")(model, *chord_inputs(), scale)


def test_routing_is_refused():
    with pytest.raises(JaggUnsupportedError, match="needs backward='joint'"):
        jagg_compile(grpo_like, window=4, backward="lowmem", routing=jaggc.Routing(jagg_frac=0.5))


def test_fsdp2_in_one_process_equals_the_plain_module():
    """FSDP2 on a 1-rank group: the windows' backward runs through FSDP into its sharded gradient
    storage (runtime/sharded_grads.py), scaled by grad_output at loss.backward(); the 2-rank cases
    are in test_sharded.py."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    plain = AffineJacobianField(3, seed=3)
    args = chord_inputs()
    _, want = loss_and_grad(jagg_compile(grpo_like, window=4, backward="lowmem"), (plain, *args), plain)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = AffineJacobianField(3, seed=3)
        fully_shard(model)
        low = jagg_compile(grpo_like, dit=model, window=4, backward="lowmem")
        (low(model, *args) * 8.0).backward()
        got = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
        assert low.report.path == "fx"
        assert rel_err(got, 8.0 * want) < 1e-12
    finally:
        dist.destroy_process_group()


def test_a_parameter_the_graph_reaches_through_a_stand_in_is_refused():
    """A weight swapped for a trainable copy during the forward (what FSDP's gathered parameters
    look like to autograd): autograd.grad over the parameters would return None for it and drop its
    gradient; the window's backward refuses instead, naming the parameter, and .grad stays clean."""
    ex = example_losses.build_example("flow_grpo_sd3", num_steps=8, batch=2, seed=0)
    proj = ex.model.proj_out
    stand_in = torch.nn.Parameter(proj.weight.detach().clone())
    forward = proj.forward
    proj.forward = lambda x: torch.nn.functional.linear(x, stand_in, proj.bias)
    low = jagg_compile(ex.loss_fn, window=4, backward="lowmem")
    with pytest.raises(JaggUnsupportedError, match=r"window 0: the graph computes with 1 trainable tensor\(s\) that "
                                                   r"are not the DiT's parameters .*proj_out.weight"):
        low(ex.model, ex.batch)
    assert all(p.grad is None for p in ex.model.parameters())
    proj.forward = forward
    low(ex.model, ex.batch).backward()                   # the same loss without the swap runs


def _policy(v, g):
    return ((v - g) ** 2).mean()


def _kl(v):
    return (v ** 2).mean()


# the linear forms place_lowmem_terms reads as sums of per-step terms with number coefficients;
# each is written the way a trainer writes it (Flow-GRPO's `loss - beta * kl` is a subtraction)
LINEAR_FORMS = {
    "minus_beta_kl": lambda v, g, k: _policy(v, g) - 0.04 * _kl(v),
    "negated": lambda v, g, k: -_policy(v, g),
    "divided": lambda v, g, k: _policy(v, g) / 3.0,
    "number_times": lambda v, g, k: 2.5 * _policy(v, g) + _kl(v) * 0.5,
    "sub_of_sums": lambda v, g, k: (_policy(v, g) + _kl(v)) - (0.5 * _kl(v) - _policy(v, g) / 4),
}


@pytest.mark.parametrize("form", list(LINEAR_FORMS))
def test_every_linear_form_the_pass_accepts_gives_the_joint_gradient(form):
    """Reading ``a - b`` as ``a + b`` (or a sign or factor wrong) changes the gradient: each form,
    with its minus signs and number factors, must equal the joint mode and the exact gradient."""
    term = LINEAR_FORMS[form]

    def loss(dit, zs, ts, g):
        total = 0.0
        for k in range(zs.shape[0]):
            total = total - term(dit(zs[k], ts[k]), g[k], k) if k % 2 else total + term(dit(zs[k], ts[k]), g[k], k)
        return total / zs.shape[0]

    model = AffineJacobianField(3, seed=2)
    args = (model, *chord_inputs(seed=3))
    exact_loss, exact = loss_and_grad(loss, args, model)
    low = jagg_compile(loss, window=4, weights="t", backward="lowmem")
    low_loss, lowmem = loss_and_grad(low, args, model)
    _, joint = loss_and_grad(jagg_compile(loss, window=4, weights="t"), args, model)
    assert low.report.path == "fx"
    assert torch.allclose(low_loss, exact_loss, rtol=1e-12, atol=0)
    assert rel_err(lowmem, joint) < 1e-12 and rel_err(lowmem, exact) < 1e-8
