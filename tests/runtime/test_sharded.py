"""The three backward modes under FSDP1 and FSDP2 (and DDP), 2 gloo ranks, a DanceGRPO loss on Flux.

The tiny diffusers Flux is wrapped as the trainers wrap it (``jaggc_studies.bench.sharded.wrap_dit``):
FSDP1 with one unit per transformer block, FULL_SHARD, ``use_orig_params`` False (DanceGRPO's)
and True; FSDP2 ``fully_shard`` per block then the root; each with and without non-reentrant
activation checkpointing on the blocks (after the FSDP1 wrap, as DanceGRPO does; before
``fully_shard``, as torchtitan does). Every rank holds half of a global batch of 4 samples of a
stored 8-step rollout and computes ``dance_grpo_loss`` (DanceGRPO's flux_step log-prob, PPO clip at
its clip range 1e-4: about half of the (sample, step) pairs are clipped) compiled with W=4 (two
windows). Checked, per wrapper, checkpointing and mode (joint, per_window, lowmem):

  * after ``loss.backward()`` the gathered gradient equals the single-process reference JAGG
    (``verify.reference.reference_jagg``, written independently of the runtime) of the whole batch
    to rel. err < 1e-4 (fp32), on both ranks;
  * collectives, counted by wrapping the torch.distributed functions FSDP calls: joint
    reduce-scatters once per FSDP unit (3) per loss, per_window and lowmem once per unit per window
    (6; the trainers' own per-step loop: 24); DDP all-reduces once per loss in every mode;
  * memory per rank: lowmem's peak saved activations are one window's (the peak of the same loss
    on the first window alone), joint's are two windows'; lowmem's buffer is the rank's shard of one
    gradient (its storage bytes equal the sharded parameters'); no mode, per_window included, holds
    more gradient than one shard at any later DiT forward (FSDP1 per_window used to ``no_sync`` the
    earlier windows: a full unsharded gradient per rank);
  * lowmem keeps the loss's ``grad_output`` (x0.25 on top of accumulated gradients), a
    ``ShardedGradScaler``, and the user's own no-sync micro-steps (FSDP1 ``no_sync()``, FSDP2
    ``set_requires_gradient_sync(False)``: no reduce-scatter in the micro-step, the sum after the
    synced one);
  * a weight the DiT computes with through a trainable stand-in (an injected "parameter got no
    gradient" case) is refused under every wrapper before anything reaches ``.grad``; so is a
    second backward of a retained lowmem loss under FSDP (its buffer went to ``.grad`` in the first).

One fork of 2 ranks runs every case (``ranks.run_ranks``; about a minute on 2 cores).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from jaggc import JaggUnsupportedError, jagg_compile
from jaggc_studies.bench.problems import build_problem
from jaggc_studies.bench.sharded import GradientWatch, count_collectives, dance_grpo_loss, gradient_sizes, install_ddp_counter, parameter_storages, rank_share, step_slice, wrap_dit
from jaggc.runtime.memory import track_saved_tensors

from helpers import reference_jagg, rel_err
from ranks import run_ranks

WORLD, STEPS, WINDOW, GLOBAL_B = 2, 8, 4, 4
UNITS = 3                     # FSDP units / FSDP2 groups: the double block, the single block, the root
FSDP = ("fsdp1", "fsdp1_orig", "fsdp2")
MODES = ("joint", "per_window", "lowmem")
CASES = [(w, ac) for w in FSDP for ac in (False, True)]
TIMEOUT_S = 600

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*returned a view tensor")]


@pytest.fixture(scope="module")
def problem():
    """The tiny Flux, its stored rollout and the off-policy step, built once (the ranks inherit it)."""
    return build_problem("flux", "tiny", num_steps=STEPS, batch=GLOBAL_B, seed=0)


# --------------------------------------------------------------------------- rank side


def clean(name: str) -> str:
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def full_grads(dit, wrapper: str) -> dict[str, torch.Tensor]:
    """The gathered gradient by parameter name (a collective: every rank calls it in order)."""
    if wrapper == "fsdp2":
        return {clean(n): p.grad.full_tensor() for n, p in dit.named_parameters() if p.grad is not None}
    if wrapper == "ddp":
        return {clean(n): p.grad.clone() for n, p in dit.named_parameters() if p.grad is not None}
    from torch.distributed.fsdp import FullyShardedDataParallel

    out = {}
    paths = {id(m): clean(n) for n, m in dit.named_modules()}
    for unit in FullyShardedDataParallel.fsdp_modules(dit):
        flat = unit._handle.flat_param
        full = torch.empty(flat.grad.numel() * WORLD)
        dist.all_gather_into_tensor(full, flat.grad.contiguous())
        prefix = paths[id(unit)].removesuffix(".")
        for fqn, piece, shape in zip(flat._fqns, full.split(list(flat._numels) + [full.numel() - sum(flat._numels)]),
                                     flat._shapes):
            out[".".join(filter(None, (prefix, clean(fqn))))] = piece.view(shape).clone()
    return out


def zero(dit) -> None:
    for p in dit.parameters():
        p.grad = None


def run_case(dit, wrapper: str, share: dict, mode: str) -> dict:
    compiled = jagg_compile(dance_grpo_loss, dit=dit, window=WINDOW, weights="t", backward=mode)
    zero(dit)
    ddp = dit if wrapper == "ddp" else None
    with count_collectives(ddp) as counts, track_saved_tensors(parameter_storages(dit)) as saved, \
            GradientWatch(dit) as watch:
        compiled(dit, share).backward()
    return dict(grads=full_grads(dit, wrapper), collectives=dict(counts), peak=saved.peak_bytes,
                held=watch.peak, buffer=compiled.report.lowmem_buffer_bytes, path=compiled.report.path,
                compiled=compiled)


def one_window_peak(dit, share: dict) -> int:
    """Peak saved activations of the same loss on the first window's steps alone (joint mode)."""
    compiled = jagg_compile(dance_grpo_loss, dit=dit, window=WINDOW, weights="t")
    zero(dit)
    with track_saved_tensors(parameter_storages(dit)) as saved:
        compiled(dit, step_slice(share, slice(0, WINDOW))).backward()
    return saved.peak_bytes


def stand_in_refused(dit, share: dict) -> tuple[str, bool]:
    """x_embedder computes with a trainable copy of its weight: lowmem must refuse."""
    lin = next(m for n, m in dit.named_modules() if clean(n) == "x_embedder")
    stand_in = torch.nn.Parameter(torch.zeros(lin.out_features, lin.in_features))
    forward = lin.forward
    lin.forward = lambda x: torch.nn.functional.linear(x, stand_in, lin.bias)
    zero(dit)
    try:
        jagg_compile(dance_grpo_loss, dit=dit, window=WINDOW, weights="t", backward="lowmem")(dit, share).backward()
        message = ""
    except JaggUnsupportedError as e:
        message = str(e)
    finally:
        lin.forward = forward
    return message, all(p.grad is None for p in dit.parameters()) and stand_in.grad is None


def backward_twice_refused(dit, lowmem, share: dict) -> str:
    """A retained lowmem loss backpropagated twice: its buffer went into .grad in the first."""
    zero(dit)
    loss = lowmem(dit, share)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except JaggUnsupportedError as e:
        return str(e)
    return ""


def run_rank(problem, rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    share = rank_share(problem.batch, rank, world)
    res: dict = {}
    for wrapper, ac in CASES + [("ddp", False), ("ddp", True)]:
        key = f"{wrapper}{'+ac' if ac else ''}"
        dit = wrap_dit(copy.deepcopy(problem.model), wrapper, checkpointing=ac)
        if wrapper == "ddp":
            install_ddp_counter(dit)
        res[key + "/sizes"] = gradient_sizes(dit, problem.num_params)
        for mode in MODES if wrapper != "ddp" else ("joint", "lowmem"):      # lowmem last
            case = run_case(dit, wrapper, share, mode)
            lowmem = case.pop("compiled")
            res[f"{key}/{mode}"] = case
        if wrapper == "ddp":
            if not ac:
                res[key + "/stand_in"] = stand_in_refused(dit, share)
            continue
        # on top of lowmem's own gradient (still in .grad, lowmem ran last): a quarter more, via grad_output
        (lowmem(dit, share) * 0.25).backward()
        res[key + "/scaled"] = full_grads(dit, wrapper)
        res[key + "/one_window_peak"] = one_window_peak(dit, share)
        if not ac:
            res[key + "/stand_in"] = stand_in_refused(dit, share)
            res[key + "/twice"] = backward_twice_refused(dit, lowmem, share)
            continue
        # the trainers' configuration: the user's no-sync micro-step, then a synced one
        zero(dit)
        with count_collectives() as counts:
            if wrapper == "fsdp2":
                dit.set_requires_gradient_sync(False)
                lowmem(dit, share).backward()
                dit.set_requires_gradient_sync(True)
            else:
                with dit.no_sync():
                    lowmem(dit, share).backward()
        res[key + "/nosync_collectives"] = dict(counts)
        lowmem(dit, share).backward()
        res[key + "/nosync_then_sync"] = full_grads(dit, wrapper)
        zero(dit)
        scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 12)
        optimizer = torch.optim.SGD(dit.parameters(), lr=0.0)
        scaler.scale(lowmem(dit, share)).backward()
        scaler.unscale_(optimizer)
        res[key + "/scaler"] = full_grads(dit, wrapper)
    # FSDP2 with bf16 mixed precision: fp32 states go in (FSDP casts them), W=2 is the exact loss
    dit = wrap_dit(copy.deepcopy(problem.model), "fsdp2", checkpointing=False, param_dtype=torch.bfloat16)
    zero(dit)
    dance_grpo_loss(dit, share).backward()
    res["fsdp2+bf16/exact"] = full_grads(dit, "fsdp2")
    for mode in ("joint", "lowmem"):
        zero(dit)
        jagg_compile(dance_grpo_loss, dit=dit, window=2, backward=mode)(dit, share).backward()
        res[f"fsdp2+bf16/{mode}"] = full_grads(dit, "fsdp2")
    dit = wrap_dit(copy.deepcopy(problem.model), "fsdp2", checkpointing=False)
    zero(dit)
    dance_grpo_loss(dit, share).backward()
    res["fsdp2/exact_fp32"] = full_grads(dit, "fsdp2")
    return res


# --------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def rank_results(problem, tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    return run_ranks(lambda rank, world: run_rank(problem, rank, world), WORLD, tmp_path_factory,
                     name="sharded", timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(problem):
    """Reference JAGG on the whole global batch, single process, unwrapped model: by name."""
    model = copy.deepcopy(problem.model)
    _, flat = reference_jagg(dance_grpo_loss, (model, problem.batch), model, WINDOW, weights="t")
    out, offset = {}, 0
    for name, p in model.named_parameters():
        out[name] = flat[offset:offset + p.numel()].view(p.shape).to(torch.float32)
        offset += p.numel()
    return out


def test_the_ppo_clip_is_real(problem):
    """About half of the (sample, step) pairs sit on the clipped branch (no gradient), none near a
    clipping boundary (fp32 noise could flip it between a batched and a per-rank forward)."""
    from jaggc_studies import example_losses as el
    from jaggc_studies.bench.sharded import DANCE_CLIP_RANGE

    b = problem.batch
    with torch.no_grad():
        ratios, advantages = [], []
        for j in range(STEPS):
            pred = problem.model(hidden_states=b["latents"][:, j], encoder_hidden_states=b["encoder_hidden_states"],
                                 timestep=b["timesteps"][:, j] / 1000, pooled_projections=b["pooled_prompt_embeds"],
                                 txt_ids=b["text_ids"], img_ids=b["image_ids"], return_dict=False)[0]
            lp = el.flux_step(pred, b["latents"][:, j], el.ETA, b["sigmas"][:, j], b["sigmas_next"][:, j],
                              b["next_latents"][:, j])
            ratios.append(torch.exp(lp - b["log_probs"][:, j]))
            advantages.append(b["advantages"][:, j])
    r, a = torch.stack(ratios), torch.stack(advantages)
    clipped = ((a > 0) & (r > 1 + DANCE_CLIP_RANGE)) | ((a < 0) & (r < 1 - DANCE_CLIP_RANGE))
    assert 0.2 < float(clipped.float().mean()) < 0.8, clipped
    margin = torch.minimum((r - 1 - DANCE_CLIP_RANGE).abs(), (r - 1 + DANCE_CLIP_RANGE).abs())
    assert float(margin.min()) > 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wrapper,ac", CASES, ids=[f"{w}{'+ac' if ac else ''}" for w, ac in CASES])
def test_gradient_equals_single_process_reference(rank_results, reference, wrapper, ac, mode):
    key = f"{wrapper}{'+ac' if ac else ''}/{mode}"
    for res in rank_results:
        got = res[key]["grads"]
        assert set(got) == set(reference), sorted(set(got) ^ set(reference))
        assert rel_err(got, reference) < 1e-4, rel_err(got, reference)
        assert res[key]["path"] == "fx"
    for n in reference:    # the same full gradient on both ranks
        torch.testing.assert_close(rank_results[0][key]["grads"][n], rank_results[1][key]["grads"][n], rtol=0, atol=0)


@pytest.mark.parametrize("wrapper,ac", CASES, ids=[f"{w}{'+ac' if ac else ''}" for w, ac in CASES])
def test_reduce_scatters_per_loss(rank_results, wrapper, ac):
    """joint: once per unit per loss; per_window and lowmem: once per unit per window (each window's
    backward is an FSDP backward; summing windows first would need a full unsharded gradient)."""
    key = f"{wrapper}{'+ac' if ac else ''}"
    for res in rank_results:
        rs = {mode: res[f"{key}/{mode}"]["collectives"]["reduce_scatter_single"] for mode in MODES}
        assert rs == {"joint": UNITS, "per_window": 2 * UNITS, "lowmem": 2 * UNITS}, rs


@pytest.mark.parametrize("ac", [False, True])
def test_ddp_all_reduces_once_per_loss(rank_results, reference, ac):
    key = f"ddp{'+ac' if ac else ''}"
    for res in rank_results:
        joint, lowmem = res[key + "/joint"], res[key + "/lowmem"]
        assert lowmem["collectives"]["allreduce_buckets"] == joint["collectives"]["allreduce_buckets"] == 1
        assert rel_err(lowmem["grads"], reference) < 1e-4 and rel_err(joint["grads"], reference) < 1e-4


@pytest.mark.parametrize("wrapper,ac", CASES, ids=[f"{w}{'+ac' if ac else ''}" for w, ac in CASES])
def test_memory_per_rank(rank_results, wrapper, ac):
    key = f"{wrapper}{'+ac' if ac else ''}"
    for res in rank_results:
        one = res[key + "/one_window_peak"]
        low, joint = res[key + "/lowmem"], res[key + "/joint"]
        assert one > 0
        assert low["peak"] <= 1.1 * one, (low["peak"], one)          # one window's knot activations
        assert joint["peak"] >= 1.8 * one, (joint["peak"], one)      # every window's
        sizes = res[key + "/sizes"]
        assert sizes["shard_bytes"] < 0.6 * sizes["full_grad_bytes"]
        # the buffer is one shard of the gradient (FSDP's padding included), no more
        assert 0 < low["buffer"] <= sizes["shard_bytes"], (low["buffer"], sizes)
        for mode in MODES:   # what the wrapper holds at any later DiT forward: never unsharded
            assert res[f"{key}/{mode}"]["held"] <= sizes["shard_bytes"], (mode, res[f"{key}/{mode}"]["held"], sizes)
    assert rank_results[0][key + "/per_window"]["held"] > 0    # the watch sees the first window's shard


@pytest.mark.parametrize("wrapper,ac", CASES, ids=[f"{w}{'+ac' if ac else ''}" for w, ac in CASES])
def test_lowmem_keeps_grad_output_and_accumulation(rank_results, reference, wrapper, ac):
    key = f"{wrapper}{'+ac' if ac else ''}"
    want = {n: 1.25 * g for n, g in reference.items()}
    for res in rank_results:
        assert rel_err(res[key + "/scaled"], want) < 1e-4


@pytest.mark.parametrize("wrapper", FSDP)
def test_lowmem_honours_no_sync_and_the_grad_scaler(rank_results, reference, wrapper):
    key = f"{wrapper}+ac"
    want = {n: 2 * g for n, g in reference.items()}
    for res in rank_results:
        assert res[key + "/nosync_collectives"]["reduce_scatter_single"] == 0
        assert rel_err(res[key + "/nosync_then_sync"], want) < 1e-4
        assert rel_err(res[key + "/scaler"], reference) < 1e-4


@pytest.mark.parametrize("wrapper", FSDP + ("ddp",))
def test_a_stand_in_parameter_is_refused(rank_results, wrapper):
    for res in rank_results:
        message, clean_grads = res[wrapper + "/stand_in"]
        assert "trainable tensor(s) that are not the DiT's parameters" in message and "window 0" in message, message
        assert clean_grads


@pytest.mark.parametrize("wrapper", FSDP)
def test_a_second_backward_of_a_lowmem_loss_is_refused(rank_results, wrapper):
    for res in rank_results:
        assert "backpropagated twice" in res[wrapper + "/twice"], res[wrapper + "/twice"]


def test_fsdp2_bf16_mixed_precision_takes_fp32_states(rank_results):
    """MixedPrecisionPolicy(param_dtype=bf16) casts the inputs itself: fp32 stored states are not
    refused. At W=2 the joint mode gives the exact loss's gradient under the same policy bit for bit;
    lowmem sums its windows' reduced gradients in float32 where the one backward sums the steps' bf16
    gradients before the reduce, so it differs from it by bf16 rounding, and is no further from the
    float32 gradient than the bf16 exact one is."""
    for res in rank_results:
        exact, fp32 = res["fsdp2+bf16/exact"], res["fsdp2/exact_fp32"]
        assert rel_err(res["fsdp2+bf16/joint"], exact) < 1e-6
        bf16_error = rel_err(exact, fp32)
        assert 1e-4 < bf16_error < 5e-2                       # the policy computes in bf16
        assert rel_err(res["fsdp2+bf16/lowmem"], exact) < 2 ** -7
        assert rel_err(res["fsdp2+bf16/lowmem"], fp32) <= 1.5 * bf16_error
