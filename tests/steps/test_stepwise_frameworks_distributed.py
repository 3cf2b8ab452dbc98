"""The frameworks' loops on 2 gloo ranks with the user's two lines: Flow-Factory's ``optimize`` under
accelerate DDP, FSDP1 and FSDP2; verl-omni's engine loop on FSDP2.

The loop (``jaggc_studies.loops.flow_factory``) trains a random subset of steps in ``randperm``
order, the same on every rank, and clips, steps and zeroes the gradients at ``sync_gradients``
inside the last step's body. The ranks' steps come out of σ order, so jaggc runs the deferred
schedule (steps/ranks.py): every window's backward in one backward, at the end of the last declared
step's backward, before the clip. One shared multi-rank run per engine (a module fixture); each
rank runs, in float32 (no autocast, fp32 latents), the unchanged loop, W=2 and W=4 ``weights="t"``,
then a bf16-storage run under accelerate's live CPU bf16 autocast. Checked:

  * W=2: the clipped gradient (gathered, read in a pre-hook of the optimizer step), the parameters
    after the step and every logged value equal the unchanged loop's to fp32's 1e-6: the unchanged
    loop adds each step's gradient into ``.grad`` in its own backward, jaggc all steps' in one joint
    backward, a different order of ~ 2 x 4 summands per element (a few ulps, 6e-8 each), and the
    ranks reduce that sum once, as the unchanged loop does (DDP: one all-reduce at sync; FSDP2: a
    reduce-scatter per backward in the unchanged loop, one in jaggc's). The logged values are
    computed from the forwards, which jaggc does not change: equal bit for bit, but the clip's
    ``grad_norm``, a norm of that gradient (1e-6 relative: measured 1 ulp off on one CPU);
  * W=4: the gathered gradient equals the ranks' average of each rank's JAGG computed apart from
    jaggc (``reference_jagg``) to 1e-5 (the reduction across ranks and the summation order: ~1e-7);
  * on DDP, the full fine-tune too (the KL reference by a ``.data`` swap of every trained parameter);
  * bf16 latent storage (the dtype cast of the timestep) under the bf16 autocast: no refusal, every
    window ran (JAGG windows counted);
  * verl-omni (FSDP2, full fine-tune in float32, micro-batches x timesteps, per-row SDE windows, the
    old-log-prob pass under no_grad through the same loop): W=2 = the unchanged loop (gradient and
    parameters to 1e-6, the losses and old log-probs bit-equal), W=4 = the ranks' average JAGG (1e-5).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import jaggc
from helpers import reference_jagg
from jaggc_studies.loops import flow_factory as ff
from ranks import run_ranks
from test_sharded import clean, full_grads

WORLD = 2
TIMEOUT_S = 600
ENGINES = ("ddp", "fsdp1", "fsdp2")
FP32 = dict(latent_dtype=torch.float32, mixed_precision="no", num_sde_steps=6)
NO_CLIP = ff.TrainingArguments(max_grad_norm=1e12)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _params(model, engine: str) -> dict:
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {clean(n): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {clean(n): (p.detach().full_tensor() if engine == "fsdp2" else p.detach().clone())
            for n, p in model.named_parameters() if p.requires_grad}


def _grads(model, engine: str) -> dict:
    if engine == "fsdp1":          # use_orig_params: each parameter's gradient, gathered (a collective)
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=True):
            return {clean(n): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    trained = {clean(n) for n, p in model.named_parameters() if p.requires_grad}
    return {n: g for n, g in full_grads(model, engine).items() if n in trained}


def _setup(engine: str, rank: int, **kwargs):
    return ff.setup(engine="accelerate" if engine == "ddp" else engine, shard=(rank, WORLD), **kwargs)


def _loop(engine: str, rank: int, stepwise, args=ff.TrainingArguments(), **kwargs) -> dict:
    """One epoch; the gathered clipped gradient at the step, the parameters after, the logged values."""
    run = _setup(engine, rank, stepwise=stepwise, training_args=args, **kwargs)
    model = run.transformer
    seen = {}

    def at_step(opt, a, k):
        seen["grad"] = _grads(model, engine)

    run.optimizer.optimizer.register_step_pre_hook(at_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logged = (ff.train_unchanged if stepwise is None else ff.train_jaggc)(run)
    out = dict(grad=seen["grad"], params=_params(model, engine), logged=logged, run=run)
    if stepwise is not None:
        c = jaggc.stepwise(model).counts
        out["counts"] = (c.jagg_windows, c.backwards)
        jaggc.stepwise(model).close()
    return out


def _reference(rank: int, lora: bool = True) -> dict:
    """The ranks' average of each rank's JAGG (W=4, weights "t") of its two batches, computed apart
    from jaggc on an unwrapped model at the same parameters (one optimizer step per epoch: the
    initial ones)."""
    plain = ff.setup(shard=(rank, WORLD), training_args=NO_CLIP, lora=lora, **FP32)
    model = plain.accelerator.unwrap_model(plain.transformer)
    batches = _batches(plain)
    total = None
    for batch in batches:
        ref = copy.deepcopy(model)
        _, g = reference_jagg(lambda m: ff.reference_loss(plain, batch, m), (ref,), ref, 4)
        total = g if total is None else total + g
    flat = total.clone()                      # every parameter's, in order (zeros where frozen)
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    out, start = {}, 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            out[clean(n)] = flat[start:start + p.numel()].view_as(p)
        start += p.numel()
    return out


def _batches(run) -> list[dict]:
    """The epoch's sample batches, as ``optimize`` forms them (its seeded randperm)."""
    args = run.training_args
    perm = torch.randperm(len(run.samples), generator=torch.Generator().manual_seed(args.seed))
    shuffled = [run.samples[i] for i in perm]
    return [ff.stack(shuffled[i:i + args.per_device_batch_size])
            for i in range(0, len(shuffled), args.per_device_batch_size)]


def _rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    fa = torch.cat([a[k].double().reshape(-1) for k in sorted(a)])
    fb = torch.cat([b[k].double().reshape(-1) for k in sorted(b)])
    return float((fa - fb).norm() / fb.norm())


def rank_body(engine: str):
    def body(rank: int, world: int) -> dict:
        unchanged = _loop(engine, rank, None, **FP32)
        two = _loop(engine, rank, dict(window=2), **FP32)
        four = _loop(engine, rank, dict(window=4, weights="t"), args=NO_CLIP, **FP32)
        reference = _reference(rank)
        bf16 = _loop(engine, rank, dict(window=4), latent_dtype=torch.bfloat16, mixed_precision="bf16",
                     num_sde_steps=6)
        # every value the loop logs from its steps is the unchanged loop's bit for bit; the clip's grad_norm is
        # of the gradient, which the deferred schedule sums in another order (w2_grad's fp32 roundoff, <= 1e-6)
        logged_equal = all(torch.equal(x[k], y[k]) if k != "grad_norm" else
                           bool((x[k].double() - y[k].double()).abs() <= 1e-6 * y[k].double().abs())
                           for x, y in zip(unchanged["logged"], two["logged"]) for k in x)
        full = {}
        if engine == "ddp":
            # the full fine-tune: the reference's .data swapped into every trained parameter and back
            # between each step's forward and its backward
            full_unchanged = _loop(engine, rank, None, lora=False, **FP32)
            full_two = _loop(engine, rank, dict(window=2), lora=False, **FP32)
            full_four = _loop(engine, rank, dict(window=4, weights="t"), args=NO_CLIP, lora=False, **FP32)
            full = dict(full_w2_grad=_rel(full_two["grad"], full_unchanged["grad"]),
                        full_w2_params=_rel(full_two["params"], full_unchanged["params"]),
                        full_w4_grad=_rel(full_four["grad"], _reference(rank, lora=False)))
        return dict(**full,
            w2_grad=_rel(two["grad"], unchanged["grad"]), w2_params=_rel(two["params"], unchanged["params"]),
            w2_logged=logged_equal and len(two["logged"]) == len(unchanged["logged"]) == 1,
            w2_counts=two["counts"], w4_grad=_rel(four["grad"], reference), w4_counts=four["counts"],
            bf16_counts=bf16["counts"], order=unchanged["run"].adapter.scheduler.train_timesteps)
    return body


@pytest.fixture(scope="module", params=ENGINES)
def results(request, tmp_path_factory):
    return request.param, run_ranks(rank_body(request.param), WORLD, tmp_path_factory,
                                    name=f"flow_factory_{request.param}", timeout_s=TIMEOUT_S)


def test_the_steps_come_in_a_random_order(results):
    _, ranks = results
    order = ranks[0]["order"]
    assert order != sorted(order) and all(r["order"] == order for r in ranks)


def test_window_two_is_the_unchanged_loop(results):
    engine, ranks = results
    for r in ranks:
        assert r["w2_grad"] <= 1e-6, (engine, r["w2_grad"])
        assert r["w2_params"] <= 1e-6, (engine, r["w2_params"])
        assert r["w2_logged"]
        assert r["w2_counts"] == (0, 2)        # every window exact, all in one backward per trajectory


def test_window_four_is_the_ranks_average_jagg(results):
    engine, ranks = results
    for r in ranks:
        assert r["w4_grad"] <= 1e-5, (engine, r["w4_grad"])
        assert r["w4_counts"] == (2, 2)        # a JAGG window of 4 and an exact one of 2, per trajectory


def test_bf16_latent_storage_runs(results):
    _, ranks = results
    assert all(r["bf16_counts"] == (2, 2) for r in ranks)


# --- verl-omni's engine loop on FSDP2 ---------------------------------------------------------------

def _verl_case(rank: int, stepwise) -> dict:
    from jaggc_studies.loops import verl_omni as vo

    engine, data = vo.setup(shard=(rank, WORLD), fsdp2=True, stepwise=stepwise, max_grad_norm=1e12)
    seen = {}

    def at_step(opt, a, k):
        seen["grad"] = full_grads(engine.module, "fsdp2")

    engine.optimizer.register_step_pre_hook(at_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = vo.train_batch(engine, data, vo.train_unchanged if stepwise is None else vo.train_jaggc)
    result = dict(grad=seen["grad"], params=_params(engine.module, "fsdp2"), loss=out["loss"],
                  old=out["old_log_probs"], data=data)
    if stepwise is not None:
        c = jaggc.stepwise(engine.module).counts
        result["counts"] = (c.jagg_windows, c.backwards)
        jaggc.stepwise(engine.module).close()
    return result


def _verl_reference(rank: int, data: dict) -> dict:
    """The ranks' average of each rank's JAGG (W=4, "t") of its batch, apart from jaggc."""
    from jaggc_studies.loops import verl_omni as vo

    engine, _ = vo.setup(shard=(rank, WORLD))
    model = engine.module
    _, flat = reference_jagg(lambda m: vo.reference_loss(engine, data, m), (model,), model, 4)
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    out, start = {}, 0
    for n, p in model.named_parameters():
        out[clean(n)] = flat[start:start + p.numel()].view_as(p)
        start += p.numel()
    return out


def verl_body(rank: int, world: int) -> dict:
    unchanged = _verl_case(rank, None)
    two = _verl_case(rank, dict(window=2))
    four = _verl_case(rank, dict(window=4, weights="t"))
    reference = _verl_reference(rank, dict(four["data"], old_log_probs=four["old"]))
    return dict(w2_grad=_rel(two["grad"], unchanged["grad"]), w2_params=_rel(two["params"], unchanged["params"]),
                w2_loss=two["loss"] == unchanged["loss"], w2_old=torch.equal(two["old"], unchanged["old"]),
                w2_counts=two["counts"], w4_grad=_rel(four["grad"], reference), w4_counts=four["counts"])


@pytest.fixture(scope="module")
def verl_results(tmp_path_factory):
    return run_ranks(verl_body, WORLD, tmp_path_factory, name="verl_omni_fsdp2", timeout_s=TIMEOUT_S)


def test_verl_omni_window_two_is_the_unchanged_loop(verl_results):
    """Each micro-batch's 4 steps: two exact windows of 2 in σ order (no deferred schedule), each
    step its own backward and reduce-scatter as in the loop; fp32's bound for the reduction order."""
    for r in verl_results:
        assert r["w2_grad"] <= 1e-6 and r["w2_params"] <= 1e-6, r
        assert r["w2_loss"] and r["w2_old"]


def test_verl_omni_window_four_is_the_ranks_average_jagg(verl_results):
    for r in verl_results:
        assert r["w4_grad"] <= 1e-5, r["w4_grad"]
        assert r["w4_counts"] == (2, 2)        # one JAGG window per micro-batch, one backward each


def test_full_fine_tune_on_ddp(results):
    """The full fine-tune's KL reference by a ``.data`` swap of every trained parameter, on DDP:
    W=2 = the unchanged loop (fp32's 1e-6), W=4 = the ranks' average JAGG (1e-5)."""
    engine, ranks = results
    if engine != "ddp":
        pytest.skip("the .data swap of sharded parameters is not modelled (loops/flow_factory.py)")
    for r in ranks:
        assert r["full_w2_grad"] <= 1e-6 and r["full_w2_params"] <= 1e-6, r
        assert r["full_w4_grad"] <= 1e-5, r["full_w4_grad"]
