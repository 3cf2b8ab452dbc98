"""The fuzzer's DiTs and inputs (tests/loss_fuzz.py): the two float64 fields answer a Python-number
timestep and depend on ``self.training`` (eval mode scales the output by 0.8, which keeps the
affine field's Jacobian structure, so the exactness theorem still applies), the real SD3 is one
model reloaded per case; ``make_inputs`` builds a program's batch for one round of calls (the
``flip`` and ``flags`` values its data-dependent branches read change between rounds)."""

from __future__ import annotations

import torch
from torch import nn

from fuzz_grammar import Program, windows_of
from jaggc.verify.fields import AffineJacobianField, CurvedField

EVAL_SCALE = 0.8


def _per_sample(t, x: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device).reshape(-1)
    return t.expand(x.shape[0]) if t.numel() == 1 else t


class FuzzAffine(AffineJacobianField):
    """An affine-Jacobian field that also takes a Python-number timestep; eval mode scales it."""

    def forward(self, x, timestep):
        out = super().forward(x, _per_sample(timestep, x))
        return out if self.training else EVAL_SCALE * out


class FuzzCurved(CurvedField):
    def forward(self, x, timestep):
        out = super().forward(x, _per_sample(timestep, x))
        return out if self.training else EVAL_SCALE * out


_SD3 = {}


def make_dit(p: Program) -> nn.Module:
    if p.dit == "affine":
        return FuzzAffine(3, seed=p.seed % 7)
    if p.dit == "curved":
        return FuzzCurved(3, seed=p.seed % 7)
    from jaggc import models

    if "state" not in _SD3:
        _SD3["model"] = models.sd3("tiny", seed=0)
        _SD3["state"] = {k: v.clone() for k, v in _SD3["model"].state_dict().items()}
    model = _SD3["model"]
    model.load_state_dict(_SD3["state"])
    model.train()
    return model


def make_inputs(p: Program, dit: nn.Module, round_: int = 0):
    """The batch of one round of calls (``round_``: which, for the branch flags)."""
    gen = torch.Generator().manual_seed(1000 + p.seed)
    B = 2
    sd3 = p.dit == "sd3"
    dtype = torch.float32 if sd3 else torch.float64
    shape = (B, 4, 8, 8) if sd3 else (B, 3)
    gaps = torch.rand(p.steps, generator=gen, dtype=torch.float64) + 0.3
    sched = 1.0 - torch.cumsum(gaps, 0) / (gaps.sum() * 1.15) + gaps[0] / (gaps.sum() * 1.15)
    times = torch.stack([sched * (1 - 0.04 * b) for b in range(B)], 1) if p.time == "tensor" else \
        sched[:, None].expand(p.steps, B)
    states = torch.randn(p.steps + 1, *shape, generator=gen, dtype=torch.float64)
    if p.chord:
        for w in windows_of(p):
            a, b = w[0], w[-1]
            for k in w[1:-1]:
                alpha = ((times[k] - times[a]) / (times[b] - times[a])).reshape(B, *([1] * (len(shape) - 1)))
                states[k] = (1 - alpha) * states[a] + alpha * states[b]
    if p.mutation == "nan":
        states[p.seed % p.steps].view(-1)[0] = float("nan")
    scale = 1000.0 if sd3 else 1.0
    times_out = (times * scale).to(dtype)
    sigmas = torch.cat([sched, sched[-1:] * 0.5]).to(dtype)
    batch = {"sigmas": sigmas, "tsched": (sched * scale).to(dtype),
             "g": torch.randn(p.steps, *shape, generator=gen, dtype=torch.float64).to(dtype),
             "adv": torch.randn(p.steps, B, generator=gen, dtype=torch.float64).to(dtype),
             "old": (torch.rand(p.steps, B, generator=gen, dtype=torch.float64) * 0.6 - 0.3).to(dtype),
             "out": torch.zeros(p.steps, *shape, dtype=dtype),
             "flip": torch.tensor(1.0 if round_ % 2 == 0 else -1.0, dtype=dtype),
             "flags": torch.tensor([(-1.0) ** (k + round_) for k in range(p.steps)], dtype=dtype)}
    if sd3:
        batch["ehs"] = torch.randn(B, 5, 16, generator=gen)
        batch["pool"] = torch.randn(B, 8, generator=gen)
    states = states.to(dtype)
    if p.container == "dict_bt":
        batch.update(latents=states.transpose(0, 1).contiguous(), timesteps=times_out.transpose(0, 1).contiguous())
    elif p.container == "dict_tb":
        batch.update(latents=states, timesteps=times_out)
    elif p.container == "list":
        batch.update(latents=[s.clone() for s in states], timesteps=[t.clone() for t in times_out])
    else:
        return (states, times_out, batch)
    return (batch,)


def copy_inputs(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: copy_inputs(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(copy_inputs(v) for v in x)
    return x


def leaves(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in leaves(v)]
    return []


