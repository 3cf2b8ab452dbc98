"""Issue 36 F and G: a loss whose eager run raises, and activation checkpointing written in the loss,
on every capture path and backward mode they reach (float64, a 3-dim affine-Jacobian field, T=3).

* F: a detached DiT output written in place into the next stored state, where the DiT saved a view
  of that storage (``latents[:, j + 1].add_(0.1 * v.detach())``): eager raises "a variable needed
  for gradient computation has been modified by an inplace operation" at backward. Every path
  raises the same error or a jaggc refusal naming the step; the intercept fallback (which returned a
  gradient) refuses naming the step and the write's line, before any gradient is written. A DiT that
  does not save its input (eager runs) is right on the intercept path: the refusal asks the DiT.
* G: ``torch.utils.checkpoint.checkpoint(call_dit, dit, z, t)`` around each DiT call (either
  ``use_reentrant``), and the same with a view of a stored state written in place before the call:
  refused on every path with a final jaggc error naming the checkpoint's line and the fix that works
  (module-level checkpointing), before any gradient is written. Module-level checkpointing inside
  the DiT is kept: the same gradient, and fewer saved activations than without it.
"""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from helpers import grads, rel_err, zero_grads
from jaggc import JaggCaptureError, JaggError, JaggGraphError, jagg_compile
from jaggc.runtime.memory import track_saved_tensors
from jaggc.verify.fields import AffineJacobianField

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

T, B, D = 3, 2, 3
CAPTURES = ("fx", "dynamo", "intercept", "auto")
MODES = [(c, b) for c in CAPTURES for b in ("joint", "per_window", "lowmem") if not (c == "intercept" and b == "lowmem")]
INPLACE_ERROR = "modified by an inplace operation"


def inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.9, 0.3, T, dtype=torch.float64)
    return dict(lat=torch.randn(B, T + 1, D, generator=g, dtype=torch.float64),
                ts=torch.stack([t, t * 0.95]).contiguous(),
                g=torch.randn(T, B, D, generator=g, dtype=torch.float64))


def copy(batch: dict) -> dict:
    return {k: v.clone() for k, v in batch.items()}


def line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(lines) if text in s)


def run(loss, capture, backward, window, dit, batch):
    compiled = jagg_compile(loss, window=window, capture=capture, backward=backward, weights="t")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="jaggc:")
        value = compiled(dit, batch)
        value.backward()
    return compiled, value


# ----------------------------------------------------------------------------- F


def write_into_saved_state(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        v = dit(batch["lat"][:, j], batch["ts"][:, j])
        batch["lat"][:, j + 1].add_(0.1 * v.detach())          # F: the write
        total = total + (v * batch["g"][j]).sum()
    return total


def test_F_eager_raises():
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        write_into_saved_state(AffineJacobianField(D, seed=1), inputs()).backward()


@pytest.mark.parametrize("capture,backward", MODES, ids=[f"{c}-{b}" for c, b in MODES])
@pytest.mark.parametrize("window", [2, 3])
def test_F_write_into_a_saved_state_raises_like_eager(capture, backward, window):
    dit = AffineJacobianField(D, seed=1)
    batch = inputs()
    zero_grads(dit)
    with pytest.raises((RuntimeError, JaggError)) as info:
        run(write_into_saved_state, capture, backward, window, dit, batch)
    e, text = info.value, str(info.value)
    if isinstance(e, JaggError) and backward == "lowmem" and capture == "auto":
        # no graph path takes the loss (both decline naming the steps) and lowmem needs a graph
        assert "backward='lowmem' needs a captured graph" in text, text
    elif isinstance(e, JaggError):
        assert re.search(r"step \d", text), text
        if isinstance(e, JaggCaptureError):
            # an explicitly chosen graph path that cannot take the window: a decline naming the steps
            assert capture in ("fx", "dynamo"), text
        else:
            assert all(p.grad is None for p in dit.parameters()), "a refused loss wrote gradients"
    else:
        # torch's own error, as eager raises it (a graph path runs the DiT with grad on the loss's views)
        assert INPLACE_ERROR in text and capture in ("fx", "dynamo", "auto"), text
    if capture == "intercept" or (capture == "auto" and window == 3 and backward != "lowmem"):
        assert isinstance(e, JaggGraphError), text
        line = line_of(write_into_saved_state, "# F: the write")
        assert f"step 0 ({__file__}:{line})" in text and "add_" in text and ".clone()" in text, text
        assert torch.equal(batch["lat"], inputs()["lat"]), "the refused loss's writes were not undone"


class InputNotSaved(nn.Module):
    """A DiT that saves nothing of its input (``2 * x``): eager runs the F loss, so must jaggc."""

    def __init__(self):
        super().__init__()
        self.u = nn.Parameter(torch.linspace(-1, 1, D, dtype=torch.float64))
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, D, dtype=torch.float64))

    def forward(self, x, timestep):
        t = timestep.to(x.dtype).reshape(-1, 1)
        return 2.0 * x + t * torch.sin(self.u) + t * torch.exp(0.1 * self.w)


@pytest.mark.parametrize("backward", ["joint", "per_window"])
@pytest.mark.parametrize("window", [2, 3])
def test_F_a_dit_that_saves_no_input_is_right_on_intercept(backward, window):
    dit = InputNotSaved()
    eager_batch, batch = inputs(), inputs()
    zero_grads(dit)
    value = write_into_saved_state(dit, eager_batch)
    value.backward()
    exact = grads(dit).clone()
    zero_grads(dit)
    _, got_value = run(write_into_saved_state, "intercept", backward, window, dit, batch)
    assert rel_err(got_value.detach(), value.detach()) < 1e-12
    # J = 2 I is free of θ and of z: JAGG is exact at every window
    assert rel_err(grads(dit), exact) < 1e-10
    assert torch.equal(batch["lat"], eager_batch["lat"])


# ----------------------------------------------------------------------------- G


def call_dit(dit, z, t):
    return dit(z, t)


def checkpointed(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        v = cp.checkpoint(call_dit, dit, batch["lat"][:, j], batch["ts"][:, j], use_reentrant=False)  # G: ckpt
        total = total + (v * batch["g"][j]).sum()
    return total


def checkpointed_reentrant(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        v = cp.checkpoint(call_dit, dit, batch["lat"][:, j], batch["ts"][:, j], use_reentrant=True)  # G: ckpt
        total = total + (v * batch["g"][j]).sum()
    return total


def checkpointed_after_a_view_write(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        z = batch["lat"][:, j]
        z.mul_(0.9)
        v = cp.checkpoint(call_dit, dit, z, batch["ts"][:, j], use_reentrant=False)  # G: ckpt
        total = total + (v * batch["g"][j]).sum()
    return total


def test_G_eager_runs_the_checkpointed_loss():
    dit = AffineJacobianField(D, seed=1)
    for loss in (checkpointed, checkpointed_reentrant):
        zero_grads(dit)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # reentrant: "None of the inputs have requires_grad"
            value = loss(dit, inputs())
        if loss is checkpointed:
            value.backward()
            assert grads(dit).abs().sum() > 0


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("loss", [checkpointed, checkpointed_reentrant, checkpointed_after_a_view_write],
                         ids=["non_reentrant", "reentrant", "view_write"])
@pytest.mark.parametrize("capture,backward", MODES, ids=[f"{c}-{b}" for c, b in MODES])
@pytest.mark.parametrize("window", [2, 3])
def test_G_checkpoint_in_the_loss_is_refused_naming_the_line(loss, capture, backward, window):
    dit = AffineJacobianField(D, seed=1)
    batch = inputs()
    zero_grads(dit)
    if capture == "fx" and loss is checkpointed_reentrant:
        # fx meets the reentrant CheckpointFunction.apply first: a decline naming the line (auto: Dynamo refuses)
        with pytest.raises(JaggCaptureError, match=r"CheckpointFunction\.apply"):
            run(loss, capture, backward, window, dit, batch)
        return
    with pytest.raises(JaggGraphError) as info:
        run(loss, capture, backward, window, dit, batch)
    text = str(info.value)
    assert f"{__file__}:{line_of(loss, '# G: ckpt')}: the DiT (AffineJacobianField) is called inside" in text, text
    assert "enable_gradient_checkpointing()" in text and "checkpoint" in text, text
    assert all(p.grad is None for p in dit.parameters()), "a refused loss wrote gradients"


class BlockCheckpointed(nn.Module):
    """Module-level checkpointing inside the DiT (what ``enable_gradient_checkpointing()`` does): a
    two-layer MLP field whose hidden block runs under a non-reentrant checkpoint."""

    def __init__(self, checkpointing: bool):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w1 = nn.Parameter(torch.randn(64, D + 1, generator=g, dtype=torch.float64) * 0.3)
        self.w2 = nn.Parameter(torch.randn(D, 64, generator=g, dtype=torch.float64) * 0.3)
        self.checkpointing = checkpointing

    def block(self, h):
        return torch.tanh(torch.tanh(h @ self.w1.T) * 1.5) @ self.w2.T

    def forward(self, x, timestep):
        h = torch.cat([x, timestep.to(x.dtype).reshape(-1, 1)], 1)
        return cp.checkpoint(self.block, h, use_reentrant=False) if self.checkpointing else self.block(h)


def plain_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        total = total + (dit(batch["lat"][:, j], batch["ts"][:, j]) * batch["g"][j]).sum()
    return total


@pytest.mark.parametrize("capture", ["fx", "intercept"])
def test_G_module_level_checkpointing_is_kept(capture):
    """The fix the refusal names works: the same gradient, and the saved activations shrink."""
    got, saved = {}, {}
    for checkpointing in (False, True):
        dit = BlockCheckpointed(checkpointing)
        zero_grads(dit)
        compiled = jagg_compile(plain_loss, window=2, capture=capture, weights="t")
        with track_saved_tensors() as tracker:
            value = compiled(dit, inputs())
            peak = tracker.peak_bytes
        value.backward()
        got[checkpointing], saved[checkpointing] = grads(dit).clone(), peak
    assert rel_err(got[True], got[False]) < 1e-12
    assert saved[True] < 0.5 * saved[False], saved
