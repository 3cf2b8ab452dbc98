"""``digits-wide``: the digits base widened, without changing its function, until the DiT's passes are
the cost of an iteration (as on SD3.5 / FLUX / Wan), derived deterministically at first use and cached.

How it is made (``derive_wide_base``), from the shipped digits DiT (``studies/digits/weights/base_dit.pt``):

1. **widen**: every feed-forward (``ff`` and ``ff_context`` of the 4 joint blocks; 64 -> 256 -> 64, GELU)
   gets each hidden unit duplicated ``WIDE_FACTOR`` times (64 -> 2048 -> 64); the copies' outgoing
   weights are the original's divided by ``WIDE_FACTOR``, so the widened DiT computes the same function
   (to fp32 roundoff: ``tests/studies/test_fewsteps_wide.py``);
2. **break the symmetry**: the copies' incoming weights and biases get Gaussian noise of
   ``PERTURB`` x the layer's weight std (the copies would otherwise stay identical under any gradient);
3. **recover**: ``RECOVERY_STEPS`` AdamW steps of the base's own flow-matching objective on the
   digits train split (lr ``RECOVERY_LR``, batch 64, one thread), so the perturbation's small change is
   fitted away.

0.58M -> 2.2M parameters (fp16: 4.4 MB; it is not shipped: ~1 minute on one core at first use, then
read from the cache, ``$JAGGC_STUDIES_CACHE`` or ``~/.cache/jaggc_studies``). The widening puts the
parameters where a real DiT has most of them (its MLPs: 2/3 of SD3's block parameters) and makes a
pass compute- rather than Python-bound. The cost shape at the study's batch is measured by
``jaggc_studies.fewsteps.cost_shape``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

WIDE_FACTOR = 8
PERTURB = 0.01
RECOVERY_STEPS = 150
RECOVERY_LR = 1e-4
RECOVERY_SEED = 0
_VERSION = 1    # bump when the recipe changes: the cache key includes it


def widen_feedforward(dit: torch.nn.Module, factor: int, *, perturb: float = 0.0, seed: int = 0) -> torch.nn.Module:
    """Duplicate each feed-forward hidden unit of ``dit`` ``factor`` times and split its outgoing
    weight among the copies (in place; the function is unchanged when ``perturb`` is 0). ``perturb``:
    Gaussian noise on the copies' incoming weights and biases, times each layer's weight std."""
    g = torch.Generator().manual_seed(seed)
    for _, module in sorted(dit.named_modules(), key=lambda item: item[0]):
        if type(module).__name__ != "FeedForward":
            continue
        up, down = module.net[0].proj, module.net[2]
        new_up = torch.nn.Linear(up.in_features, up.out_features * factor)
        new_down = torch.nn.Linear(down.in_features * factor, down.out_features)
        with torch.no_grad():
            new_up.weight.copy_(up.weight.repeat(factor, 1))
            new_up.bias.copy_(up.bias.repeat(factor))
            if perturb:
                scale = perturb * float(up.weight.std())
                new_up.weight.add_(scale * torch.randn(new_up.weight.shape, generator=g))
                new_up.bias.add_(scale * torch.randn(new_up.bias.shape, generator=g))
            new_down.weight.copy_(down.weight.repeat(1, factor) / factor)
            new_down.bias.copy_(down.bias)
        module.net[0].proj = new_up
        module.net[2] = new_down
    return dit


def build_wide_dit(factor: int = WIDE_FACTOR) -> torch.nn.Module:
    """The widened architecture with the unperturbed, function-preserving weights of the digits base
    (no recovery fit): what the cost-shape test times (the cost does not depend on the weights)."""
    from jaggc_studies.digits.model import load_base

    return widen_feedforward(load_base(), factor).float().eval()


def cache_dir() -> Path:
    return Path(os.environ.get("JAGGC_STUDIES_CACHE", Path.home() / ".cache" / "jaggc_studies"))


def _cache_path(factor: int) -> Path:
    from jaggc_studies.digits.model import BASE_WEIGHTS

    digest = hashlib.sha256(Path(BASE_WEIGHTS).read_bytes()).hexdigest()[:12]
    key = f"v{_VERSION}-k{factor}-p{PERTURB:g}-s{RECOVERY_STEPS}-lr{RECOVERY_LR:g}-{digest}"
    return cache_dir() / f"digits_wide_{key}.pt"


def derive_wide_base(factor: int = WIDE_FACTOR, *, steps: int = RECOVERY_STEPS, progress: bool = True) -> torch.nn.Module:
    """Widen, perturb and recover (module docstring); deterministic: one thread inside."""
    from jaggc_studies.digits.data import load_digits_split
    from jaggc_studies.digits.model import load_base
    from jaggc_studies.digits.train_base import flow_matching_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dit = widen_feedforward(load_base(), factor, perturb=PERTURB, seed=RECOVERY_SEED).float().train()
        data = load_digits_split("train")
        g = torch.Generator().manual_seed(RECOVERY_SEED)
        opt = torch.optim.AdamW(dit.parameters(), lr=RECOVERY_LR, weight_decay=0.0)
        for step in range(steps):
            idx = torch.randint(0, len(data.labels), (64,), generator=g)
            loss = flow_matching_loss(dit, data.images[idx], data.labels[idx], g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
            opt.step()
            if progress and (step + 1) % 50 == 0:
                print(f"digits-wide recovery fit: step {step + 1}/{steps}, loss {float(loss.detach()):.4f}", flush=True)
    finally:
        torch.set_num_threads(threads)
    return dit.eval()


def load_wide_base(factor: int = WIDE_FACTOR) -> torch.nn.Module:
    """The ``digits-wide`` base: from the cache, or derived (``derive_wide_base``) and cached."""
    from jaggc_studies.digits.model import load_parameters, save_fp16_state

    path = _cache_path(factor)
    if not path.is_file():
        print(f"deriving the digits-wide base (x{factor} feed-forward width; cached at {path}) ...", flush=True)
        dit = derive_wide_base(factor)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_fp16_state(dit, tmp, factor=factor)
        os.replace(tmp, path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    dit = build_wide_dit(factor)
    load_parameters(dit, {k: v.float() for k, v in ckpt["state_dict"].items()})
    return dit.float().eval()


__all__ = ["PERTURB", "RECOVERY_STEPS", "WIDE_FACTOR", "build_wide_dit", "derive_wide_base", "load_wide_base",
           "widen_feedforward"]
