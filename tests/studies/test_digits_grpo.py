"""The digits GRPO trainer, its rewards and ``jaggc demo``.

Everything runs on an untrained digits DiT with the JPEG reward and tiny rollouts, so the file
needs neither the pretrained base nor much CPU; the classifier reward is checked against the
shipped classifier when its weights are present.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch

from jaggc.cli import main as cli_main
from jaggc_studies.digits import build_dit
from jaggc_studies.digits.rewards import BOLD_INK, bold_reward, classifier_available, classifier_reward, get_reward, ink, jpeg_reward
from jaggc_studies.digits.trainer import STRATEGIES, GRPOTrainer, TrainerConfig, grpo_loss, select_steps, strategy_gradient, trainable_parameters
from jaggc.errors import JaggInputError
from jaggc.runtime import count_dit_passes

TINY = dict(num_steps=7, classes_per_iter=2, group_size=4, minibatches=1, reward="jpeg")


pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(strategy="exact", seed=0, dit=None, **kw) -> GRPOTrainer:
    cfg = TrainerConfig(strategy=strategy, seed=seed, **{**TINY, **kw})
    return GRPOTrainer(dit if dit is not None else build_dit(seed=0), cfg)


def _params(dit) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in dit.parameters()])


# ---------------------------------------------------------------------------------------------
# rollouts, advantages, step selection


def test_rollout_log_probs_are_reproduced_on_policy():
    trainer = _trainer()
    batch = trainer.collect(0)
    steps = tuple(range(TINY["num_steps"]))  # every sampled step, the sigma -> 0 one included
    with torch.no_grad():
        loss, new_log_probs = grpo_loss(trainer.dit, dict(batch, train_steps=steps))
    ratio = torch.exp(new_log_probs - batch["log_probs"])
    assert new_log_probs.shape == batch["log_probs"].shape
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    # on-policy, the PPO loss is -mean(advantage) per step, i.e. ~0 for centred advantages
    assert abs(float(loss) + float(batch["advantages"].mean())) < 1e-5
    # the stored transitions chain: each next state is the following step's state
    torch.testing.assert_close(batch["next_latents"][:, :-1], batch["latents"][:, 1:], atol=0, rtol=0)
    torch.testing.assert_close(batch["images"], batch["next_latents"][:, -1], atol=0, rtol=0)


def test_advantages_are_normalised_within_each_class_group():
    trainer = _trainer(group_size=4, classes_per_iter=3)
    batch = trainer.collect(0)
    labels, rewards, adv = batch["labels"], batch["rewards"].double(), batch["advantages"].double()
    assert len(set(labels.tolist())) == 3
    for c in labels.unique():
        group = labels == c
        assert abs(float(adv[group].mean())) < 1e-5
        expected = (rewards[group] - rewards[group].mean()) / (rewards.std(correction=0) + 1e-4)
        torch.testing.assert_close(adv[group], expected, atol=1e-5, rtol=1e-4)
    assert float(adv.abs().max()) > 0.1  # not all zero


def test_step_selection_per_strategy():
    trained = TINY["num_steps"] - 1
    exact = select_steps(TrainerConfig(strategy="exact", **TINY), 0)
    assert exact == tuple(range(trained))  # the last (sigma -> 0) step is not trained
    assert select_steps(TrainerConfig(strategy="jagg", **TINY), 5) == exact
    dance_cfg = TrainerConfig(strategy="dance", **TINY)
    subsets = {select_steps(dance_cfg, i) for i in range(6)}
    assert all(len(s) == int(0.6 * trained) and list(s) == sorted(set(s)) for s in subsets)
    assert len(subsets) > 1  # a new random subset each iteration
    assert select_steps(dance_cfg, 3) == select_steps(dance_cfg, 3)
    mix_cfg = TrainerConfig(strategy="mix", **TINY)
    windows = [select_steps(mix_cfg, i) for i in range(trained - 2)]
    assert windows[0] == (0, 1, 2, 3) and windows[1] == (1, 2, 3, 4)
    assert windows[trained - 3] == (0, 1, 2, 3)  # wraps around after the last full window


# ---------------------------------------------------------------------------------------------
# one loss for every strategy; jagg = exact values with ~T/W backward passes


def test_every_strategy_uses_the_same_loss_function():
    dit = build_dit(seed=0)
    for strategy in STRATEGIES:
        loss_fn = _trainer(strategy, dit=dit).loss_fn
        assert (loss_fn is grpo_loss) or (strategy == "jagg" and loss_fn.__wrapped__ is grpo_loss), strategy


def test_jagg_loss_equals_exact_loss_with_fewer_backward_passes():
    window = 3
    trainer = _trainer("jagg", window=window)
    batch = dict(trainer.collect(0), train_steps=select_steps(trainer.config, 0))
    trained = len(batch["train_steps"])
    losses, counts, grads = {}, {}, {}
    for name, loss_fn in (("exact", grpo_loss), ("jagg", trainer.loss_fn)):
        trainer.dit.zero_grad(set_to_none=True)
        with count_dit_passes(trainer.dit) as c:
            loss, log_probs = loss_fn(trainer.dit, batch)
            loss.backward()
        losses[name], counts[name] = loss.detach(), c
        grads[name] = torch.cat([p.grad.flatten() for p in trainer.params])
    torch.testing.assert_close(losses["jagg"], losses["exact"], atol=1e-7, rtol=1e-5)
    assert counts["exact"].backwards == trained
    assert counts["jagg"].backwards == math.ceil(trained / window)
    cos = torch.nn.functional.cosine_similarity(grads["jagg"].double(), grads["exact"].double(), 0)
    assert 0.0 < float(cos) < 1.0 - 1e-9  # an approximation of the same gradient, not a copy


def test_jagg_gradient_lands_on_the_module_it_is_called_with():
    # a compiled loss captured with one module must not be reused for another one
    small = dict(num_steps=4, window=3)  # one window of 3 steps: a cheap compile
    first, second = _trainer("jagg", **small), _trainer("jagg", **small)
    assert first.loss_fn is not second.loss_fn
    batch = dict(first.collect(0), train_steps=select_steps(first.config, 0))
    g_first = strategy_gradient(first.dit, batch, first.config)
    with torch.no_grad():
        for p in second.dit.parameters():
            p.mul_(1.01)
    g_second = strategy_gradient(second.dit, batch, second.config)
    assert float(g_second.norm()) > 0 and not torch.equal(g_first, g_second)
    assert all(p.grad is None for p in first.dit.parameters())


# ---------------------------------------------------------------------------------------------
# training


def test_rollout_cache_serves_the_first_minibatch_and_changes_no_gradient():
    """jagg with rollout_cache: the interior outputs of the first minibatch come from the recorded
    rollout (hits, fewer forwards), the gradient is the uncached one; after the first optimizer
    step the parameter guard drops the cache (no hits on the second minibatch)."""
    cfg = dict(window=4, minibatches=2, group_size=4)
    cached, plain = _trainer("jagg", rollout_cache=True, **cfg), _trainer("jagg", **cfg)
    batches = {}
    for name, trainer in (("cached", cached), ("plain", plain)):
        batch = dict(trainer.collect(0), train_steps=select_steps(trainer.config, 0))
        batches[name] = trainer.minibatches(batch, 0)[0]
    torch.testing.assert_close(batches["cached"]["latents"], batches["plain"]["latents"])
    grads, counts = {}, {}
    for name, trainer in (("cached", cached), ("plain", plain)):
        with count_dit_passes(trainer.dit) as counts[name]:
            grads[name] = strategy_gradient(trainer.dit, batches[name], trainer.config)
    from jaggc_studies.digits.trainer import rollout_cache_for

    stats = rollout_cache_for(cached.dit).stats
    assert stats.hits > 0 and stats.misses == 0
    assert counts["cached"].nograd_forwards < counts["plain"].nograd_forwards
    assert counts["cached"].backwards == counts["plain"].backwards
    assert (grads["cached"] - grads["plain"]).norm() <= 1e-5 * grads["plain"].norm()

    log = cached.step()        # collect (recorded) + two minibatches, the second after a real step
    assert 0 < log["cache_hits"] and rollout_cache_for(cached.dit).stats.invalidations >= 1
    assert math.isfinite(log["cpu_s"]) and log["cpu_s"] > 0


def test_training_iteration_changes_parameters_and_is_deterministic_per_seed():
    runs = {}
    for key, seed in (("a", 0), ("b", 0), ("c", 1)):
        trainer = _trainer("dance", seed=seed)
        frozen_before = {n: p.detach().clone() for n, p in trainer.dit.named_parameters() if not p.requires_grad}
        before = _params(trainer.dit)
        log = trainer.step()
        runs[key] = (_params(trainer.dit), log)
        assert not torch.equal(runs[key][0], before)
        for name, p in trainer.dit.named_parameters():
            if name in frozen_before:
                assert torch.equal(p, frozen_before[name]) and p.grad is None, name
    assert torch.equal(runs["a"][0], runs["b"][0])
    assert runs["a"][1]["reward_mean"] == runs["b"][1]["reward_mean"]
    assert not torch.equal(runs["a"][0], runs["c"][0])
    log = runs["a"][1]
    assert log["backward_passes"] == int(0.6 * (TINY["num_steps"] - 1))
    for key in ("reward_mean", "reward_std", "clipfrac", "approx_kl", "wall_s"):
        assert math.isfinite(log[key]), key


def test_attention_only_training_selects_the_attention_projections():
    dit = build_dit(seed=0)
    trained = {id(p) for p in trainable_parameters(dit, "attention")}
    names = [n for n, p in dit.named_parameters() if id(p) in trained]
    assert names and all(".attn." in n for n in names)
    assert any("to_q" in n for n in names) and any("add_k_proj" in n for n in names)
    assert not any(n.startswith(("pos_embed", "proj_out", "time_text_embed", "norm_out")) for n in names)
    assert all(p.requires_grad == (id(p) in trained) for p in dit.parameters())
    assert len(trainable_parameters(dit, "all")) == len(list(dit.parameters()))


def test_bad_options_are_refused_with_the_option_name():
    with pytest.raises(JaggInputError, match="strategy"):
        TrainerConfig(strategy="ppo").validate()
    with pytest.raises(JaggInputError, match="window"):
        TrainerConfig(strategy="jagg", num_steps=4, window=4).validate()
    with pytest.raises(JaggInputError, match="minibatches"):
        TrainerConfig(classes_per_iter=3, group_size=3, minibatches=2).validate()
    with pytest.raises(JaggInputError, match="reward"):
        get_reward("aesthetic")
    with pytest.raises(JaggInputError, match="trainable"):
        TrainerConfig(trainable="everything").validate()


# ---------------------------------------------------------------------------------------------
# rewards


def test_jpeg_reward_matches_a_direct_pil_computation():
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    images = torch.cat([torch.rand(3, 1, 8, 8, generator=g) * 2 - 1, -torch.ones(1, 1, 8, 8)])
    expected = []
    for img in images:
        grey = ((img[0].numpy() + 1) / 2 * 255).round().clip(0, 255).astype(np.uint8)
        pil = Image.fromarray(grey, mode="L").resize((64, 64), Image.NEAREST).convert("RGB")
        buffer = io.BytesIO()
        pil.save(buffer, format="JPEG", quality=95)
        expected.append(-(len(buffer.getvalue()) / 1000) / 500)
    got = jpeg_reward(images)
    # sizes are whole bytes: a one-byte difference would be a relative error of ~1e-3
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), atol=0, rtol=1e-6)
    assert float(got[-1]) > float(got[:3].max())  # a flat image compresses best


@pytest.mark.skipif(not classifier_available(), reason="shipped classifier weights are missing")
def test_classifier_reward_is_the_target_class_probability():
    from jaggc_studies.digits.classifier import load_classifier
    from jaggc_studies.digits.data import load_digits_split

    test = load_digits_split("test")
    images, labels = test.images[:64], test.labels[:64]
    reward = classifier_reward(images, labels)
    probs = torch.softmax(load_classifier("reward")(images), -1)
    torch.testing.assert_close(reward, probs[torch.arange(64), labels])
    assert float(reward.mean()) > 0.8  # real digits of the right class score high
    wrong = classifier_reward(images, (labels + 1) % 10)
    assert float(wrong.mean()) < 0.2


# ---------------------------------------------------------------------------------------------
# the demo


def test_demo_json_has_the_documented_keys(tmp_path, capsys):
    path = tmp_path / "demo.json"
    rc = cli_main(["demo", "--base", "random", "--reward", "jpeg", "--iterations", "1", "--num-steps", "5",
                   "--group-size", "4", "--eval-per-class", "1", "--no-progress", "--json", str(path),
                   "--out", str(tmp_path / "pics")])
    assert rc == 0
    result = json.loads(path.read_text())
    assert set(result["strategies"]) == set(STRATEGIES)
    for name, r in result["strategies"].items():
        for key in ("reward_start", "reward_end", "wall_s", "cpu_s", "backward_passes", "grad_cosine"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (name, key)
        assert len(r["rollout_reward"]) == len(r["cpu_curve"]) == 1
    assert "rollout cache on" in result["jagg_settings"]
    for picture in ("samples.png", "reward_curves.png"):
        data = (tmp_path / "pics" / picture).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, picture
        assert str(tmp_path / "pics" / picture) in result["pictures"]
    s = result["strategies"]
    assert s["exact"]["grad_cosine"] == pytest.approx(1.0, abs=1e-9)
    assert s["exact"]["backward_passes"] == 2 * 4  # 2 minibatches x 4 trained steps
    assert s["dance"]["backward_passes"] == 2 * 2  # int(0.6 * 4) steps
    assert s["jagg"]["backward_passes"] == 2 * 1   # one window of 4
    assert s["jagg"]["grad_cosine"] < 1.0
    assert "| jagg |" in capsys.readouterr().out


def test_demo_seeds_report_means_and_spread(tmp_path):
    path = tmp_path / "demo.json"
    rc = cli_main(["demo", "--base", "random", "--reward", "jpeg", "--iterations", "2", "--num-steps", "4",
                   "--group-size", "2", "--eval-per-class", "1", "--strategies", "exact", "jagg", "--window", "3",
                   "--seeds", "2", "--no-progress", "--no-pictures", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert result["seeds"] == [0, 1] and "pictures" not in result
    for r in result["strategies"].values():
        for key in ("reward_end", "cpu_s", "wall_s"):
            values = r["per_seed"][key]
            assert len(values) == 2 and r[key] == pytest.approx(sum(values) / 2)
            assert r["spread"][key] == [min(values), max(values)]
    assert result["strategies"]["exact"]["cpu_vs_exact"] == pytest.approx(1.0)


def test_bold_reward_asks_for_more_ink_than_the_data_has():
    from jaggc_studies.digits.data import load_digits_split

    data = load_digits_split("train").images
    assert float(ink(data).quantile(0.99)) < BOLD_INK    # the data set never shows the target
    if not classifier_available():
        pytest.skip("digits classifier weights not present")
    labels = torch.zeros(data.shape[0], dtype=torch.int64)
    thin = data[:64]
    bold = (thin + 0.6).clamp(-1, 1)        # the same drawings, more ink everywhere
    r_thin, r_bold = bold_reward(thin, labels[:64]), bold_reward(bold, labels[:64])
    assert bool(((r_thin >= 0) & (r_thin <= 1)).all()) and float(r_thin.mean()) < 0.05
    assert torch.equal(r_thin, classifier_reward(thin, labels[:64]) * torch.sigmoid((ink(thin) - BOLD_INK) / 0.03))
    assert float(r_bold.mean()) > float(r_thin.mean())
    assert float(bold_reward(torch.ones(4, 1, 8, 8), labels[:4]).max()) < 0.5   # a blob is not a digit


def test_demo_refuses_a_strategy_list_without_exact():
    with pytest.raises(JaggInputError, match="exact"):
        cli_main(["demo", "--strategies", "jagg", "--base", "random"])


def test_lora_trains_only_the_adapter_and_starts_as_the_base():
    """trainable="lora": a peft LoRA on the attention projections, zero B at init (the model's
    output is the base's), only the lora_A/lora_B parameters require grad."""
    from jaggc_studies.digits.model import build_dit, class_conditioning
    from jaggc_studies.digits.trainer import trainable_parameters

    torch.manual_seed(0)
    dit = build_dit(seed=0)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([500.0, 300.0])
    cond = class_conditioning(torch.tensor([1, 7]))
    with torch.no_grad():
        before = dit(hidden_states=x, timestep=t, return_dict=False, **cond)[0]
    params = trainable_parameters(dit, "lora")
    names = {n for n, p in dit.named_parameters() if p.requires_grad}
    assert names and all("lora_A" in n or "lora_B" in n for n in names)
    assert len(params) == len(names) and any(".attn.to_q." in n for n in names)
    with torch.no_grad():
        after = dit(hidden_states=x, timestep=t, return_dict=False, **cond)[0]
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert len(trainable_parameters(dit, "lora")) == len(params)   # not injected twice
