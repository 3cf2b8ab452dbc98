"""The digits example's shipped pieces: data split, pretrained base DiT, classifiers, sampler.

Fast (well under a minute on one core): the base-vs-random comparison uses 40 ODE samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaggc_studies.digits.classifier import CLASSIFIER_REGEN_COMMAND, accuracy, classifier_path, load_classifier
from jaggc_studies.digits.data import NUM_CLASSES, load_digits_split
from jaggc_studies.digits.model import BASE_REGEN_COMMAND, DIGITS_CONFIG, WEIGHTS_DIR, MissingWeightsError, build_dit, class_conditioning, load_base, save_fp16_state
from jaggc_studies.digits.quality import sample_quality, save_grid
from jaggc_studies.digits.sampling import sample_ode
from jaggc_studies.digits.train_base import main as train_base_main, train_base

# Measured test-split accuracies of the shipped classifiers: reward 0.9844, eval 0.9933
# (`python -m jaggc_studies.digits.classifier`); thresholds leave ~2 points of margin.
REWARD_MIN_TEST_ACC = 0.96
EVAL_MIN_TEST_ACC = 0.97


pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_is_deterministic_stratified_and_a_partition():
    from sklearn.datasets import load_digits

    train, test = load_digits_split("train"), load_digits_split("test")
    again = load_digits_split("train")
    assert torch.equal(train.images, again.images) and torch.equal(train.labels, again.labels)
    # Partition by index: train + test is exactly the full data set as a multiset of (image, label)
    # rows (sklearn digits contains duplicate images, so compare multisets, not sets).
    full = load_digits()
    full_rows = torch.cat([torch.as_tensor(full.images, dtype=torch.float32).reshape(-1, 64) / 8 - 1,
                           torch.as_tensor(full.target, dtype=torch.float32)[:, None]], 1)
    split_rows = torch.cat([torch.cat([s.images.reshape(-1, 64), s.labels[:, None].float()], 1)
                            for s in (train, test)])
    assert len(split_rows) == len(full_rows) == 1797

    def canonical(rows):  # rows sorted lexicographically
        return rows[torch.from_numpy(np.lexsort(rows.numpy().T[::-1]))]

    assert torch.equal(canonical(split_rows), canonical(full_rows))
    counts_test = torch.bincount(test.labels, minlength=NUM_CLASSES).float()
    counts_full = torch.bincount(torch.as_tensor(full.target), minlength=NUM_CLASSES).float()
    assert (counts_test - 0.25 * counts_full).abs().max() <= 1  # stratified 25%
    assert train.images.min() >= -1 and train.images.max() <= 1 and train.images.shape[1:] == (1, 8, 8)


def test_load_base_is_eval_float32_dit_with_documented_call():
    dit = load_base()
    assert not dit.training
    assert all(p.dtype == torch.float32 for p in dit.parameters())
    n_params = sum(p.numel() for p in dit.parameters())
    assert 0.5e6 <= n_params <= 1.5e6
    labels = torch.tensor([0, 3, 9])
    z = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        v = dit(hidden_states=z, timestep=torch.full((3,), 500.0), **class_conditioning(labels), return_dict=False)[0]
    assert v.shape == (3, 1, 8, 8) and v.dtype == torch.float32 and torch.isfinite(v).all()


@pytest.mark.parametrize("kind, min_acc", [("reward", REWARD_MIN_TEST_ACC), ("eval", EVAL_MIN_TEST_ACC)])
def test_classifiers_load_and_are_accurate(kind, min_acc):
    clf = load_classifier(kind)
    assert not clf.training and all(p.dtype == torch.float32 for p in clf.parameters())
    assert clf(torch.zeros(5, 1, 8, 8)).shape == (5, NUM_CLASSES)
    assert accuracy(clf, "test") >= min_acc


def test_reward_and_eval_classifiers_are_different_models():
    reward, evalc = load_classifier("reward"), load_classifier("eval")
    assert type(reward) is not type(evalc)
    with pytest.raises(ValueError, match="kind"):
        load_classifier("other")


def test_sample_ode_is_deterministic_in_the_generator():
    dit = load_base()
    labels = torch.tensor([1, 7])
    a = sample_ode(dit, labels, num_steps=4, generator=torch.Generator().manual_seed(5))
    b = sample_ode(dit, labels, num_steps=4, generator=torch.Generator().manual_seed(5))
    c = sample_ode(dit, labels, num_steps=4, generator=torch.Generator().manual_seed(6))
    assert a.shape == (2, 1, 8, 8) and torch.equal(a, b) and not torch.equal(a, c)


def test_pretrained_base_samples_are_recognised_and_random_init_ones_are_not():
    eval_clf, reward_clf = load_classifier("eval"), load_classifier("reward")
    kwargs = dict(per_class=4, num_steps=16, seed=11, eval_clf=eval_clf, reward_clf=reward_clf)
    base = sample_quality(load_base(), **kwargs)
    random_init = sample_quality(build_dit(seed=0).eval(), **kwargs)
    # Full measurement (50/class): 0.954 mean. Few samples here, so a loose floor plus a wide gap.
    assert base["mean_eval_accuracy"] >= 0.75, base["per_class_eval_accuracy"]
    assert base["mean_eval_accuracy"] - random_init["mean_eval_accuracy"] >= 0.5
    assert base["mean_reward_p_target"] - random_init["mean_reward_p_target"] >= 0.5


def test_missing_weights_name_the_regeneration_command(tmp_path):
    with pytest.raises(MissingWeightsError, match=BASE_REGEN_COMMAND.replace(".", r"\.")):
        load_base(tmp_path / "absent.pt")
    with pytest.raises(FileNotFoundError, match=CLASSIFIER_REGEN_COMMAND.replace(".", r"\.")):
        load_classifier("eval", tmp_path / "absent.pt")


def test_base_checkpoint_from_another_config_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    save_fp16_state(torch.nn.Linear(2, 2), path, config=dict(DIGITS_CONFIG, num_layers=2))
    with pytest.raises(ValueError, match="regenerate"):
        load_base(path)


def test_train_base_is_deterministic_and_its_output_loads(tmp_path):
    a = train_base(steps=3, batch_size=8, log_every=0)
    b = train_base(steps=3, batch_size=8, log_every=0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), build_dit(seed=0).parameters()))
    out = tmp_path / "base.pt"
    train_base_main(["--out", str(out), "--steps", "2", "--batch-size", "8"])
    assert not load_base(out).training


def test_shipped_weights_fit_the_size_budget():
    files = [WEIGHTS_DIR / "base_dit.pt", classifier_path("reward"), classifier_path("eval")]
    assert all(f.is_file() for f in files)
    assert sum(f.stat().st_size for f in files) <= 5 * 1024 * 1024


def test_sample_grid_has_one_row_per_class(tmp_path):
    from PIL import Image

    save_grid(torch.rand(NUM_CLASSES * 3, 1, 8, 8) * 2 - 1, 3, tmp_path / "grid.png")
    assert Image.open(tmp_path / "grid.png").size == (3 * 40, NUM_CLASSES * 40)


@pytest.mark.parametrize("base", ["digits", "shapes"])
def test_classifier_command_ships_weights_that_load(tmp_path, base, capsys):
    """``python -m jaggc_studies.<base>.classifier``: one epoch of the reward classifier, shipped as fp16,
    loads back and reports the accuracy of what ships."""
    import importlib

    module = importlib.import_module(f"jaggc_studies.{base}.classifier")
    module.main(["--kinds", "reward", "--epochs", "1", "--out-dir", str(tmp_path)])
    path = tmp_path / "classifier_reward.pt"
    model = module.load_classifier("reward", path)
    assert not model.training
    # the reported accuracy is that of the weights as shipped
    assert f"{module.accuracy(model, 'test'):.4f} (shipped fp16) -> {path}" in capsys.readouterr().out
