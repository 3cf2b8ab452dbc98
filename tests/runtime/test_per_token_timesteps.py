"""Per-token timesteps (Wan 2.2 TI2V: the conditioning frame's tokens at t = 0, the generated
frames' at the sample's t), shape (B, L).

JAGG weights each sample by one time: the value of its non-conditioning tokens. On a field whose
parameter-Jacobian is affine in the per-token time (spec E2 per token), t-weighted JAGG is then
exact for any states, in float64, through ``@jagg_compile`` and the runtime; a timestep whose
non-zero tokens disagree within a sample is refused, naming the step and the sample.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import loss_and_grad, reference_jagg, rel_err
from jaggc import JaggInputError, jagg_calls, jagg_compile
from jaggc.runtime import DitCall, WindowOptions

T, B, L, D = 8, 2, 6, 3
COND_TOKENS = 2          # the first frame's tokens: the conditioning image, timestep 0


class TokenTimeField(nn.Module):
    """v = t_tok * sinh(u) + tanh(W) 1 + phi(x, t): the Jacobian is affine in each token's time."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.u = nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(D, D, generator=g, dtype=torch.float64))

    def forward(self, hidden_states, timestep):
        t = timestep.to(hidden_states.dtype)[..., None]                  # (B, L, 1)
        return t * torch.sinh(self.u) + torch.tanh(self.w).sum(0) + torch.tanh(hidden_states) * (1 + t)


def token_times(sample_times: torch.Tensor) -> torch.Tensor:
    t = sample_times[:, None].expand(-1, L).clone()
    t[:, :COND_TOKENS] = 0.0
    return t


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([1.0, 0.93, 0.8, 0.71, 0.55, 0.4, 0.22, 0.1], dtype=torch.float64)
    ts = torch.stack([token_times(torch.stack([b, b * 0.9])) for b in base])      # (T, B, L)
    zs = torch.randn(T, B, L, D, generator=g, dtype=torch.float64)                # off any chord
    gs = torch.randn(T, B, L, D, generator=g, dtype=torch.float64)
    return zs, ts, gs


def loss(dit, zs, ts, g):
    return sum((dit(hidden_states=zs[k], timestep=ts[k]) * g[k]).sum() for k in range(zs.shape[0]))


def test_compiled_jagg_is_exact_with_per_token_timesteps():
    model = TokenTimeField(1)
    args = (model, *inputs())
    exact_loss, exact = loss_and_grad(loss, args, model)
    compiled = jagg_compile(loss, window=4, weights="t")
    got_loss, got = loss_and_grad(compiled, args, model)
    assert compiled.report.path == "fx" and [w.mode for w in compiled.report.windows] == ["jagg", "jagg"]
    torch.testing.assert_close(got_loss, exact_loss, rtol=1e-14, atol=1e-14)
    assert rel_err(got, exact) < 1e-12
    # and it is the reference JAGG with each sample's time taken from its generated tokens
    _, ref = reference_jagg(loss, args, model, 4, time_of=lambda t: t.amax(1))
    assert rel_err(got, ref) < 1e-12


def test_runtime_windows_batch_per_token_timesteps_as_they_are():
    model = TokenTimeField(2)
    zs, ts, gs = inputs(1)
    calls = [DitCall(kwargs=dict(hidden_states=zs[k], timestep=ts[k])) for k in range(T)]
    outs = jagg_calls(model, calls, window=4, options=WindowOptions(interior_chunk=None))
    with torch.no_grad():
        for k, o in enumerate(outs):        # the values are each step's own (the knots' batch is 2B)
            torch.testing.assert_close(o, model(**calls[k].kwargs), rtol=1e-14, atol=1e-14)


def test_disagreeing_token_times_are_refused_naming_step_and_sample():
    model = TokenTimeField(3)
    zs, ts, gs = inputs(2)
    ts = ts.clone()
    ts[5, 1, -1] = 0.3              # sample 1 of step 5: two non-zero token times
    with pytest.raises(JaggInputError, match=r"step 5, input 'timestep': the per-token timestep of sample 1 "
                                             r"takes the values \[0.0, 0.3.*one value per sample"):
        jagg_compile(loss, window=4)(model, zs, ts, gs)
    with pytest.raises(JaggInputError, match=r"step 5, input 'timestep': .* sample 1"):
        jagg_calls(model, [DitCall(kwargs=dict(hidden_states=zs[k], timestep=ts[k])) for k in range(T)], window=4)
