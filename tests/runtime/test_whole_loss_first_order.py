"""Off-policy serving on the whole-loss path: ``jagg_compile`` with ``RolloutCache(first_order=True)``.

The digits base (shipped weights), attention trained, Flow-GRPO's ``grpo_loss`` over 8 trained steps of a
9-step SDE rollout (``jaggc_studies.digits.trainer``), ``window=4`` with the default σ-aware placement
(the window reaching σ < 0.5 runs exactly). The rollout is recorded; the first minibatch runs on-policy
(the plain cache's hits), one AdamW step, then the same samples again: the JAGG window's two interior
steps are served (recorded + the knots' change: runtime/first_order.py), no forward of them runs.

* the served steps run no forward (2 steps x 16 rows fewer through the no-grad forwards), the knots'
  forwards unchanged;
* the gradient with served outputs against the one with forwards (``RolloutCache()``: the plain cache,
  which forwards off-policy): close (cosine > 0.9999) and not equal; the logged log-probs of the
  other steps the forwards', the served steps' first-order values;
* nothing served without ``first_order`` (the promise of the plain cache).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jaggc
from helpers import rel_err
from jaggc_studies.digits import trainer as tr
from jaggc_studies.digits.model import load_base
from jaggc.runtime import count_dit_passes

pytestmark = [pytest.mark.usefixtures("one_thread")]

T = 9


def _problem():
    torch.manual_seed(0)
    dit = load_base()
    tr.trainable_parameters(dit, "attention")
    config = tr.TrainerConfig(num_steps=T, group_size=8, classes_per_iter=2, clip_range=1e-2)
    return dit, config


def _off_policy_gradient(first_order: bool):
    dit, config = _problem()
    params = [p for p in dit.parameters() if p.requires_grad]
    cache = jaggc.RolloutCache(dit, first_order=first_order)
    loss_fn = jaggc.jagg_compile(tr.grpo_loss, window=4, options=jaggc.Options(rollout_cache=cache))
    g = torch.Generator().manual_seed(5)
    with cache.record(), torch.no_grad():
        batch = tr.rollout(dit, torch.tensor([3] * 8 + [7] * 8), config, g)
    adv = torch.randn(16, generator=g)
    batch["advantages"] = (adv - adv.mean()) / adv.std()
    batch["train_steps"] = tuple(range(T - 1))
    opt = torch.optim.AdamW(params, lr=3e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _ = loss_fn(dit, batch)                  # on-policy
        loss.backward()
        opt.step()
        opt.zero_grad()
        with count_dit_passes(dit) as passes:
            loss, log_probs = loss_fn(dit, batch)      # one optimizer step later
            loss.backward()
    grad = torch.cat([p.grad.flatten() for p in params])
    return grad, log_probs, cache.stats, passes


def test_the_whole_loss_path_serves_the_interior_steps_after_an_optimizer_step():
    served, lp_served, stats, passes = _off_policy_gradient(first_order=True)
    forwarded, lp_forwarded, plain_stats, plain_passes = _off_policy_gradient(first_order=False)
    assert stats.first_order_served == 2 and plain_stats.first_order_served == 0
    # the two served steps ran no forward: 2 steps x 16 samples fewer rows through no-grad forwards
    rows, plain_rows = sum(passes.nograd_forward_batches), sum(plain_passes.nograd_forward_batches)
    assert rows == plain_rows - 2 * 16, (passes, plain_passes)
    assert passes.grad_forward_batches == plain_passes.grad_forward_batches
    cos = float(served.double() @ forwarded.double() / (served.double().norm() * forwarded.double().norm()))
    assert cos > 0.9999 and rel_err(served, forwarded) > 0
    # the logged log-probs of the served steps are first-order values, the others the forwards'
    assert torch.allclose(lp_served[:, 3:], lp_forwarded[:, 3:], rtol=1e-5, atol=1e-5)
    assert not torch.equal(lp_served[:, 1:3], lp_forwarded[:, 1:3])
