"""Multi-step GRPO losses as the trainers write them, stored rollouts for them, and how to run them
(eagerly, through ``@jagg_compile`` on either capture path, through the runtime): what
:mod:`jaggc.verify.loss_properties` checks properties of.

The losses are user code as Flow-GRPO / DanceGRPO write it: a Python loop over the trained steps of
a stored rollout, one DiT call per step, the step's policy log-probability written out inline, and
the PPO clipped-ratio loss; one loss per step policy of :mod:`jaggc.grpo`. The "DiT" is a float64
velocity field of :mod:`jaggc.verify.fields` called as ``field(latents, timestep=sigmas)``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import grpo
from .._compat import dynamo_recompile_limits
from ..runtime import DitCall, count_dit_passes, jagg_calls
from .harness import DT, _gen, rel_err, shift_sigmas

NOISE_LEVEL = 0.7            # Flow-GRPO's SDE noise level a (also CPS's)
ETA = 0.3                    # DanceGRPO's eta
CLIP_RANGES = (1e-4, 0.1, 0.2)  # Flow-GRPO SD3 / DanceGRPO, the JAGG author's runs, a wide one
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))
CAPTURES = ("fx", "dynamo")
ADV_CLIP_MAX = 5.0           # the trainers' advantage clamp


# ----------------------------------------------------------------------------- the losses (user code)
# Written as the trainers write them, with the two changes FX needs: the step count is a Python
# int argument and reductions name their dims (states are (B, D)). Dynamo captures them as well.
# They are the oracle the jaggc.grpo helpers are checked against, so they use none of them.

def ppo_clip(log_prob, old_log_prob, advantages, clip_range):
    """Flow-GRPO's (and DanceGRPO's) clipped-ratio loss, mean over the batch."""
    advantages = torch.clamp(advantages, -ADV_CLIP_MAX, ADV_CLIP_MAX)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


def flux_step(model_output, latents, eta, sigma, sigma_next, prev_sample, log_dtype=torch.float32):
    """DanceGRPO's ``flux_step(grpo=True, sde_solver=True)`` on a stored transition, with
    per-sample (B,) sigmas; returns the log-probability (B,). DanceGRPO computes the log-density
    in float32 (``log_dtype``; the float64 exactness checks pass float64)."""
    sigma = sigma.view(-1, *([1] * (latents.ndim - 1)))
    sigma_next = sigma_next.view(-1, *([1] * (latents.ndim - 1)))
    prev_sample_mean, _ = grpo.flux_step_mean(model_output, latents, sigma, sigma_next, eta)
    std_dev_t = eta * torch.sqrt(sigma - sigma_next)
    log_prob = (-((prev_sample.detach().to(log_dtype) - prev_sample_mean.to(log_dtype)) ** 2)
                / (2 * std_dev_t**2) - torch.log(std_dev_t) - _LOG_SQRT_2PI)
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def flow_grpo_sde_loss(transformer, batch, num_steps: int):
    """Flow-GRPO: ``sde_step_with_logprob`` (sde_type='sde') log-prob + PPO clip, mean over steps."""
    total = 0.0
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        noise_pred = transformer(latents, timestep=batch["timesteps"][:, j])
        sigma = batch["sigmas"][:, j].view(-1, 1)
        sigma_prev = batch["sigmas_next"][:, j].view(-1, 1)
        sigma_max = batch["sigma_max"].view(-1, 1)
        dt = sigma_prev - sigma
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * NOISE_LEVEL
        prev_sample_mean = (latents * (1 + std_dev_t**2 / (2 * sigma) * dt)
                            + noise_pred * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
        std = std_dev_t * torch.sqrt(-1 * dt)
        log_prob = (-((batch["next_latents"][:, j] - prev_sample_mean) ** 2) / (2 * std**2)
                    - torch.log(std) - _LOG_SQRT_2PI)
        log_prob = log_prob.mean(dim=1)
        total = total + ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j],
                                  batch["clip_range"])
    return total / num_steps


def dance_flux_loss(transformer, batch, num_steps: int):
    """DanceGRPO: ``flux_step(sde_solver=True)`` log-prob + PPO clip, mean over steps."""
    total = 0.0
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        model_output = transformer(latents, timestep=batch["timesteps"][:, j])
        log_prob = flux_step(model_output, latents, ETA, batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                             batch["next_latents"][:, j], log_dtype=latents.dtype)
        total = total + ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j],
                                  batch["clip_range"])
    return total / num_steps


def cps_loss(transformer, batch, num_steps: int):
    """Flow-GRPO sde_type='cps': log-prob = −mean squared error to the CPS mean, + PPO clip."""
    total = 0.0
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        model_output = transformer(latents, timestep=batch["timesteps"][:, j])
        sigma = batch["sigmas"][:, j].view(-1, 1)
        sigma_prev = batch["sigmas_next"][:, j].view(-1, 1)
        std_dev_t = sigma_prev * math.sin(NOISE_LEVEL * math.pi / 2)
        pred_original_sample = latents - sigma * model_output
        noise_estimate = latents + model_output * (1 - sigma)
        prev_sample_mean = (pred_original_sample * (1 - sigma_prev)
                            + noise_estimate * torch.sqrt(sigma_prev**2 - std_dev_t**2))
        log_prob = -((batch["next_latents"][:, j] - prev_sample_mean) ** 2).mean(dim=1)
        total = total + ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j],
                                  batch["clip_range"])
    return total / num_steps


LOSSES: dict[str, Callable] = {"flow_grpo_sde": flow_grpo_sde_loss, "dance_flux": dance_flux_loss,
                               "cps": cps_loss}
assert tuple(LOSSES) == grpo.STEP_KINDS, "one GRPO loss per step policy of jaggc.grpo"


def _grpo_step(kind: str, v, z, sigma, sigma_next, sigma_max: float, **kw) -> grpo.StepPolicy:
    """The ``jaggc.grpo`` step policy of ``kind`` with the losses' hyper-parameters."""
    if kind == "flow_grpo_sde":
        return grpo.flow_grpo_sde_step(v, z, sigma, sigma_next, noise_level=NOISE_LEVEL,
                                       sigma_max=sigma_max, **kw)
    if kind == "dance_flux":
        return grpo.dance_flux_step(v, z, sigma, sigma_next, eta=ETA, **kw)
    return grpo.cps_step(v, z, sigma, sigma_next, noise_level=NOISE_LEVEL, **kw)


# ----------------------------------------------------------------------------- stored rollouts

@dataclass
class Rollout:
    """A stored GRPO batch (the loss's ``batch`` dict), its step count and JAGG window size."""

    kind: str
    batch: dict
    num_steps: int
    window: int

    @property
    def windows(self) -> list[list[int]]:
        # consecutive windows, a shorter tail its own window (README), written out independently
        n, w = self.num_steps, self.window
        return [list(range(lo, min(lo + w, n))) for lo in range(0, n, w)]

    def expected_backwards(self, per_step: bool = False) -> tuple[int, int]:
        """Bounds on the DiT backward passes of the rewritten loss: per window of >= 3 steps one
        joint pass of its two knots (two passes with per-step forwards, ``batch_knots=False``); a
        window of <= 2 steps is all knots, run per step (today) or jointly."""
        knots = 2 if per_step else 1
        return (sum(knots if len(w) >= 3 else 1 for w in self.windows),
                sum(knots if len(w) >= 3 else len(w) for w in self.windows))


def _sample_grid(gen: torch.Generator, n: int, shift: float, extra: int | None = None,
                 start: int | None = None) -> tuple[torch.Tensor, float]:
    """n + 1 consecutive σ of a shift-``shift`` grid of n + extra steps from index ``start`` (random
    where None; start 0 is σ = 1, the slice may end at σ = 0), and the grid's σ₁ (Flow-GRPO's
    sigma_max, used where σ = 1)."""
    extra = int(torch.randint(0, 9, (), generator=gen)) if extra is None else extra
    grid_steps = max(n + extra, 2)
    start = int(torch.randint(0, grid_steps - n + 1, (), generator=gen)) if start is None else start
    grid = shift_sigmas(grid_steps, shift)
    start = min(start, grid_steps - n)
    return grid[start:start + n + 1], float(grid[1])


def _schedule(gen, n: int, batch: int, case: dict):
    """σ of shape (B, n + 1) and sigma_max (B,): one grid for the batch as the case says, or with
    ``per_sample`` one random grid per sample (own length, offset and shift)."""
    if not case.get("per_sample", False):
        sig, smax = _sample_grid(gen, n, float(case.get("shift", 3)), case.get("extra"), case.get("start"))
        return sig.expand(batch, n + 1).clone(), torch.full((batch,), smax, dtype=DT)
    rows = [_sample_grid(gen, n, 1.0 + 4.0 * float(torch.rand((), generator=gen, dtype=DT)))
            for _ in range(batch)]
    return torch.stack([r[0] for r in rows]), torch.tensor([r[1] for r in rows], dtype=DT)


def _chord_states(gen, sigmas: torch.Tensor, windows: list[list[int]], dim: int) -> torch.Tensor:
    """(B, n, D) states, each window's on its chord: z_k = (1 − α_k) z_a + α_k z_b, α by σ."""
    batch, n = sigmas.shape
    z = torch.empty(batch, n, dim, dtype=DT)
    for idx in windows:
        t = sigmas[:, idx]
        span = t[:, -1:] - t[:, :1]
        alpha = (t - t[:, :1]) / span if len(idx) > 1 else torch.zeros_like(t)
        z_a = torch.randn(batch, 1, dim, generator=gen, dtype=DT)
        z_b = torch.randn(batch, 1, dim, generator=gen, dtype=DT)
        z[:, idx] = (1 - alpha[..., None]) * z_a + alpha[..., None] * z_b
    return z


def _policy_rows(kind, field, z, sig_k, sig_next, smax, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """One policy step per sample (each sample may have its own sigma_max): next states and
    log-probs under the current field, drawn with ``jaggc.grpo``."""
    with torch.no_grad():
        v = field(z, timestep=sig_k)
        nxt, lps = [], []
        for i in range(z.shape[0]):
            step = _grpo_step(kind, v[i:i + 1], z[i:i + 1], sig_k[i:i + 1], sig_next[i:i + 1],
                              float(smax[i]), generator=gen)
            nxt.append(step.prev_sample)
            lps.append(step.log_prob)
    return torch.cat(nxt), torch.cat(lps)


def _transitions(kind, field, latents, sig, smax, gen, z0):
    """Stored states, next states and log-probs of the policy steps: from the given ``latents``
    (B, n, D), or, where None, a real rollout from ``z0`` (each next state is the next state)."""
    states, nexts, lps = [], [], []
    z = z0
    for j in range(sig.shape[1] - 1):
        z = latents[:, j] if latents is not None else z
        z_next, lp = _policy_rows(kind, field, z, sig[:, j], sig[:, j + 1], smax, gen)
        states.append(z)
        nexts.append(z_next)
        lps.append(lp)
        z = z_next
    return torch.stack(states, 1), torch.stack(nexts, 1), torch.stack(lps, 1)


def _ratio_offsets(gen, advantages: torch.Tensor, n: int, spread: float) -> torch.Tensor:
    """u (B, n) with old log-prob = log-prob − ε·u, i.e. ratio r = e^{εu}. u ~ U(−spread, spread),
    except: sample 0 has |u| <= 0.5 (unclipped at every step: the gradient is never trivially
    zero), and for spread > 1 the last of >= 2 samples has u = 2·sign(A) (PPO-clipped at every
    step: its upstream gradient is zero)."""
    batch = advantages.shape[0]
    u = spread * (2 * torch.rand(batch, n, generator=gen, dtype=DT) - 1)
    u[0] = u[0].clamp(-0.5, 0.5)
    if spread > 1 and batch >= 2:
        u[-1] = 2.0 * torch.sign(advantages[-1])
    return u


def make_rollout(kind: str, field: nn.Module, case: dict, seed: int, *, stream: int,
                 on_chord: bool, off_chord: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Rollout:
    """Stored data for one GRPO batch of the case's W, n, B, D, σ grids, clip range and spread.

    ``on_chord``: every window's states on its chord (the exact regime), each followed by one
    policy step to get ``next_latents``; else a real SDE rollout (``latents[:, j + 1] ==
    next_latents[:, j]``), whose injected noise moves the states off every chord. ``off_chord``
    maps the chord states to the states to store, before the policy steps are drawn from them (a
    state moved after the rollout would make its stored transition improbable: PPO-clipped, g = 0).
    """
    gen = _gen(stream, case["s"], seed)
    W, B, D = case["W"], case["B"], case["D"]
    n = case.get("n", W)
    sig, smax = _schedule(gen, n, B, case)
    rollout = Rollout(kind, {}, n, W)
    latents = _chord_states(gen, sig[:, :n], rollout.windows, D) if on_chord else None
    if off_chord is not None:
        latents = off_chord(latents)
    z0 = torch.randn(B, D, generator=gen, dtype=DT)
    states, nexts, lps = _transitions(kind, field, latents, sig, smax, gen, z0)
    eps = CLIP_RANGES[case.get("clip", 1)]
    advantages = case.get("adv_scale", 3.0) * torch.randn(B, generator=gen, dtype=DT)
    u = _ratio_offsets(gen, advantages, n, case.get("spread", 0.5))
    rollout.batch = dict(
        latents=states, next_latents=nexts, timesteps=sig[:, :n].clone(), sigmas=sig[:, :n].clone(),
        sigmas_next=sig[:, 1:].clone(), sigma_max=smax, log_probs=lps - eps * u,
        advantages=advantages[:, None].expand(B, n).clone(), clip_range=torch.tensor(eps, dtype=DT))
    return rollout


# ----------------------------------------------------------------------------- running a loss

def _params(field: nn.Module) -> list[torch.Tensor]:
    return list(field.parameters())


def _flat_grad(field: nn.Module, value: torch.Tensor) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, _params(field))])


def eager(rollout: Rollout, field: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The undecorated loss: value and exact gradient (one DiT backward per step)."""
    value = LOSSES[rollout.kind](field, rollout.batch, rollout.num_steps)
    return value.detach(), _flat_grad(field, value)


@contextlib.contextmanager
def _dynamo_room():
    # every example is a new field and new shapes, i.e. one more Dynamo graph of the same loss
    # code; the default recompile limit (8) would refuse the 9th example
    with dynamo_recompile_limits(100_000, accumulated=1_000_000):
        yield


def compile_loss(rollout: Rollout, capture: str, per_step: bool = False):
    """``@jagg_compile(window=W, weights="t", capture=...)`` of the rollout's GRPO loss (plain JAGG,
    the estimator the exactness theorems are about); ``per_step``: every DiT forward of a window as
    its own call (``Options(interior_chunk=1, batch_knots=False)``), under which the forward values are
    bit-identical to the uncompiled loss (README)."""
    from ..api import jagg_compile
    from ..options import Options

    options = Options(interior_chunk=1, batch_knots=False) if per_step else None
    return jagg_compile(LOSSES[rollout.kind], window=rollout.window, weights="t", capture=capture, options=options)


def compiled(rollout: Rollout, field: nn.Module, capture: str, loss=None,
             per_step: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Value, gradient and DiT backward passes of the compiled loss (``loss``: a ``compile_loss``
    result to reuse, e.g. for several batches of one shape; else a fresh one, ``per_step`` as in
    ``compile_loss``).

    The first call of a fresh loss traces (Dynamo runs the opaque DiT on fake tensors then, which
    fires module hooks), so passes are counted on a second call, which must give the same value."""
    loss = loss if loss is not None else compile_loss(rollout, capture, per_step)
    with _dynamo_room():
        first = loss(field, rollout.batch, rollout.num_steps).detach()
        with count_dit_passes(field) as counts:
            value = loss(field, rollout.batch, rollout.num_steps)
            grad = _flat_grad(field, value)
    if not torch.equal(first, value.detach()):
        raise AssertionError(f"{capture}: two calls of the compiled loss differ: {first} vs {value}")
    if loss.report is None or loss.report.path != capture:
        raise AssertionError(f"the loss did not run through capture={capture!r}: {loss.report}")
    return value.detach(), grad, counts.backwards


class _Replay(nn.Module):
    """Stands in for the DiT inside the loss: hands back given outputs in call order."""

    def __init__(self, outs):
        super().__init__()
        self.outs = list(outs)

    def forward(self, x, timestep=None):
        return self.outs.pop(0)


def _calls(rollout: Rollout) -> list[DitCall]:
    b = rollout.batch
    return [DitCall((b["latents"][:, j],), {"timestep": b["timesteps"][:, j]}) for j in range(rollout.num_steps)]


def runtime(rollout: Rollout, field: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime path: ``jagg_calls`` on the loss's DiT calls, the loss on its outputs."""
    outs = jagg_calls(field, _calls(rollout), window=rollout.window)
    value = LOSSES[rollout.kind](_Replay(outs), rollout.batch, rollout.num_steps)
    return value.detach(), _flat_grad(field, value)


def upstream_grads(rollout: Rollout, field: nn.Module) -> list[torch.Tensor]:
    """g_k = ∂L/∂v_k of the loss at the field's outputs (autograd through the loss only)."""
    with torch.no_grad():
        vs = [c(field).requires_grad_() for c in _calls(rollout)]
    value = LOSSES[rollout.kind](_Replay(vs), rollout.batch, rollout.num_steps)
    return list(torch.autograd.grad(value, vs))


def grpo_log_probs(rollout: Rollout, field: nn.Module) -> torch.Tensor:
    """(B, n) log-probs of the stored transitions under the field, from ``jaggc.grpo`` (per sample:
    each may have its own sigma_max)."""
    b, n = rollout.batch, rollout.num_steps
    rows = []
    with torch.no_grad():
        for j in range(n):
            v = field(b["latents"][:, j], timestep=b["timesteps"][:, j])
            rows.append(torch.cat([
                _grpo_step(rollout.kind, v[i:i + 1], b["latents"][i:i + 1, j], b["sigmas"][i:i + 1, j],
                           b["sigmas_next"][i:i + 1, j], float(b["sigma_max"][i]),
                           prev_sample=b["next_latents"][i:i + 1, j]).log_prob
                for i in range(v.shape[0])]))
    return torch.stack(rows, 1)


def _ppo_kw(rollout: Rollout) -> dict:
    return dict(clip_range=float(rollout.batch["clip_range"]), adv_clip_max=ADV_CLIP_MAX)


def grpo_reference_value(rollout: Rollout, field: nn.Module) -> torch.Tensor:
    """The same loss from ``jaggc.grpo``: step-policy log-probs and ``ppo_clip_loss``."""
    b, lps = rollout.batch, grpo_log_probs(rollout, field)
    steps = [grpo.ppo_clip_loss(lps[:, j], b["log_probs"][:, j], b["advantages"][:, j], **_ppo_kw(rollout)).mean()
             for j in range(rollout.num_steps)]
    return torch.stack(steps).mean()


def clipped_share(rollout: Rollout, field: nn.Module) -> float:
    """Share of (sample, step) pairs on the PPO-clipped branch (zero upstream gradient there)."""
    b = rollout.batch
    stats = grpo.ppo_clip_stats(grpo_log_probs(rollout, field).reshape(-1), b["log_probs"].reshape(-1),
                                b["advantages"].reshape(-1), **_ppo_kw(rollout))
    return float(stats["clipped_frac"])


def _seeded(cls, case: dict, seed: int) -> nn.Module:
    return cls(case["D"], seed=(case["s"] + seed) % 997)


def _require_nonzero(x: torch.Tensor, what: str) -> None:
    # an identity between zeros proves nothing: such an example is a defect of the strategy
    if float(x.norm()) == 0.0:
        raise AssertionError(f"degenerate example: {what} is zero")


def _require_backwards(got: int, rollout: Rollout, capture: str, per_step: bool = False) -> None:
    lo, hi = rollout.expected_backwards(per_step)
    if not lo <= got <= hi:
        raise AssertionError(f"{capture}: {got} DiT backward passes, expected {lo}..{hi} for windows "
                             f"{rollout.windows}: the rewrite did not run as planned")


def _value_error(got: torch.Tensor, want: torch.Tensor, capture: str, per_step: bool) -> float:
    """Relative error of a compiled loss value; with per-step forwards it must be bit-identical
    (batched forwards may differ by the DiT's batch-size roundoff)."""
    if per_step and not torch.equal(got, want):
        raise AssertionError(f"{capture}: loss value {got.item()!r} is not bit-identical to the eager "
                             f"{want.item()!r} with per-step forwards")
    return rel_err(got, want)
