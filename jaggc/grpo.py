"""Per-step GRPO policies for flow models, the PPO-clip loss, group advantages and the closed-form
upstream gradient g = dL/dv that JAGG aggregates.

Three step policies, each written as mu = a*z + b*v with a, b, std independent of v:

- ``"flow_grpo_sde"``: Flow-GRPO ``sde_step_with_logprob`` (sde_type='sde'),
  yifan123/flow_grpo flow_grpo/diffusers_patch/sd3_sde_with_logprob.py.
- ``"dance_flux"``: DanceGRPO ``flux_step(sde_solver=True)``, XueZeyue/DanceGRPO
  fastvideo/train_grpo_flux.py (same code in the JAGG author's SchumiDing/eff_grpo).
- ``"cps"``: Flow-GRPO sde_type='cps' (arXiv 2509.05952); log-prob is -mean squared error.

All math is done in fp32 (fp64 inputs stay fp64 so exactness can be tested). log-probs are means
over the non-batch elements, as in the trainers. The estimator they feed: arXiv 2607.17572 (README).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from jaggc.errors import JaggInputError

STEP_KINDS = ("flow_grpo_sde", "dance_flux", "cps")
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass(frozen=True)
class StepPolicy:
    """One stochastic step z -> prev_sample with mean = a*z + b*v and Gaussian std ``std``.

    ``log_prob`` has shape (B,). ``std`` is the std of the transition noise (for Flow-GRPO it is
    std_dev_t*sqrt(-dt)); ``std_dev_t`` is the trainer's own std_dev_t (what Flow-GRPO's KL term
    divides by). ``a``, ``b``, ``std``, ``std_dev_t`` broadcast against z (0-d or (B, 1, ..., 1)).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    std_dev_t: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor


# ---------------------------------------------------------------------------------------------
# input checks


def _is_tensor(x) -> bool:
    """A tensor, or a traced stand-in for one (torch.fx's Proxy, while a frontend captures a loss
    built on these helpers: the checks below must not break the capture)."""
    return isinstance(x, (torch.Tensor, torch.fx.Proxy))


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    # fp32 like the trainers (bf16 overflows in the mean); fp64 is kept so tests can be exact.
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_state(v: torch.Tensor, z: torch.Tensor, prev_sample: torch.Tensor | None) -> None:
    if not _is_tensor(v):
        raise JaggInputError(f"input 'v' must be a tensor, got {type(v).__name__}")
    if v.ndim < 2:
        raise JaggInputError(
            f"input 'v' must have shape (B, ...) with at least one non-batch dim, got shape "
            f"{tuple(v.shape)}; add a trailing dim (v[:, None]) for scalar states")
    if not _is_tensor(z) or z.shape != v.shape:
        raise JaggInputError(f"input 'z' must have the shape of 'v' {tuple(v.shape)}, got "
                             f"{getattr(z, 'shape', type(z))}")
    if prev_sample is not None and (not _is_tensor(prev_sample)
                                    or prev_sample.shape != v.shape):
        raise JaggInputError(f"input 'prev_sample' must have the shape of 'v' {tuple(v.shape)}, "
                             f"got {getattr(prev_sample, 'shape', type(prev_sample))}")


def _as_sigma(x, name: str, batch: int | None, dtype: torch.dtype, device) -> torch.Tensor:
    """A float, 0-d or (B,) noise level as a tensor (shape kept; broadcasting is done later)."""
    # straight to the compute dtype: a Python float must not pass through fp32 on the way to fp64
    t = (x.to(dtype=dtype, device=device) if _is_tensor(x) else torch.as_tensor(x, dtype=dtype, device=device)).detach()
    if t.ndim > 1 or (t.ndim == 1 and batch is not None and t.numel() not in (1, batch)):
        raise JaggInputError(f"input {name!r} must be a float, a 0-d tensor or shape ({batch},), "
                             f"got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()) or bool((t > 1).any()):
        raise JaggInputError(f"input {name!r} must lie in [0, 1] (flow-matching noise level), "
                             f"got {t.tolist()}")
    return t


def _sigmas(sigma, sigma_next, batch, dtype, device, *, positive_sigma: bool):
    s = _as_sigma(sigma, "sigma", batch, dtype, device)
    sn = _as_sigma(sigma_next, "sigma_next", batch, dtype, device)
    if s.numel() > 1 and sn.numel() > 1 and s.shape != sn.shape:
        raise JaggInputError(f"inputs 'sigma' {tuple(s.shape)} and 'sigma_next' "
                             f"{tuple(sn.shape)} must have one value per sample each")
    if bool((sn >= s).any()):
        raise JaggInputError(f"input 'sigma_next' must be < 'sigma' (steps go from noise to data); "
                             f"got sigma={s.tolist()}, sigma_next={sn.tolist()}")
    if positive_sigma and bool((s <= 0).any()):
        raise JaggInputError(f"input 'sigma' must be > 0 for this step (it divides by sigma), "
                             f"got {s.tolist()}")
    return s, sn


def _positive(value: float, name: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise JaggInputError(f"option {name!r} must be a finite number > 0, got {value!r}")


def _bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    # per-sample (B,) coefficients become (B, 1, ..., 1), as the trainers' sigma.view(-1, 1, ...)
    return t.reshape(-1, *([1] * (ndim - 1))) if t.ndim == 1 else t


# ---------------------------------------------------------------------------------------------
# coefficients: (a, b, std, std_dev_t) as tensors of the sigmas' shape


def _sde_coefficients(s, sn, noise_level, sigma_max):
    _positive(noise_level, "noise_level")
    if sigma_max is not None and not (0 < float(sigma_max) < 1):
        raise JaggInputError(f"option 'sigma_max' must be in (0, 1) (sigmas[1] of the "
                             f"schedule), got {sigma_max!r}")
    at_one = s == 1
    if sigma_max is None and bool(at_one.any()):
        raise JaggInputError(
            "input 'sigma' is 1: Flow-GRPO's std_dev_t = a*sqrt(sigma/(1-sigma)) then uses "
            "sigma_max in the denominator; pass sigma_max=sigmas[1] of the schedule "
            "(e.g. flow_match_sigmas(T)[1])")
    # sigma_max only replaces sigma in the denominator where sigma == 1, as in the trainer
    sigma_max_t = torch.as_tensor(float(sigma_max or 0.0), dtype=s.dtype, device=s.device)
    denom_sigma = torch.where(at_one, sigma_max_t, s)
    std_dev_t = torch.sqrt(s / (1 - denom_sigma)) * noise_level
    dt = sn - s
    a = 1 + std_dev_t**2 / (2 * s) * dt
    b = (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    return a, b, std_dev_t * torch.sqrt(-dt), std_dev_t


def _dance_coefficients(s, sn, eta):
    _positive(eta, "eta")
    dsigma = sn - s
    a = 1 + eta**2 * dsigma / (2 * s)
    b = dsigma * (1 + eta**2 * (1 - s) / (2 * s))
    std = eta * torch.sqrt(s - sn)
    return a, b, std, std


def _cps_coefficients(s, sn, noise_level):
    if not (isinstance(noise_level, (int, float)) and 0 < noise_level <= 1):
        raise JaggInputError(f"option 'noise_level' must be in (0, 1] for CPS "
                             f"(std = sigma_next*sin(pi*noise_level/2)), got {noise_level!r}")
    std = sn * math.sin(noise_level * math.pi / 2)
    keep = torch.sqrt(sn**2 - std**2)  # = sigma_next*cos(pi a/2), written as the trainer does
    return (1 - sn) + keep, -s * (1 - sn) + (1 - s) * keep, std, std


def step_coefficients(kind: str, sigma, sigma_next, *, dtype: torch.dtype = torch.float32,
                      **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, std) with mean = a*z + b*v for step ``kind`` (one of STEP_KINDS).

    Options as in the step functions: noise_level/sigma_max (flow_grpo_sde), eta (dance_flux),
    noise_level (cps). Shapes follow sigma (0-d or (B,)).
    """
    if _is_tensor(sigma) and sigma.dtype == torch.float64:
        dtype = torch.float64
    device = sigma.device if _is_tensor(sigma) else None
    if kind == "flow_grpo_sde":
        s, sn = _sigmas(sigma, sigma_next, None, dtype, device, positive_sigma=True)
        a, b, std, _ = _sde_coefficients(s, sn, kw.pop("noise_level", 0.7),
                                         kw.pop("sigma_max", None))
    elif kind == "dance_flux":
        s, sn = _sigmas(sigma, sigma_next, None, dtype, device, positive_sigma=True)
        a, b, std, _ = _dance_coefficients(s, sn, kw.pop("eta", 0.3))
    elif kind == "cps":
        s, sn = _sigmas(sigma, sigma_next, None, dtype, device, positive_sigma=False)
        a, b, std, _ = _cps_coefficients(s, sn, kw.pop("noise_level", 0.7))
    else:
        raise JaggInputError(f"input 'kind' must be one of {STEP_KINDS}, got {kind!r}")
    if kw:
        raise JaggInputError(f"options {sorted(kw)} are not used by step kind {kind!r}")
    return a, b, std


# ---------------------------------------------------------------------------------------------
# step policies


def _noise(shape, generator, device, dtype) -> torch.Tensor:
    # like diffusers' randn_tensor: draw on the generator's device, then move
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)


def _finish(v, prev_sample, mean, std, std_dev_t, a, b, generator, log_prob_fn) -> StepPolicy:
    if prev_sample is None:
        # the next state is data for the following step: no gradient flows through it
        prev_sample = (mean + std * _noise(v.shape, generator, v.device, v.dtype)).detach()
    log_prob = log_prob_fn(prev_sample.detach(), mean)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return StepPolicy(prev_sample, log_prob, mean, std, std_dev_t, a, b)


def _prepare(v, z, prev_sample):
    _check_state(v, z, prev_sample)
    dtype = _compute_dtype(v, z)
    return v.to(dtype), z.to(dtype), (None if prev_sample is None else prev_sample.to(dtype))


def flow_grpo_sde_step(v, z, sigma, sigma_next, *, noise_level: float = 0.7,
                       sigma_max: float | None = None, prev_sample=None,
                       generator: torch.Generator | None = None) -> StepPolicy:
    """Flow-GRPO ``sde_step_with_logprob`` (sde_type='sde') for velocity v at state z.

    ``sigma_max`` (= sigmas[1] of the schedule) is required where sigma == 1.
    """
    v, z, prev_sample = _prepare(v, z, prev_sample)
    s, sn = _sigmas(sigma, sigma_next, v.shape[0], v.dtype, v.device, positive_sigma=True)
    a, b, std, std_dev_t = (_bcast(t, v.ndim) for t in _sde_coefficients(s, sn, noise_level,
                                                                         sigma_max))
    s, sn = _bcast(s, v.ndim), _bcast(sn, v.ndim)
    dt = sn - s
    # the trainer's own expression, so values match its rollouts to the last bit we can
    mean = z * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt

    def log_prob_fn(x, mu):
        return -((x - mu) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI

    return _finish(v, prev_sample, mean, std, std_dev_t, a, b, generator, log_prob_fn)


def flux_step_mean(model_output, latents, sigma, sigma_next, eta, *, sde_solver: bool = True):
    """DanceGRPO's ``flux_step``: the mean of the next state and the predicted clean sample for
    velocity ``model_output`` at ``latents`` (``sigma``, ``sigma_next``: numbers or tensors that
    broadcast against ``latents``). The one place its arithmetic is written: ``dance_flux_step``
    here, the verifier's ``flux_step`` (verify/grpo_losses.py) and the trainers' own shape of it
    (studies/trainers/dance_grpo.py) call it, each with its own log-density around it."""
    dsigma = sigma_next - sigma
    mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    if sde_solver:
        score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
        mean = mean + (-0.5 * eta**2 * score_estimate) * dsigma
    return mean, pred_original_sample


def dance_flux_step(v, z, sigma, sigma_next, *, eta: float = 0.3, prev_sample=None,
                    generator: torch.Generator | None = None,
                    include_constants: bool = True) -> StepPolicy:
    """DanceGRPO ``flux_step(sde_solver=True)`` for velocity v at state z.

    ``include_constants=False`` reproduces XueZeyue/DanceGRPO, where the ``- log std - log
    sqrt(2 pi)`` line is a separate (discarded) statement; ratios and gradients are unaffected.
    """
    v, z, prev_sample = _prepare(v, z, prev_sample)
    s, sn = _sigmas(sigma, sigma_next, v.shape[0], v.dtype, v.device, positive_sigma=True)
    a, b, std, _ = (_bcast(t, v.ndim) for t in _dance_coefficients(s, sn, eta))
    mean, _ = flux_step_mean(v, z, _bcast(s, v.ndim), _bcast(sn, v.ndim), eta)

    def log_prob_fn(x, mu):
        lp = -((x - mu) ** 2) / (2 * std**2)
        return lp - torch.log(std) - _LOG_SQRT_2PI if include_constants else lp

    return _finish(v, prev_sample, mean, std, std, a, b, generator, log_prob_fn)


def cps_step(v, z, sigma, sigma_next, *, noise_level: float = 0.7, prev_sample=None,
             generator: torch.Generator | None = None) -> StepPolicy:
    """Flow-GRPO sde_type='cps' step; log_prob = -mean (prev_sample - mean)^2 (no constants)."""
    v, z, prev_sample = _prepare(v, z, prev_sample)
    s, sn = _sigmas(sigma, sigma_next, v.shape[0], v.dtype, v.device, positive_sigma=False)
    a, b, std, _ = (_bcast(t, v.ndim) for t in _cps_coefficients(s, sn, noise_level))
    s, sn = _bcast(s, v.ndim), _bcast(sn, v.ndim)
    pred_original = z - s * v
    noise_estimate = z + v * (1 - s)
    mean = pred_original * (1 - sn) + noise_estimate * torch.sqrt(sn**2 - std**2)
    return _finish(v, prev_sample, mean, std, std, a, b, generator,
                   lambda x, mu: -((x - mu) ** 2))


_STEPS = {"flow_grpo_sde": flow_grpo_sde_step, "dance_flux": dance_flux_step, "cps": cps_step}


# ---------------------------------------------------------------------------------------------
# PPO-clip loss


def _check_ppo(log_prob, old_log_prob, advantages, clip_range, adv_clip_max):
    if not _is_tensor(log_prob) or log_prob.ndim != 1:
        raise JaggInputError(f"input 'log_prob' must be a (B,) tensor, got "
                             f"{getattr(log_prob, 'shape', type(log_prob))}")
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if not _is_tensor(t) or t.shape != log_prob.shape:
            raise JaggInputError(f"input {name!r} must be a tensor of the shape of 'log_prob' "
                                 f"{tuple(log_prob.shape)}, got {getattr(t, 'shape', type(t))}")
    if not (isinstance(clip_range, (int, float)) and 0 <= clip_range < 1):
        raise JaggInputError(f"option 'clip_range' must be in [0, 1), got {clip_range!r}")
    _positive(adv_clip_max, "adv_clip_max")


def _ppo_terms(log_prob, old_log_prob, advantages, clip_range, adv_clip_max):
    adv = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return adv, ratio, unclipped, clipped


def ppo_clip_loss(log_prob, old_log_prob, advantages, *, clip_range: float,
                  adv_clip_max: float = 5.0) -> torch.Tensor:
    """Per-sample loss (B,) max(-A r, -A clip(r, 1-eps, 1+eps)), A clamped to +-adv_clip_max."""
    _check_ppo(log_prob, old_log_prob, advantages, clip_range, adv_clip_max)
    _, _, unclipped, clipped = _ppo_terms(log_prob, old_log_prob, advantages, clip_range,
                                          adv_clip_max)
    return torch.maximum(unclipped, clipped)


def ppo_clip_stats(log_prob, old_log_prob, advantages, *, clip_range: float,
                   adv_clip_max: float = 5.0) -> dict[str, torch.Tensor]:
    """Detached 0-d diagnostics: ``clipfrac`` (|r-1| > eps, Flow-GRPO's), ``clipped_frac``
    (clipped branch active, i.e. zero gradient), ``approx_kl`` (0.5*mean((lp-lp_old)^2)),
    ``ratio_mean``/``ratio_min``/``ratio_max``."""
    _check_ppo(log_prob, old_log_prob, advantages, clip_range, adv_clip_max)
    with torch.no_grad():
        _, ratio, unclipped, clipped = _ppo_terms(log_prob, old_log_prob, advantages,
                                                  clip_range, adv_clip_max)
        return {
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "clipped_frac": (clipped > unclipped).float().mean(),
            "approx_kl": 0.5 * ((log_prob - old_log_prob) ** 2).mean(),
            "ratio_mean": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
        }


# ---------------------------------------------------------------------------------------------
# group advantages (computed in fp64 like Flow-GRPO's numpy tracker)


def _rewards(rewards) -> tuple[torch.Tensor, torch.dtype]:
    out_dtype = (rewards.dtype if isinstance(rewards, torch.Tensor) and rewards.is_floating_point()
                 else torch.float32)
    r = torch.as_tensor(rewards).detach().to(torch.float64)
    if r.ndim != 1 or r.numel() == 0:
        raise JaggInputError(f"input 'rewards' must be a non-empty 1-D sequence, got shape "
                             f"{tuple(r.shape)}")
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise JaggInputError(f"input 'rewards' has NaN/Inf at indices {bad}; fix or drop those "
                             f"samples before computing advantages")
    return r, out_dtype


def flow_grpo_advantages(rewards, prompt_ids: Sequence, *, global_std: bool = True,
                         eps: float = 1e-4) -> torch.Tensor:
    """Flow-GRPO PerPromptStatTracker: A = (R - mean over same prompt) / (std + eps).

    std is the population std (ddof=0) of the whole batch when global_std, else of the prompt's
    rewards. No history is kept across calls (Flow-GRPO clears its tracker every epoch).
    """
    r, out_dtype = _rewards(rewards)
    ids = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    if len(ids) != r.numel():
        raise JaggInputError(f"input 'prompt_ids' has length {len(ids)} but 'rewards' has "
                             f"{r.numel()}; pass one prompt id per reward")
    adv = torch.empty_like(r)
    batch_std = r.std(correction=0)
    for pid in dict.fromkeys(ids):
        idx = torch.tensor([i for i, p in enumerate(ids) if p == pid])
        group = r[idx]
        std = batch_std if global_std else group.std(correction=0)
        adv[idx] = (group - group.mean()) / (std + eps)
    return adv.to(out_dtype)


def dance_grpo_advantages(rewards, group_size: int, *, eps: float = 1e-8) -> torch.Tensor:
    """DanceGRPO/MixGRPO: consecutive groups of group_size, A = (R - mean)/(unbiased std + eps)."""
    r, out_dtype = _rewards(rewards)
    if not isinstance(group_size, int) or group_size < 2:
        raise JaggInputError(f"input 'group_size' must be an int >= 2 (the unbiased std of one "
                             f"sample is undefined), got {group_size!r}")
    if r.numel() % group_size:
        raise JaggInputError(f"input 'group_size' ({group_size}) must divide the number of "
                             f"rewards ({r.numel()}); samples come in consecutive groups")
    groups = r.view(-1, group_size)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)
    return adv.flatten().to(out_dtype)


# ---------------------------------------------------------------------------------------------
# closed-form upstream gradient


def upstream_grad(kind: str, v, z, prev_sample, sigma, sigma_next, old_log_prob, advantages, *,
                  clip_range: float, adv_clip_max: float = 5.0, normaliser: float = 1.0,
                  **step_kw) -> torch.Tensor:
    """dL/dv for L = sum_i ppo_clip_loss_i / normaliser, in closed form (no autograd).

    Gaussian kinds: -(A r chi / N) * b/(D std^2) * (z' - mean); CPS: -(A r chi / N) * 2b/D *
    (z' - mean); chi = 0 where the clipped branch is active, D = elements per sample. The
    trainers' torch.mean over the batch is normaliser = B (times their accumulation factor).
    Returned in the compute dtype (fp32, or fp64), so aggregation over steps stays in fp32.
    """
    if kind not in _STEPS:
        raise JaggInputError(f"input 'kind' must be one of {STEP_KINDS}, got {kind!r}")
    _positive(normaliser, "normaliser")
    if prev_sample is None:
        raise JaggInputError("input 'prev_sample' is required: the gradient is of the stored "
                             "transition z -> prev_sample")
    with torch.no_grad():
        step = _STEPS[kind](v.detach(), z, sigma, sigma_next, prev_sample=prev_sample, **step_kw)
        lp = step.log_prob
        _check_ppo(lp, old_log_prob, advantages, clip_range, adv_clip_max)
        adv, ratio, unclipped, clipped = _ppo_terms(lp, old_log_prob.to(lp.dtype),
                                                    advantages.to(lp.dtype), clip_range,
                                                    adv_clip_max)
        # chi: 1 where the unclipped branch carries the gradient. Ties (r inside the clip range)
        # are covered: autograd splits them half/half and both halves equal d(-A r)/dr there.
        chi = (unclipped >= clipped).to(lp.dtype)
        dl_dlogp = -(adv * ratio * chi) / normaliser
        n_elem = v[0].numel()
        resid = step.prev_sample.to(lp.dtype) - step.mean
        if kind == "cps":
            dlogp_dv = (2 * step.b / n_elem) * resid
        else:
            dlogp_dv = step.b / (n_elem * step.std**2) * resid
        return _bcast(dl_dlogp, v.ndim) * dlogp_dv


# ---------------------------------------------------------------------------------------------
# schedule


def flow_match_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """Sigmas (num_steps+1, ending in 0) of diffusers' FlowMatchEulerDiscreteScheduler(shift)."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise JaggInputError(f"input 'num_steps' must be an int >= 1, got {num_steps!r}")
    _positive(shift, "shift")
    from diffusers import FlowMatchEulerDiscreteScheduler  # heavy import, only when needed

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.detach().clone().cpu()
