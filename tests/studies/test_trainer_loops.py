"""The trainers' training loops, and the README's recipe for each: one compiled loss per trajectory
with ``backward="lowmem"`` (jaggc's speed at about a per-step loop's activation memory).

  * Flow-GRPO (``train_sd3.py``): per timestep ``accelerator.backward(loss)`` inside
    ``accelerator.accumulate``, the Accelerator built with gradient_accumulation_steps = K * T.
    Recipe: the same accumulate block around one compiled loss per sample batch, the Accelerator
    built with K. At W=2 the parameters after two optimizer steps equal the trainer's own loop's.
  * DanceGRPO (``train_grpo_flux.py``): per sample, ``loss.backward()`` per trained step (each step's
    loss divided by accumulation x trained steps), ``optimizer.step()`` after every
    ``gradient_accumulation_steps`` samples. Recipe: one compiled ``loss.backward()`` per sample.
    At W=2 equal to the trainer's loop; at W=3 each step's update equals the reference JAGG's.

The windows live inside one loss, so an optimizer step or ``zero_grad`` can only fall between
losses (where the trainer's loop also has them); DDP's one all-reduce per optimizer step under
``accumulate`` is checked in tests/runtime/test_accelerate.py (``acc_jagg_lowmem``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import rel_err
from jaggc import jagg_compile
from jaggc_studies import trainer_shapes
from jaggc.verify.reference import reference_jagg

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

K = 2          # micro-batches per optimizer step
LR = 0.5


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def _accelerator(steps: int):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)


def _micro_batches(sample: dict, count: int) -> list[dict]:
    n = sample["latents"].shape[0]
    per = n // count
    return [{k: (v[i * per:(i + 1) * per] if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == n else v)
             for k, v in sample.items()} for i in range(count)]


def _step_loss(transformer, pipeline, sample, j, config, embeds, pooled):
    """One timestep of Flow-GRPO's training loop (its loss, before accelerator.backward)."""
    _, log_prob, _, _ = trainer_shapes.compute_log_prob(transformer, pipeline, sample, j, embeds, pooled, config)
    advantages = torch.clamp(sample["advantages"][:, j], -config.adv_clip_max, config.adv_clip_max)
    ratio = torch.exp(log_prob - sample["log_probs"][:, j])
    return torch.mean(torch.maximum(-advantages * ratio,
                                    -advantages * torch.clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range)))


def flow_grpo_trainer_loop(transformer, pipeline, batches, config, optimizer):
    """Flow-GRPO's loop: accumulate over K micro-batches x T timesteps, backward per timestep."""
    num_t = batches[0]["timesteps"].shape[1]
    accelerator = _accelerator(K * num_t)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)   # steps only on sync steps
    for sample in batches:
        embeds = torch.cat([sample["negative_prompt_embeds"], sample["prompt_embeds"]])
        pooled = torch.cat([sample["negative_pooled_prompt_embeds"], sample["pooled_prompt_embeds"]])
        for j in range(num_t):
            with accelerator.accumulate(transformer):
                accelerator.backward(_step_loss(transformer, pipeline, sample, j, config, embeds, pooled))
                optimizer.step()
                optimizer.zero_grad()


def flow_grpo_recipe(compiled, transformer, pipeline, batches, config, optimizer):
    """The recipe: one compiled loss (the timestep loop inside, summed / T) per micro-batch."""
    accelerator = _accelerator(K)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    for sample in batches:
        with accelerator.accumulate(transformer):
            accelerator.backward(compiled(transformer, pipeline, sample, config))
            optimizer.step()
            optimizer.zero_grad()


def test_flow_grpo_loop_and_recipe():
    shape = trainer_shapes.flow_grpo_sd3(num_steps=6, batch=4, beta=0.0)
    transformer, pipeline, sample, config = shape.args
    # a clip range the ratios stay inside: at Flow-GRPO's 1e-4 they sit on the clipping boundary,
    # where batch roundoff (a 2-step window is one forward of 2B) flips the branch
    config = trainer_shapes.replace(config, clip_range=0.2)
    batches = _micro_batches(sample, 2 * K)          # two optimizer steps of K micro-batches
    start = copy.deepcopy(transformer.state_dict())
    results = {}
    for name in ("trainer", "recipe_w2"):
        transformer.load_state_dict(start)
        optimizer = torch.optim.SGD([p for p in transformer.parameters() if p.requires_grad], lr=LR)
        if name == "trainer":
            flow_grpo_trainer_loop(transformer, pipeline, batches, config, optimizer)
        else:
            compiled = jagg_compile(trainer_shapes.flow_grpo_loss, dit=transformer, window=2, backward="lowmem")
            flow_grpo_recipe(compiled, transformer, pipeline, batches, config, optimizer)
            assert compiled.report.path == "fx"
        results[name] = _params(transformer)
    transformer.load_state_dict(start)
    moved = float((results["trainer"] - _params(transformer)).norm())
    assert moved > 1e-6
    assert float((results["recipe_w2"] - results["trainer"]).norm()) < 1e-4 * moved


def dance_trainer_loop(transformer, samples, perms, sigmas, args, optimizer, accumulation: int):
    """DanceGRPO's loop: per sample, backward per trained step; step every ``accumulation`` samples."""
    for i, (sample, perm) in enumerate(zip(samples, perms)):
        for j in range(perm.shape[0]):
            step_sample = {**sample, **{k: sample[k][:, perm][:, j:j + 1] for k in
                                        ("latents", "next_latents", "timesteps", "log_probs")}}
            log_prob = trainer_shapes.dance_one_step(
                args, step_sample["latents"][:, 0], step_sample["next_latents"][:, 0],
                sample["encoder_hidden_states"], sample["pooled_prompt_embeds"], sample["text_ids"],
                sample["image_ids"], transformer, step_sample["timesteps"][:, 0], perm[j], sigmas)
            loss = trainer_shapes.clipped_loss(log_prob, step_sample["log_probs"][:, 0], sample["advantages"], args,
                                               accumulation * perm.shape[0])
            loss.backward()
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()


def dance_recipe(compiled, transformer, samples, perms, sigmas, args, optimizer, accumulation: int):
    """The recipe: one compiled loss per sample, one backward."""
    for i, (sample, perm) in enumerate(zip(samples, perms)):
        compiled(transformer, sample, perm, sigmas, args).backward()
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()


def test_dance_grpo_loop_and_recipe():
    shape = trainer_shapes.dance_grpo_flux(num_steps=10)
    transformer, sample, _, sigmas, args = shape.args
    args = trainer_shapes.replace(args, gradient_accumulation_steps=K)
    g = torch.Generator().manual_seed(3)
    perms = [trainer_shapes.random_subset(10, 0.6, g) for _ in range(2 * K)]
    # four samples: the stored one with other advantages (DanceGRPO trains sample by sample)
    samples = [{**sample, "advantages": torch.tensor([a])} for a in (0.8, -0.5, 1.2, -1.0)]
    start = copy.deepcopy(transformer.state_dict())
    results = {}
    for name in ("trainer", "recipe_w2"):
        transformer.load_state_dict(start)
        optimizer = torch.optim.SGD(transformer.parameters(), lr=LR)
        if name == "trainer":
            dance_trainer_loop(transformer, samples, perms, sigmas, args, optimizer, K)
        else:
            compiled = jagg_compile(trainer_shapes.dance_grpo_loss, dit=transformer, window=2, backward="lowmem")
            dance_recipe(compiled, transformer, samples, perms, sigmas, args, optimizer, K)
        results[name] = _params(transformer)
    transformer.load_state_dict(start)
    moved = float((results["trainer"] - _params(transformer)).norm())
    assert moved > 1e-6
    assert float((results["recipe_w2"] - results["trainer"]).norm()) < 1e-4 * moved

    # W=3: the accumulated gradient of K samples equals the reference JAGG's sum
    compiled = jagg_compile(trainer_shapes.dance_grpo_loss, dit=transformer, window=3, weights="t",
                            backward="lowmem")
    transformer.zero_grad(set_to_none=True)
    for sample_i, perm in zip(samples[:K], perms[:K]):
        compiled(transformer, sample_i, perm, sigmas, args).backward()
    got = torch.cat([p.grad.reshape(-1) for p in transformer.parameters()])
    want = sum(reference_jagg(trainer_shapes.dance_grpo_loss, (transformer, s, p, sigmas, args), transformer, 3)[1]
               for s, p in zip(samples[:K], perms[:K]))
    assert rel_err(got, want) < 1e-4
