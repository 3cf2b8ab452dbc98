"""Flow-Factory's ``optimize`` on its default engine: accelerate with its DeepSpeed ZeRO-2 plugin,
2 gloo ranks, the user's two lines (``jaggc.stepwise(transformer, window=W)`` after ``prepare``,
the ``for`` line).

The plugin as Flow-Factory's ``config/deepspeed/deepspeed_zero2.yaml`` sets it (stage 2, nothing
offloaded; ``loops/flow_factory.deepspeed_zero2_accelerator``): ``accelerator.backward`` is the
engine's backward and, at the sync, its step (clip, optimizer step, zeroing), so the loop's clip +
``optimizer.step()`` + ``zero_grad()`` inside the last step's body read the engine's norm and are
no-ops. The steps come in the loop's seeded ``randperm`` order, the same on every rank, so jaggc runs
the deferred schedule, on ZeRO inside the last declared step's ``engine.backward`` (ZeRO takes
gradients only there). A LoRA (peft), its KL reference under ``disable_adapter()``, and the full
fine-tune, its reference's ``.data`` swapped into every trained parameter and back. One shared
2-rank run (a module fixture); each rank runs, in float32, the unchanged loop, W=2 and W=4
``weights="t"``, then a bf16 run (DeepSpeed's bf16 mode, bf16 latents: the timestep cast), for the
LoRA and the full fine-tune. Checked, for both:

  * W=2, with a clip that bites (``max_grad_norm`` 1e-5): ZeRO's reduced gradient at the engine's
    step (``safe_get_full_grad``, read as the step starts, before its clip), the clipped gradient
    (each rank's fp32 partition as ZeRO's torch optimizer steps on it), the parameters after the
    step, and every logged value equal the unchanged loop's. Bound 1e-6 relative for the gradient: the unchanged loop reduces each of the
    12 steps' gradients in its own ``engine.backward`` (all-reduce, average, add into the partition),
    jaggc each trajectory's 6 steps in one joint backward and one reduction: another summation order of
    ~12 fp32 summands per element (a few ulps, 6e-8 each, ~1e-7 as a norm). The parameters after
    AdamW's first step move by lr * g / (|g| + eps), a function whose relative change is at most the
    gradient's: the same 1e-6. The logged losses, ratios and KL come from the forwards, which jaggc
    leaves alone: bit-equal; the logged ``grad_norm`` is the engine's norm of the reduced gradient:
    the gradient's 1e-6;
  * W=4 ``weights="t"``: the reduced gradient equals the ranks' average of each rank's JAGG computed
    apart from jaggc (``reference_jagg``) to 1e-5 (the fp32 joint backward against the reference's
    summation order, and ZeRO's bucketed all-reduce against the test's: ~1e-7);
  * bf16: the two lines run, no refusal (the bf16 timestep is matched to the declared float32 one it
    rounds from), every window ran (2 JAGG windows, 2 joint backwards), the logged values finite;
    W=2 (LoRA): the logged forward values bit-equal, the reduced gradient within bf16's summation.
"""

from __future__ import annotations

import warnings

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

import jaggc  # noqa: E402
from jaggc._compat import zero_torch_optimizer  # noqa: E402
from jaggc_studies.loops import flow_factory as ff  # noqa: E402
from ranks import run_ranks  # noqa: E402
from test_sharded import clean  # noqa: E402
from test_stepwise_frameworks_distributed import FP32, NO_CLIP, WORLD, _reference, _rel  # noqa: E402

TIMEOUT_S = 600
#: a clip that bites (the tiny LoRA's gradient norm is ~1e-3): ZeRO clips inside the engine's step
CLIP = ff.TrainingArguments(max_grad_norm=1e-5)
BF16 = dict(latent_dtype=torch.bfloat16, mixed_precision="bf16", num_sde_steps=6)
FORWARD_VALUES = ("kl_div", "kl_loss", "ratio", "policy_loss", "loss", "clip_frac_high")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _loop(rank: int, stepwise, args=ff.TrainingArguments(), **kwargs) -> dict:
    """One epoch on ZeRO-2: ZeRO's reduced gradient as the engine's step starts, the parameters after
    it, the logged values, jaggc's counts."""
    from deepspeed.utils import safe_get_full_grad

    run = ff.setup(engine="deepspeed", shard=(rank, WORLD), stepwise=stepwise, training_args=args, **kwargs)
    engine = run.transformer
    assert type(engine).__name__ == "DeepSpeedEngine" and engine.zero_optimization_stage() == 2
    grads = []
    engine_step = engine.step

    def step(*a, **k):          # accelerator.backward steps the engine at the sync
        grads.append({clean(n): safe_get_full_grad(p).detach().clone()
                      for n, p in engine.module.named_parameters() if p.requires_grad})
        return engine_step(*a, **k)

    engine.step = step
    clipped = []

    def at_torch_step(opt, a, k):   # the rank's fp32 partition of the gradient, as ZeRO clipped it
        clipped.append(torch.cat([p.grad.detach().reshape(-1).clone() for g in opt.param_groups for p in g["params"]]))

    zero_torch_optimizer(engine).register_step_pre_hook(at_torch_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logged = (ff.train_unchanged if stepwise is None else ff.train_jaggc)(run)
    out = dict(grads=grads, clipped=clipped, logged=logged, order=run.adapter.scheduler.train_timesteps,
               params={clean(n): p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad})
    if stepwise is not None:
        c = jaggc.stepwise(engine).counts
        out["counts"] = (c.jagg_windows, c.backwards, c.fallbacks)
        jaggc.stepwise(engine).close()
    return out


def rank_body(rank: int, world: int) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")
    unchanged = _loop(rank, None, args=CLIP, **FP32)
    two = _loop(rank, dict(window=2), args=CLIP, **FP32)
    four = _loop(rank, dict(window=4, weights="t"), args=NO_CLIP, **FP32)
    reference = _reference(rank)
    bf16 = _loop(rank, dict(window=4), **BF16)
    bf16_w2 = (_loop(rank, None, **BF16), _loop(rank, dict(window=2), **BF16))
    # the full fine-tune: the reference's .data swapped into every trained parameter (ZeRO-2's views
    # into its flat buffer) and back, between each step's forward and its backward
    full = dict(unchanged=_loop(rank, None, args=CLIP, lora=False, **FP32),
                two=_loop(rank, dict(window=2), args=CLIP, lora=False, **FP32),
                four=_loop(rank, dict(window=4, weights="t"), args=NO_CLIP, lora=False, **FP32),
                reference=_reference(rank, lora=False),
                bf16=_loop(rank, dict(window=4), lora=False, **BF16))
    initial = ff.setup(shard=(rank, WORLD), **FP32)
    initial = {clean(n): p.detach().clone() for n, p in initial.accelerator.unwrap_model(initial.transformer)
               .named_parameters() if p.requires_grad}
    return dict(unchanged=unchanged, two=two, four=four, reference=reference, bf16=bf16, bf16_w2=bf16_w2, initial=initial,
                full=full)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="flow_factory_zero2", timeout_s=TIMEOUT_S)


def test_the_steps_come_in_a_random_order(ranks):
    order = ranks[0]["unchanged"]["order"]
    assert order != sorted(order) and all(r[k]["order"] == order for r in ranks for k in ("two", "four"))


def test_one_engine_step_per_epoch(ranks):
    """Two batches (trajectories) per sync: the engine steps once, at the second batch's last step."""
    for r in ranks:
        for run in [r[k] for k in ("unchanged", "two", "four", "bf16")] + [r["full"][k] for k in ("unchanged", "two", "four", "bf16")]:
            assert len(run["grads"]) == 1 and len(run["logged"]) == 1, len(run["grads"])


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_window_two_is_the_unchanged_loop(ranks, tuning):
    for r in ranks:
        r = r if tuning == "lora" else r["full"]
        unchanged, two = r["unchanged"], r["two"]
        assert two["counts"] == (0, 2, 0)       # every window exact, one joint backward per trajectory
        print(f"ZeRO-2 W=2 vs unchanged: gradient {_rel(two['grads'][0], unchanged['grads'][0]):.3g}, "
              f"parameters {_rel(two['params'], unchanged['params']):.3g}")
        assert _rel(two["grads"][0], unchanged["grads"][0]) <= 1e-6, _rel(two["grads"][0], unchanged["grads"][0])
        assert _rel(two["params"], unchanged["params"]) <= 1e-6, _rel(two["params"], unchanged["params"])
        [got], [want] = two["logged"], unchanged["logged"]
        assert sorted(got) == sorted(want) == sorted(FORWARD_VALUES + ("grad_norm",))
        for k in FORWARD_VALUES:
            assert torch.equal(got[k], want[k]), (k, got[k], want[k])
        assert float(want["kl_div"]) > 0        # the KL reference (disable_adapter, .data swap) is another model
        assert abs(float(got["grad_norm"]) / float(want["grad_norm"]) - 1) <= 1e-6
        assert float(want["grad_norm"]) > 10 * CLIP.max_grad_norm        # the clip bites
        # the clipped gradient (this rank's partition, as ZeRO's torch optimizer steps on it)
        [got_clipped], [want_clipped] = two["clipped"], unchanged["clipped"]
        assert float(want_clipped.norm()) < float(want["grad_norm"]) / 10
        rel = float((got_clipped.double() - want_clipped.double()).norm() / want_clipped.double().norm())
        assert rel <= 1e-6, rel
        # the norm ZeRO clipped by is the reduced gradient's
        norm = float(torch.cat([g.double().reshape(-1) for g in unchanged["grads"][0].values()]).norm())
        assert abs(float(want["grad_norm"]) / norm - 1) <= 1e-5, (float(want["grad_norm"]), norm)


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_window_four_is_the_ranks_average_jagg(ranks, tuning):
    ranks = [r if tuning == "lora" else r["full"] for r in ranks]
    for r in ranks:
        four = r["four"]
        assert four["counts"] == (2, 2, 0)      # a JAGG window of 4 and an exact one of 2, per trajectory
        print(f"ZeRO-2 W=4 vs the ranks' average reference JAGG: {_rel(four['grads'][0], r['reference']):.3g}")
        assert _rel(four["grads"][0], r["reference"]) <= 1e-5, _rel(four["grads"][0], r["reference"])
        # the JAGG is not the exact gradient: the comparison can tell W=4 from the unchanged loop
        assert _rel(r["reference"], r["unchanged"]["grads"][0]) > 1e-4, _rel(r["reference"], r["unchanged"]["grads"][0])
    a, b = (r["four"]["grads"][0] for r in ranks)
    assert _rel(a, b) <= 1e-7                   # the ranks hold the same reduced gradient


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_bf16_latent_storage_runs(ranks, tuning):
    for r in ranks:
        bf16 = r["bf16"] if tuning == "lora" else r["full"]["bf16"]
        assert bf16["counts"] == (2, 2, 0)
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in bf16["logged"][0].values())


def test_the_step_moved_the_parameters(ranks):
    for r in ranks:
        assert _rel(r["unchanged"]["params"], r["initial"]) > 1e-4     # (the LoRA's; W=2 compares against it)


def test_bf16_window_two_is_the_unchanged_loop_to_bf16s_summation(ranks):
    """DeepSpeed's bf16 mode, W=2: the logged forward values bit-equal; ZeRO's reduced gradient within
    bf16's summation: the unchanged loop hands ZeRO each step's bf16 gradient alone, jaggc's joint
    backward first adds a trajectory's 6 steps' bf16 gradients in the module's bf16 (5 roundings of
    2^-9 of the running sum: <= 6 * 2^-9 ~ 1.2e-2 of the summands' size, where the steps' gradients
    do not cancel; measured 5.7e-3; bound 2^-6)."""
    for r in ranks:
        unchanged, two = r["bf16_w2"]
        assert two["counts"] == (0, 2, 0)
        for k in FORWARD_VALUES:
            assert torch.equal(two["logged"][0][k], unchanged["logged"][0][k]), k
        err = _rel(two["grads"][0], unchanged["grads"][0])
        print(f"ZeRO-2 bf16 W=2 vs unchanged: gradient {err:.3g}, parameters {_rel(two['params'], unchanged['params']):.3g}")
        assert err <= 2 ** -6, err
