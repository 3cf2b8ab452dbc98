"""JAGG windows under FSDP2 (``torch.distributed.fsdp.fully_shard``), 2 processes, gloo, CPU.

The tiny diffusers SD3 transformer is sharded the usual way (each transformer block, then the
root: 3 FSDP parameter groups) and every rank holds half of a global batch, as in test_ddp.py
(same inputs, same normalisation: FSDP2 averages gradients over ranks like DDP). Checked:

  * gradients: after one ``loss.backward()`` the sharded gradients, gathered with
    ``full_tensor()``, equal the single-process JAGG gradient of the union of both ranks'
    batches (a W=4 window, a W=3 window, the 7-step trajectory through ``jagg_calls``, a
    ``@jagg_compile``-d loss in both backward modes), and the per-step exact loop's equal the
    single-process exact gradient;
  * the knot forward goes through the FSDP module call, so FSDP's hooks run: its parameters are
    all-gathered for the forward and the backward, and its gradients reduce-scattered. Counted by
    wrapping ``torch.distributed.reduce_scatter_single`` / ``all_gather_single`` (what FSDP2's
    default collectives call in torch 2.13; _fully_shard/_fsdp_collectives.py);
  * one reduce-scatter per FSDP group per DiT backward, hence **per window**: a per-window
    backward loop (and the compiled loss with ``backward="per_window"``) makes 3 per window,
    while the Flow-GRPO per-step loop (one backward per step) makes 3 per STEP; one backward over
    the whole trajectory (default joint mode) makes 3 for all its windows.

The ranks are forked from the test process (imports already warm) by ``ranks.run_ranks``, with the
inputs test_ddp.py uses (tests/ranks.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from jaggc import jagg_compile, models
from jaggc.runtime import jagg_calls, run_window

from ranks import GLOBAL_B, T, assert_grads_match, global_inputs, loss_of, run_ranks, shard, window_slices

WORLD = 2
TIMEOUT_S = 240
GROUPS = 3          # FSDP parameter groups: transformer_blocks[0], transformer_blocks[1], the root
WINDOWS = [slice(0, 4), slice(4, 7)]


def sharded_model():
    from torch.distributed.fsdp import fully_shard

    model = models.sd3(seed=0)
    for block in model.transformer_blocks:
        fully_shard(block)
    fully_shard(model)
    return model


class Collectives:
    """Counts FSDP2's reduce-scatters and all-gathers (torch.distributed.*_single)."""

    def __init__(self):
        self.rs = self.ag = 0
        self._rs, self._ag = dist.reduce_scatter_single, dist.all_gather_single

    def __enter__(self):
        def rs(*a, **k):
            self.rs += 1
            return self._rs(*a, **k)

        def ag(*a, **k):
            self.ag += 1
            return self._ag(*a, **k)

        dist.reduce_scatter_single, dist.all_gather_single = rs, ag
        return self

    def __exit__(self, *exc):
        dist.reduce_scatter_single, dist.all_gather_single = self._rs, self._ag


def full_grads(named_params) -> dict[str, torch.Tensor]:
    """Gathered (unsharded) gradients; a collective, so every rank calls it in the same order."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in named_params if p.grad is not None}


def zero_sharded(named_params) -> None:
    """Clear the SHARDED parameters' gradients (what optimizer.zero_grad() does). Not
    ``model.zero_grad()``: after a forward without backward FSDP2 leaves the root's parameters
    unsharded, the module then holds the unsharded parameters, and ``model.zero_grad()`` misses
    the sharded gradients (test_fsdp2_zero_grad_after_forward_only_trap)."""
    for _, p in named_params:
        p.grad = None


def compiled_linear_loss(dit, batch):
    """Σ_k <v_k, g_k> * world/GLOBAL_B written as a GRPO loss: dict batch, a loop over steps."""
    total = 0.0
    for j in range(batch["latents"].shape[1]):
        v = dit(hidden_states=batch["latents"][:, j], timestep=batch["timesteps"][:, j],
                encoder_hidden_states=batch["encoder_hidden_states"],
                pooled_projections=batch["pooled_projections"], return_dict=False)[0]
        total = total + (v * batch["g"][:, j]).sum()
    return total * batch["scale"]


def as_batch(calls, gs, world: int) -> dict:
    kw = [c.kwargs for c in calls]
    return dict(latents=torch.stack([k["hidden_states"] for k in kw], 1),
                timesteps=torch.stack([k["timestep"] for k in kw], 1),
                encoder_hidden_states=kw[0]["encoder_hidden_states"],
                pooled_projections=kw[0]["pooled_projections"],
                g=torch.stack(gs, 1), scale=torch.tensor(world / GLOBAL_B))


# --------------------------------------------------------------------------- rank process


def run_rank(rank: int, world: int) -> dict:
    model = sharded_model()
    params = list(model.named_parameters())   # the sharded (DTensor) parameters
    calls, gs = shard(*global_inputs(model), rank, world)
    res: dict = {}

    def record(name, fn):
        zero_sharded(params)
        with Collectives() as c:
            fn()
        res[name] = full_grads(params)
        res[name + "_collectives"] = (c.rs, c.ag)

    for name, sl in window_slices().items():                          # one window, one backward
        record(name, lambda sl=sl: loss_of(run_window(model, calls[sl]), gs[sl], world).backward())
    record("traj", lambda: loss_of(jagg_calls(model, calls, window=4), gs, world).backward())

    def per_window_loop():                                            # backward once per window
        for sl in WINDOWS:
            loss_of(run_window(model, calls[sl]), gs[sl], world).backward()
    record("window_loop", per_window_loop)

    def exact_loop():                                                 # Flow-GRPO: once per step
        for c, g in zip(calls, gs):
            loss_of([c(model)], [g], world).backward()
    record("exact_loop", exact_loop)

    batch = as_batch(calls, gs, world)
    for mode in ("joint", "per_window"):
        compiled = jagg_compile(compiled_linear_loss, window=4, backward=mode)
        # capture first with a forward only, after the backward passes above: Dynamo's trace
        # must not disturb FSDP's state (frontends.dynamo.real_run_as_fake)
        compiled(model, batch)
        record("compiled_" + mode, lambda: compiled(model, batch).backward())
        res["compiled_" + mode + "_path"] = compiled.report.path

    # negative control, plain FSDP2: a forward without backward, then model.zero_grad()
    w4 = window_slices()["w4"]
    zero_sharded(params)
    loss_of(run_window(model, calls[w4]), gs[w4], world).backward()
    with torch.no_grad():
        calls[0](model)
    registered = dict(model.named_parameters())
    res["after_forward_only"] = (type(registered["proj_out.weight"]).__name__,
                                 type(registered["transformer_blocks.0.attn.to_q.weight"]).__name__)
    model.zero_grad(set_to_none=True)
    loss_of(run_window(model, calls[w4]), gs[w4], world).backward()
    res["zero_grad_trap"] = full_grads(params)
    return res


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    models.sd3(seed=0)  # warm the lazy diffusers imports before forking
    return run_ranks(run_rank, WORLD, tmp_path_factory, name="FSDP", timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference():
    """Single-process gradients on the union of both ranks' batches (unsharded model)."""
    model = models.sd3(seed=0)
    calls, gs = global_inputs(model)

    def grad(fn):
        model.zero_grad(set_to_none=True)
        fn()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = {name: grad(lambda sl=sl: loss_of(run_window(model, calls[sl]), gs[sl], 1).backward())
           for name, sl in window_slices().items()}
    ref["traj"] = grad(lambda: loss_of(jagg_calls(model, calls, window=4), gs, 1).backward())
    ref["exact"] = grad(lambda: loss_of([c(model) for c in calls], gs, 1).backward())
    return ref


@pytest.mark.parametrize("name,want", [("w4", "w4"), ("w3", "w3"), ("traj", "traj"), ("window_loop", "traj"),
                                       ("compiled_joint", "traj"), ("compiled_per_window", "traj"),
                                       ("exact_loop", "exact")])
def test_fsdp_gradient_equals_single_process(rank_results, reference, name, want):
    for res in rank_results:
        assert_grads_match(res[name], reference[want])
    for n in rank_results[0][name]:   # gathered gradients: the same full tensor on both ranks
        torch.testing.assert_close(rank_results[0][name][n], rank_results[1][name][n], rtol=0, atol=0)


def test_fsdp2_zero_grad_after_forward_only_trap(rank_results, reference):
    """Plain FSDP2 (torch 2.13), no jaggc: after a forward without backward (an eval forward, a
    capture or ``jaggc.explain`` call) the root's parameters stay unsharded, ``model.zero_grad()``
    clears the unsharded copies, and the next backward ADDS to the stale sharded gradients of the
    root group: its gradient is silently doubled, the blocks' are right. optimizer.zero_grad()
    (the sharded parameters) is not affected."""
    want = reference["w4"]
    for res in rank_results:
        # the root's registered parameters are the unsharded ones, the blocks' the sharded DTensors
        assert res["after_forward_only"] == ("Parameter", "DTensor"), res["after_forward_only"]
        got = res["zero_grad_trap"]
        root = [n for n in want if not n.startswith("transformer_blocks.")]
        blocks = [n for n in want if n.startswith("transformer_blocks.")]
        assert root and blocks
        assert_grads_match({n: got[n] / 2 for n in root}, {n: want[n] for n in root})
        assert_grads_match({n: got[n] for n in blocks}, {n: want[n] for n in blocks})


def test_compiled_loss_was_captured(rank_results):
    for res in rank_results:
        assert res["compiled_joint_path"] == "fx" and res["compiled_per_window_path"] == "fx"


@pytest.mark.parametrize("name,backwards", [
    ("w4", 1), ("w3", 1),                       # a window: one joint DiT backward
    ("traj", 1), ("compiled_joint", 1),         # two windows, one backward over the whole loss
    ("window_loop", 2), ("compiled_per_window", 2),   # two windows, one backward per window
    ("exact_loop", T),                          # the per-step loop: one backward per step
])
def test_fsdp_reduce_scatters_once_per_group_per_backward(rank_results, name, backwards):
    for res in rank_results:
        rs, ag = res[name + "_collectives"]
        assert rs == GROUPS * backwards, (name, rs, ag)
        assert ag > 0   # the forward went through FSDP's pre-forward hook (all-gather)
