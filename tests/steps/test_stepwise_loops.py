"""The three trainers' own loops (``jaggc_studies.loops``) with the user's two-line change.

Each loop is the trainer's shape (Flow-GRPO: accelerate on the CPU, peft LoRA on a tiny SD3, CFG, KL
reference under ``disable_adapter``, ``accumulate``, clip at sync, ``optimizer.step()`` every step;
DanceGRPO: a random permutation of a random 60% of the steps per sample, per-step ``backward()``;
MixGRPO: the moving window), run unchanged and with ``jaggc.stepwise``:

  * the change is at most three lines (measured from the two loops' source);
  * W=2: the parameters after the optimizer steps equal the unchanged loop's (fp32, <= 1e-6), and
    every per-step value the loop sees (log-prob, ratio, loss) is the unchanged loop's bit for bit;
  * W=4, ``weights="t"``: ``.grad`` when the trajectory's last backward returns (read in a pre-hook
    of the optimizer step that follows) equals ``@jagg_compile``'s on the trajectory's whole loss with
    the same windows and weights (fp32 <= 1e-6, float64 <= 1e-12); the default's σ-aware placement too;
  * the trainers' GPU forms on the CPU: DanceGRPO's and MixGRPO's CUDA bf16 autocast blocks live
    (``cuda_autocast_on_cpu``), against the hand-computed reference JAGG under the same autocast;
    Flow-GRPO under accelerate's bf16 forward and under fp16 with a GradScaler in
    ``accelerator.backward`` (``fp16_on_cpu``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import jaggc
from helpers import grads, reference_jagg, rel_err
from jaggc.testing import cuda_autocast_on_cpu
from jaggc_studies import loops
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*no window of the declared trajectory runs JAGG")]


def trained_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def compiled_grad(loss, model, *args, weights="t", window=4, options=None):
    for p in model.parameters():
        p.grad = None
    compiled = jaggc.jagg_compile(loss, dit=model, window=window, weights=weights, options=options)
    compiled(model, *args).backward()
    return grads(model).clone()


@pytest.mark.parametrize("name", loops.LOOPS)
def test_the_change_is_at_most_three_lines(name):
    assert loops.lines_changed(name) <= 3
    diff = loops.user_diff(name)
    assert diff[0] == "+" + loops.INSTALL
    assert all("jaggc" in line for line in diff if line.startswith("+"))


# --- Flow-GRPO ----------------------------------------------------------------------------------

FLOW = dict(num_steps=6, batch=2, trajectories=2)


def flow_model(run):
    return run.accelerator.unwrap_model(run.transformer)


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_flow_grpo_window_two_is_the_unchanged_loop(precision):
    a = fg.setup(**FLOW, mixed_precision=precision)
    b = fg.setup(**FLOW, mixed_precision=precision, stepwise=dict(window=2))
    logged_a, logged_b = fg.train_unchanged(a), fg.train_jaggc(b)
    assert rel_err(trained_params(flow_model(b)), trained_params(flow_model(a))) <= 1e-6
    assert all(torch.equal(x, y) for sa, sb in zip(a.seen, b.seen) for x, y in zip(sa, sb))
    assert len(a.seen) == len(b.seen) == 12
    assert [sorted(d) for d in logged_a] == [sorted(d) for d in logged_b]
    assert all(torch.equal(da[k], db[k]) for da, db in zip(logged_a, logged_b) for k in da)
    jaggc.stepwise(b.transformer).close()


def on_each_step(optimizer, fn):
    """Call ``fn()`` in a pre-hook of every real optimizer step (after the loop's clip)."""
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: fn())


@pytest.mark.parametrize("precision,dtype,tol", [("no", torch.float32, 1e-6), ("no", torch.float64, 1e-12),
                                                 ("bf16", torch.float32, 1e-5), ("fp16", torch.float32, 1e-5)])
def test_flow_grpo_window_four_is_jagg(precision, dtype, tol):
    """W=4 over 6 trained steps (windows of 4 and 2): each trajectory's .grad at its optimizer step
    against the reference JAGG computed by hand from an eager run of its whole loss at the same
    parameters, in the same precision (with the GradScaler's scale), and without autocast against
    jagg_compile on that loss (float64: its defaults; fp32: each knot its own call)."""
    run = fg.setup(**FLOW, mixed_precision=precision, dtype=dtype, stepwise=dict(window=4, weights="t"),
                   config=fg.TrainConfig(max_grad_norm=1e12))
    model = flow_model(run)
    checked, steps = [], []

    def check():
        sample = run.samples_batched[len(steps)]
        steps.append(sample)
        scale = run.accelerator.scaler.get_scale() if run.accelerator.scaler is not None else 1.0
        ref_model = copy.deepcopy(model)
        _, ref = reference_jagg(lambda m: fg.reference_loss(run, sample, m) * scale, (ref_model,), ref_model, 4)
        checked.append(rel_err(grads(model), ref / scale))
        if precision == "no":
            # the whole-loss path's CFG split and batched knots round fp32 differently (1.1e-6 here):
            # with each knot its own call of the loop's shape the same sums are made
            options = None if dtype == torch.float64 else jaggc.Options(split_batches=False, batch_knots=False)
            compiled = compiled_grad(lambda m, smp: fg.reference_loss(run, smp, m), copy.deepcopy(model), sample,
                                     options=options)
            checked.append(rel_err(grads(model), compiled))

    on_each_step(run.optimizer.optimizer, check)
    fg.train_jaggc(run)
    assert len(checked) == (4 if precision == "no" else 2)
    assert max(checked) <= tol, checked
    c = jaggc.stepwise(run.transformer).counts
    assert (c.jagg_windows, c.exact_steps, c.backwards) == (2, 4, 6)
    jaggc.stepwise(run.transformer).close()


# --- DanceGRPO and MixGRPO ------------------------------------------------------------------------


def gpu_form(form: str):
    """The trainers' CUDA bf16 autocast blocks: off on this CPU ("cpu"), live bf16 ("gpu")."""
    return cuda_autocast_on_cpu() if form == "gpu" else contextlib.nullcontext()


LOOPS = {
    "dance_grpo": (dg, dict(num_steps=10, samples=2)),
    "mix_grpo": (mg, dict(samples=2)),
}


@pytest.mark.parametrize("form", ["cpu", "gpu"])
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_window_two_is_the_unchanged_loop(name, form):
    module, kwargs = LOOPS[name]
    with gpu_form(form):
        a, b = module.setup(**kwargs), module.setup(**kwargs, stepwise=dict(window=2))
        module.train_unchanged(a)
        module.train_jaggc(b)
    assert rel_err(trained_params(b.transformer), trained_params(a.transformer)) <= 1e-6
    assert len(a.seen) == len(b.seen) > 0
    assert all(torch.equal(x, y) for sa, sb in zip(a.seen, b.seen) for x, y in zip(sa, sb))
    jaggc.stepwise(b.transformer).close()


@pytest.mark.parametrize("weights", ["t", "default"])
@pytest.mark.parametrize("form", ["cpu", "gpu"])
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_window_four_is_jagg(name, form, weights):
    """Each sample's .grad at its optimizer step (gradient_accumulation_steps 1: one per sample)
    against the hand-computed reference JAGG of the sample's trajectory loss at the same parameters,
    under the same autocast; in the CPU form also against jagg_compile (each knot its own call)."""
    module, kwargs = LOOPS[name]
    basis = "t" if weights == "t" else None
    exact_below = None if weights == "t" else jaggc.runtime.weights.DEFAULT_WEIGHTS.exact_below
    checked, steps = [], []
    with gpu_form(form):
        run = module.setup(**kwargs, stepwise=dict(window=4) if basis is None else dict(window=4, weights=basis))
        model = run.transformer
        first_values = []

        def check():
            i = len(steps)
            steps.append(i)
            ref_model = copy.deepcopy(model)
            _, ref = reference_jagg(lambda m: module.reference_loss(run, i, m), (ref_model,), ref_model, 4,
                                    exact_below=exact_below)
            checked.append(rel_err(grads(model), ref))
            if form == "cpu":
                compiled = compiled_grad(lambda m, r: module.reference_loss(r, i, m), copy.deepcopy(model), run,
                                         weights="t" if basis else jaggc.runtime.weights.DEFAULT_WEIGHTS,
                                         options=jaggc.Options(batch_knots=False))
                checked.append(rel_err(grads(model), compiled))

        on_each_step(run.optimizer, check)
        module.train_jaggc(run)
        unchanged = module.setup(**kwargs)
        module.train_unchanged(unchanged)
    per_sample = len(run.seen) // 2
    assert all(torch.equal(x, y) for sa, sb in zip(run.seen[:per_sample], unchanged.seen[:per_sample])
               for x, y in zip(sa, sb))        # the first sample ran on the same parameters
    assert len(steps) == 2
    assert max(checked) <= (1e-6 if form == "cpu" else 1e-5), checked
    jaggc.stepwise(run.transformer).close()


@pytest.mark.parametrize("cur,steps", [(0, 4), (20, 3), (21, 2), (22, 1)])
def test_mix_grpo_moving_window(cur, steps):
    """MixGRPO's window at 4, 3, 2, 1 steps: the first sample's gradient is JAGG's over the window
    (3 steps: one interior step; 2 and 1: exact, the unchanged loop's)."""
    run = mg.setup(samples=2, cur=cur, stepwise=dict(window=4, weights="t"))
    unchanged = mg.setup(samples=2, cur=cur)
    assert len(run.train_timesteps) == steps
    seen, seen_unchanged = [], []
    on_each_step(run.optimizer, lambda: seen.append(grads(run.transformer).clone()))
    on_each_step(unchanged.optimizer, lambda: seen_unchanged.append(grads(unchanged.transformer).clone()))
    mg.train_jaggc(run)
    mg.train_unchanged(unchanged)
    fresh = mg.setup(samples=2, cur=cur)
    ref = compiled_grad(lambda m, r: mg.reference_loss(r, 0, m), fresh.transformer, fresh, weights="t",
                        options=jaggc.Options(batch_knots=False))
    assert rel_err(seen[0], ref) <= 1e-6
    if steps <= 2:
        assert rel_err(seen[0], seen_unchanged[0]) <= 1e-6
    else:
        assert rel_err(seen[0], seen_unchanged[0]) > 1e-4
    assert jaggc.stepwise(run.transformer).counts.jagg_windows == (2 if steps > 2 else 0)
    jaggc.stepwise(run.transformer).close()


def test_the_loop_report_measures_each_loop():
    """``jaggc trainers --loops``'s numbers on the tiny models: lines changed, ratios, memory within
    2.2x for the low-memory form, fewer FSDP1 reduce-scatters per trajectory on 2 ranks."""
    from jaggc_studies.loops import report

    results = report.run_loops(("mix_grpo",), size="tiny", rounds=1, progress=lambda _: None)
    r = results["mix_grpo"]
    assert r["lines_changed"] == 2
    forms = {"joint", "lowmem", "per_window"}
    # no CFG: no slice variant; the guard's probed trajectory beside the joint form
    assert set(r["speed"]["median"]) == forms | {f"{f}/cache" for f in forms} | {"joint/probe"}
    assert r["speed"]["counts"]["joint/probe"]["probe_backwards"] > 0
    assert all(v > 0 for v in r["speed"]["median"].values())
    assert set(r["speed"]["cost_model"]["ratio"]) == set(r["speed"]["median"])
    # the cache variants trained on-policy: every interior step and knot came from the rollout
    assert r["speed"]["counts"]["joint/cache"]["cached_forwards"] > 0
    assert r["speed"]["counts"]["joint"]["cached_forwards"] == 0
    assert r["memory"]["ratio"]["lowmem"] <= 2.2
    c = r["collectives"]["reduce_scatters_per_trajectory"]
    assert c["joint"] < c["unchanged"] and c["lowmem"] < c["unchanged"]
    text = report.format_loops(results)
    assert "mix_grpo: 2 lines changed" in text and "FSDP1 reduce-scatters per trajectory" in text
    assert "joint/cache" in text and "cost model" in text and "s/trajectory" in text


def test_docs_show_each_loop_s_diff_as_measured():
    """docs/trainers.md's diff blocks are ``user_diff`` of the loops, in order."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "trainers.md").read_text()
    shown = re.findall(r"^```diff\n(.*?)^```", text, re.M | re.S)
    assert [block.rstrip("\n") for block in shown[:3]] == ["\n".join(loops.user_diff(n)) for n in loops.LOOPS]


def test_the_loops_gpu_form_runs_here_at_tiny_size():
    """``jaggc trainers --loops flow_grpo --dtype bf16 --speed-size tiny``: bf16 weights, accelerate's
    bf16 mixed precision, the slice and the cache on-policy; every variant timed beside its model."""
    from jaggc_studies.loops import report
    from jaggc_studies.trainers.sizes import Where

    results = report.run_loops(("flow_grpo",), where=Where("tiny", dtype=torch.bfloat16), rounds=1,
                               progress=lambda _: None)
    s = results["flow_grpo"]["speed"]
    assert s["dtype"] == "bfloat16" and s["device"] == "cpu"
    assert {"joint/slice", "joint/cache", "per_window/cache"} <= set(s["median"])
    assert s["counts"]["joint/cache"]["cached_forwards"] > 0 and s["counts"]["joint/slice"]["sliced_steps"] > 0
    assert set(s["cost_model"]["units"]) == {"F", "B", "Fh", "Bh"}
    assert "bfloat16" in report.format_loops(results)


def test_the_published_flow_grpo_loop_is_built_as_flow_grpo_configures_it():
    """SD3.5-Medium (cut to one layer to fit this machine) with Flow-GRPO's LoRA: rank 32, alpha 64,
    the 8 attention projections, float32 adapters on a bf16 base; one on-policy epoch with the cache."""
    from jaggc_studies.loops import rollouts
    from jaggc_studies.trainers.sizes import FLOW_GRPO_LORA, Where

    run = fg.setup(num_steps=4, batch=1, trajectories=1, where=Where("published", layers=1, resolution=64,
                                                                      dtype=torch.bfloat16),
                   stepwise=dict(window=4, weights="t", cfg_slice=True, rollout_cache=True))
    model = flow_model(run)
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha) == (32, 64) and set(config.target_modules) == set(FLOW_GRPO_LORA["target_modules"])
    assert model.get_base_model().config.num_attention_heads == 24 and run.prompt_embeds.shape[1] == 333
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert run.accelerator.mixed_precision == "bf16"
    rollouts.flow_grpo_epoch(run, seed=0)
    fg.train_jaggc(run)
    assert jaggc.stepwise(run.transformer).counts.cached_forwards == 4      # 2 interior steps and 2 knots
    jaggc.stepwise(run.transformer).close()


def test_device_cuda_without_cuda_exits_with_one_line():
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = subprocess.run([sys.executable, "-m", "jaggc.cli", "trainers", "--names", "none", "--loops", "mix_grpo",
                          "--device", "cuda", "--dtype", "bf16"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("jaggc trainers: --device cuda: ")
    assert "CPU-only build" in lines[0] and "--device cpu" in lines[0]
