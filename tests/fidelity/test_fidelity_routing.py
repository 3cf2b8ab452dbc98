"""jaggc_studies.fidelity.routing_study: the rank statistics and the per-window fidelity on synthetic cases
whose answer is known.

- a field whose output and parameter Jacobian are affine in the state, with every window's states on
  the chord in t: JAGG is exact on every window (cosine 1) and every routing score is 1;
- the same field with a bend of growing size in each window: both the score and the window cosine
  fall with the bend, so their within-batch Spearman correlation is exactly +1.
"""

import math

import pytest
import torch
from torch import nn

from jaggc.fidelity import estimators as E
from jaggc_studies.fidelity.routing_study import correlations, ranks, spearman, window_fidelity

# one intra-op thread for this module only (conftest.one_thread restores the count after it)
pytestmark = pytest.mark.usefixtures("one_thread")

B, D, W = 3, 4, 4
S = 12   # three windows of 4 steps


class AffineField(nn.Module):
    """v = M z + t b + c: output and parameter Jacobian affine in (z, t), no θ-free term."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.M = nn.Parameter(torch.randn(D, D, generator=g, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))
        self.c = nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))

    def forward(self, x, timestep):
        return x @ self.M.T + timestep.to(x.dtype)[:, None] * self.b + self.c


def loss(dit, batch):
    """A GRPO-like loss of gradient-independent DiT calls, nonlinear in each output."""
    total = 0.0
    for k in range(batch["states"].shape[1]):
        v = dit(batch["states"][:, k], batch["t"][:, k])
        total = total + (batch["adv"][:, None] * torch.tanh(v - batch["target"][:, k])).sum()
    return total / batch["states"].shape[1]


def make_batch(bends=(0.0, 0.0, 0.0), seed=0):
    """States on a per-window chord in t, plus bend_w · 4α(1−α) · e_w inside window w."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.05, S, dtype=torch.float64) ** 1.3
    states = torch.empty(B, S, D, dtype=torch.float64)
    # one chord direction d and bend direction e for every window, so windows differ only by the bend
    d = torch.randn(B, D, generator=g, dtype=torch.float64)
    e = torch.randn(B, D, generator=g, dtype=torch.float64)
    for w in range(S // W):
        idx = list(range(w * W, (w + 1) * W))
        ta, tb = t[idx[0]], t[idx[-1]]
        za = torch.randn(B, D, generator=g, dtype=torch.float64)
        for k in idx:
            a = (t[k] - ta) / (tb - ta)
            states[:, k] = za + a * d + bends[w] * 4 * a * (1 - a) * e
    return dict(states=states, t=t.expand(B, S).contiguous(),
                target=torch.randn(B, S, D, generator=g, dtype=torch.float64),
                adv=torch.randn(B, generator=g, dtype=torch.float64))


def test_ranks_and_spearman_known_values():
    assert ranks([3.0, 1.0, 2.0]).tolist() == [3.0, 1.0, 2.0]
    assert ranks([1.0, 2.0, 2.0, 5.0]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [1, 2, 3, 5, 4]) == pytest.approx(0.9)   # 1 − 6·2/(5·24)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))                        # constant: undefined
    assert math.isnan(spearman([1.0], [2.0]))


def test_affine_field_on_chords_every_window_exact():
    dit = AffineField()
    rec = E.record(loss, dit, make_batch())
    rows = window_fidelity(rec, dit, window=W, weights="t")
    assert [r["window"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["cos"] == pytest.approx(1.0, abs=1e-12)
        assert r["rel"] < 1e-10
        assert r["score"] == pytest.approx(1.0, abs=1e-12)
        assert r["norm"] > 0
    # index weights are not exact on this non-uniform grid: the test is not vacuous
    rows_idx = window_fidelity(rec, dit, window=W, weights="index")
    assert min(r["cos"] for r in rows_idx) < 1 - 1e-6


def test_bend_lowers_score_and_fidelity_together():
    dit = AffineField(seed=1)
    batches = []
    for seed in range(4):
        rec = E.record(loss, dit, make_batch(bends=(0.02, 0.15, 0.5), seed=seed))
        rows = window_fidelity(rec, dit, window=W)
        # larger bend -> lower score and lower window cosine
        assert rows[0]["score"] > rows[1]["score"] > rows[2]["score"]
        assert rows[0]["cos"] > rows[1]["cos"] > rows[2]["cos"]
        batches.append(rows)
    stats = correlations(batches)
    assert stats["within"] == pytest.approx(1.0) and stats["within_n"] == 4
    assert stats["top1"] == 1.0 and stats["top1_chance"] == pytest.approx(1 / 3)
    assert stats["pooled"] > 0.8
    # reversing the bends reverses which window is worst: the statistics follow the data
    rec = E.record(loss, dit, make_batch(bends=(0.5, 0.15, 0.02), seed=9))
    rows = window_fidelity(rec, dit, window=W)
    assert correlations([rows])["within"] == pytest.approx(1.0)
    assert min(rows, key=lambda r: r["cos"])["window"] == 0


def test_windows_of_two_steps_are_left_out():
    dit = AffineField()
    batch = make_batch()
    batch = dict(batch, states=batch["states"][:, :10], t=batch["t"][:, :10], target=batch["target"][:, :10])
    rec = E.record(loss, dit, batch)
    rows = window_fidelity(rec, dit, window=W)   # windows 0-3, 4-7, 8-9: the last is always exact
    assert [r["window"] for r in rows] == [0, 1]
