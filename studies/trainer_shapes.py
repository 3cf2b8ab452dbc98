"""GRPO losses in the shapes the trainers write them, on tiny real DiTs with stored rollouts.

``example_losses`` holds losses written *for* jaggc. These are written the way the trainers' own
code is (read from the repositories, not copied): the same step functions with the same Python
constructs, so that what the compiler must capture is what users run. One module per trainer in
``jaggc_studies/trainers/``; this module re-exports them (the loops, the studies and the tests
import ``jaggc_studies.trainer_shapes``).

- ``flow_grpo_sd3``: Flow-GRPO's ``train_sd3.py``. The step function looks each sample's step up
  with the scheduler's ``index_for_timestep`` (``.nonzero()``, ``len()``, ``.item()``) and reads
  ``sigmas[1].item()``; training uses CFG (one DiT call on ``[uncond; cond]``, the uncond half
  detached, guidance 4.5); the KL term (beta > 0) runs the reference under ``torch.no_grad()`` and
  peft's ``transformer.disable_adapter()`` on a ``PeftModel`` with a LoRA on the attention.
- ``dance_grpo_flux``: DanceGRPO's ``train_grpo_flux.py``. ``flux_step`` indexes a sigma-schedule
  *tensor* with a tensor step index and computes ``eta * math.sqrt(delta_t)`` and
  ``math.log(std_dev_t)``; ``grpo_one_step`` calls ``transformer.train()`` and opens a
  ``torch.autocast("cuda", torch.bfloat16)`` block around the DiT call; each sample trains its own
  random 60% of the steps (sorted: windows follow the sampler).
- ``mix_grpo_flux``: MixGRPO's ``train_grpo_flux.py`` (Tencent-Hunyuan/MixGRPO): the same
  ``grpo_one_step`` (``train()``, the CUDA bf16 block) with Flow-GRPO's SDE step on a 25-step
  shift-3 schedule tensor (``flow_grpo_step``: ``sigmas[1].item()``), a rollout that is SDE only on
  the trained window of 4 consecutive steps and ODE elsewhere, the PPO clip at 1e-4 with the loss
  divided by ``accumulation * window``, and a KL term on the log-prob differences; the window
  (``range(cur, min(cur + 4, 23))``) moves along the trajectory and shrinks to 3, 2, 1 steps at the
  end of a run.
- ``jagg_author_qwen``: the JAGG author's ``train_grpo_qwenimage_jagg.py`` (SchumiDing/eff_grpo):
  the same ``flux_step``, a Qwen-Image DiT called with ``timestep=timesteps / 1000``, a text mask and
  ``img_shapes``; ``author_two_backward`` is the author's JAGG algorithm as published (W no-grad
  forwards, upstream gradients on a detached copy, index weights j/(W-1), two separate forwards with
  grad and two backward calls: (W+6)F per window), the baseline jaggc is measured against.
- ``jaggc_helpers_sd3``: a loss built from ``jaggc.grpo``'s own helpers (``flow_grpo_sde_step``,
  ``ppo_clip_loss``), whose input checks read tensor values.

The trainers call ``backward`` per step; these return the summed loss, which ``@jagg_compile``
needs. Each factory builds the model, samples the stored trajectory without grad and moves the
parameters by a small step (one optimizer step after the rollout), so ratios are not exactly 1.

**GPU form.** The autocast blocks are written as the trainers write them, for CUDA
(``torch.autocast("cuda", torch.bfloat16)``; Flow-GRPO's ``accelerator.autocast()`` around
``compute_log_prob`` is that block on a GPU). On a CPU they switch themselves off; run a shape
under ``jaggc.testing.cuda_autocast_on_cpu()`` to make them live bf16 blocks, which is what the
trainers' code computes, and what a capture of it sees, on the GPU.
"""

from __future__ import annotations

# every name of the trainer modules, re-exported (and dataclasses.replace, which callers use on a GRPOConfig)
from dataclasses import replace

from .trainers.common import (
    GRPOConfig, OFF_POLICY_STEP, T_DEFAULT, TrainerShape, off_policy_step)
from .trainers.flow_grpo import (
    Pipeline, compute_log_prob, flow_grpo_loss, flow_grpo_sd3, sde_step_with_logprob)
from .trainers.dance_grpo import (
    clipped_loss, dance_grpo_flux, dance_grpo_loss, dance_one_step, flux_step, one_step, random_subset,
    sd3_time_shift)
from .trainers.jagg_author import (
    author_one_step, author_qwen_loss, author_two_backward, jagg_author_qwen)
from .trainers.mix_grpo import (
    MIX_LAST_TRAINED, MIX_SAMPLING_STEPS, MIX_WINDOW, flow_grpo_step, mix_grpo_flux, mix_grpo_loss,
    mix_grpo_per_step, mix_one_step, mix_step_loss, mix_train_timesteps)
from .trainers.jaggc_helpers import (
    helpers_loss, jaggc_helpers_sd3)
from .trainers import SHAPES

_off_policy_step = off_policy_step   # the loops' old name
