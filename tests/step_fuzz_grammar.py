"""The grammar of the per-step loop fuzzer (issue 42): ``Program``, ``Disruption``, the hypothesis
strategy ``programs()`` and ``describe()``. tests/step_fuzz.py runs the programs.

A ``Program`` is a trainer's per-step GRPO loop: a float64 DiT (the affine-Jacobian or curved field
of tests/fuzz_inputs.py, the curved field with a frozen parameter as a LoRA stand-in, or the tiny
SD3), ``steps`` sampler steps per trajectory, ``trajectories`` trajectories, the order the loop
visits the steps in (σ order, reversed, a random permutation, DanceGRPO's random 60% subset in a
random order), jaggc's ``window`` / ``weights`` / ``backward`` / ``cfg_slice`` / ``rollout_cache``,
the per-step term (a linear probe or an SDE log-prob with a PPO clip against the rollout's
log-probs), CFG on ``[uncond; cond]`` with the uncond half detached, a KL term against a no-grad
call, accumulation (optimizer step and ``zero_grad`` every ``accumulate`` trajectories, a clip before
it), a GradScaler, how the trajectory is declared (``steps()`` wrapping the loop, or
``trajectory()``), and up to two ``Disruption``s: a kind (``DISRUPTIONS``) at a placement
(``PLACEMENTS``) that step_fuzz.positions() resolves to a trajectory and a loop position.
"""

from __future__ import annotations

import copy
import random
from dataclasses import asdict, dataclass, field

import torch

from hypothesis import strategies as st

import jaggc
from fuzz_inputs import FuzzAffine, FuzzCurved

DITS = ("affine", "curved", "frozen", "sd3")
ORDERS = ("sigma", "reversed", "random", "subset")
WEIGHTS = ("t", "index", "default")
BACKWARDS = ("joint", "lowmem", "per_window")
# window 1 is refused at install (windows are >= 2): drawn rarely (and last: hypothesis favours the first
# values), so that it stays covered and cheap
WINDOWS = (4, 2, 3, 5, 6, 4, 2, 3, 5, 6, 4, 1)
TERMS = ("linear", "ppo")
DECLARES = ("steps", "trajectory")
DISRUPTIONS = ("zero_grad_none", "zero_grad_zero", "opt_zero_grad", "clip", "scale_grad", "opt_step",
               "param_write", "break", "exception", "fewer", "autograd_grad", "backward_inputs")
# "first": after the first step's backward of an accumulation cycle's first trajectory (every .grad
# None); "after_exact": right after the backward of a step with σ < 0.5 (exact under the default
# weights) that another step follows; "last": after the loop's last step; "between": before the next
# trajectory's declaration (after the last one: before close()); "random": any step of any trajectory
PLACEMENTS = ("first", "after_exact", "last", "between", "random")
# kinds that end the loop or replace a step's backward: no "between" form
LOOP_KINDS = ("break", "exception", "fewer", "autograd_grad", "backward_inputs")


@dataclass(frozen=True)
class Disruption:
    kind: str
    placement: str = "random"


@dataclass(frozen=True)
class Program:
    dit: str = "affine"
    steps: int = 6
    trajectories: int = 1
    order: str = "sigma"
    window: int = 4
    weights: str = "t"
    backward: str = "joint"
    term: str = "linear"
    cfg: bool = False
    kl: bool = False
    cfg_slice: bool = False
    rollout_cache: bool = False
    accumulate: int = 1           # optimizer step + zero_grad after every `accumulate` trajectories
    clip_at_sync: bool = False    # clip_grad_norm_ before that optimizer step
    scaler: bool = False          # torch.amp.GradScaler("cpu"): scale(loss).backward(), scaler.step(opt)
    declare: str = "steps"
    disruptions: tuple = field(default=())
    seed: int = 0


def describe(p: Program) -> dict:
    """Each grammar field's value (the coverage test's view); disruptions one key per kind/placement."""
    out = {k: v for k, v in asdict(p).items() if k not in ("disruptions", "seed")}
    kinds = [d.kind for d in p.disruptions]
    out["disruption"] = kinds[0] if kinds else "none"
    out["disruption2"] = kinds[1] if len(kinds) > 1 else "none"
    out["placement"] = p.disruptions[0].placement if p.disruptions else "none"
    out["n_disruptions"] = len(kinds)
    return out


@st.composite
def disruptions(draw):
    kind = draw(st.sampled_from(DISRUPTIONS))
    places = [pl for pl in PLACEMENTS if not (kind in LOOP_KINDS and pl == "between")]
    return Disruption(kind, draw(st.sampled_from(places)))


@st.composite
def programs(draw, *, salt: int = 0, long: bool = False):
    # the tiny SD3 costs ~10x a field: one program in ten in CI
    dit = draw(st.sampled_from(DITS if long else DITS[:3] * 3 + DITS[3:]))
    if dit == "sd3" and not long:        # the tiny SD3 is ~10x a field's cost: short loops in CI
        steps = draw(st.integers(4, 6))
        trajectories = draw(st.integers(1, 2))
    else:
        steps = draw(st.integers(4, 10))
        trajectories = draw(st.integers(1, 3))
    cfg = draw(st.booleans())
    n = draw(st.sampled_from((0, 1, 1, 1, 2, 2)))
    return Program(
        dit=dit, steps=steps, trajectories=trajectories, order=draw(st.sampled_from(ORDERS)),
        window=draw(st.sampled_from(WINDOWS)), weights=draw(st.sampled_from(WEIGHTS)),
        backward=draw(st.sampled_from(BACKWARDS)), term=draw(st.sampled_from(TERMS)), cfg=cfg,
        kl=draw(st.booleans()), cfg_slice=cfg and draw(st.booleans()), rollout_cache=draw(st.booleans()),
        accumulate=draw(st.integers(1, 3)), clip_at_sync=draw(st.booleans()), scaler=draw(st.booleans()),
        declare=draw(st.sampled_from(DECLARES)),
        disruptions=tuple(draw(disruptions()) for _ in range(n)),
        seed=draw(st.integers(0, 10_000)) + 100_003 * salt)


class BodyError(RuntimeError):
    """The exception a program raises in its loop body (caught around the loop)."""


# --- models and data ------------------------------------------------------------------------------
_SD3: dict = {}


def make_model(p: Program):
    if p.dit == "sd3":
        from jaggc import models
        if "state" not in _SD3:
            _SD3["model"] = models.sd3("tiny", seed=0).double()
            _SD3["state"] = copy.deepcopy(_SD3["model"].state_dict())
            _SD3["cond"] = models.sd3_conditioning(_SD3["model"], 2).kwargs
            _SD3["shape"] = models.sd3_latent_shape(_SD3["model"], 2)
        m = _SD3["model"]
        m.load_state_dict(_SD3["state"])
        return copy.deepcopy(m).train()
    m = (FuzzAffine if p.dit == "affine" else FuzzCurved)(3, seed=p.seed % 7)
    if p.dit == "frozen":                # a LoRA stand-in: part of the module is not trained
        next(m.parameters()).requires_grad_(False)
    return m


def trainable(m):
    return [q for q in m.parameters() if q.requires_grad]


def sigmas(p: Program) -> torch.Tensor:
    gen = torch.Generator().manual_seed(p.seed)
    gaps = torch.rand(p.steps, generator=gen, dtype=torch.float64) + 0.3
    return torch.cat([torch.ones(1, dtype=torch.float64), 1.0 - 0.85 * torch.cumsum(gaps, 0) / gaps.sum()])


def traj_data(p: Program, i: int) -> dict:
    gen = torch.Generator().manual_seed(p.seed * 31 + i)
    B = 2
    shape = _SD3["shape"] if p.dit == "sd3" else (B, 3)
    sig = sigmas(p)
    scale = 1000.0 if p.dit == "sd3" else 1.0
    times = torch.stack([sig[:-1] * (1 - 0.04 * b) for b in range(B)], 1) * scale      # (T, B)
    rnd = random.Random(p.seed * 131 + i)
    visit = list(range(p.steps))
    if p.order == "reversed":
        visit.reverse()
    elif p.order == "random":
        rnd.shuffle(visit)
    elif p.order == "subset":
        visit = rnd.sample(visit, max(2, round(0.6 * p.steps)))
    return dict(times=times, sig=sig, visit=visit, states=torch.randn(p.steps + 1, *shape, generator=gen,
                dtype=torch.float64), probes=torch.randn(p.steps, *shape, generator=gen, dtype=torch.float64),
                adv=torch.randn(B, generator=gen, dtype=torch.float64), old={})


def dit_call(p: Program, dit, data: dict, j: int, shrink: float = 1.0):
    x, t = data["states"][j] * shrink, data["times"][j]
    if p.cfg:
        x, t = torch.cat([0.5 * x, x]), torch.cat([t, t])
    if p.dit != "sd3":
        return dit(x, t), t
    cond = _SD3["cond"]
    ehs, pool = cond["encoder_hidden_states"], cond["pooled_projections"]
    if p.cfg:
        ehs, pool = torch.cat([torch.zeros_like(ehs), ehs]), torch.cat([torch.zeros_like(pool), pool])
    return dit(hidden_states=x, timestep=t, encoder_hidden_states=ehs, pooled_projections=pool,
               return_dict=False)[0], t


def guided(p: Program, out):
    if not p.cfg:
        return out
    unc, cond = out.chunk(2)
    return unc.detach() + 2.0 * (cond - unc.detach())


def log_prob(p: Program, data: dict, j: int, v):
    x, nxt = data["states"][j], data["states"][j + 1]
    dt = (data["sig"][j + 1] - data["sig"][j])
    return -((nxt - (x + dt * v)) ** 2).flatten(1).mean(1)


def step_loss(p: Program, dit, data: dict, j: int, out):
    v = guided(p, out)
    if p.term == "linear":
        loss = (v * data["probes"][j]).sum() / p.steps
    else:
        ratio = torch.exp(log_prob(p, data, j, v) - data["old"][j])
        adv = data["adv"]
        loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean() / p.steps
    if p.kl:
        with torch.no_grad():
            ref = guided(p, dit_call(p, dit, data, j, shrink=0.9)[0])
        loss = loss + 0.1 * ((v - ref) ** 2).mean()
    return loss


def rollout(p: Program, dit, data: dict) -> None:
    """The sampler's no-grad pass over every step (recorded by the rollout cache): the old log-probs."""
    with torch.no_grad():
        for j in range(p.steps):
            data["old"][j] = log_prob(p, data, j, guided(p, dit_call(p, dit, data, j)[0]))


# --- where the disruptions go ------------------------------------------------------------------
def positions(p: Program) -> list[tuple[Disruption, int, int | None]]:
    """Each disruption's (trajectory, loop position after whose backward it runs; None: before the
    trajectory's declaration, ``trajectories``: before close())."""
    out = []
    for k, d in enumerate(p.disruptions):
        rnd = random.Random(p.seed * 17 + k)
        visits = [traj_data(p, i)["visit"] for i in range(p.trajectories)]
        sig = sigmas(p)
        traj, pos = rnd.randrange(p.trajectories), None
        if d.placement == "first":
            traj, pos = rnd.choice(range(0, p.trajectories, p.accumulate)), 0
        elif d.placement == "after_exact":
            spots = [(i, q) for i in range(p.trajectories) for q, j in enumerate(visits[i][:-1]) if sig[j] < 0.5]
            traj, pos = rnd.choice(spots) if spots else (traj, rnd.randrange(len(visits[traj])))
        elif d.placement == "last":
            pos = len(visits[traj]) - 1
        elif d.placement == "between" and d.kind not in LOOP_KINDS:
            traj = rnd.randrange(1, p.trajectories + 1)
        else:
            pos = rnd.randrange(len(visits[traj]))
        if d.kind == "fewer" and pos is not None:
            pos = min(pos, len(visits[traj]) - 2)
        out.append((d, traj, pos))
    return out


def do_backward(loss, form, scaler, params, side):
    loss = scaler.scale(loss) if scaler is not None else loss
    if form == "plain":
        loss.backward()
    elif form == "backward_inputs":
        loss.backward(inputs=params)
    else:
        for s, g in zip(side, torch.autograd.grad(loss, params)):
            s.add_(g)


# --- one program ------------------------------------------------------------------------------------
def disrupt(kind: str, model, opt, drv, log) -> None:
    params = trainable(model)
    if kind in ("zero_grad_none", "zero_grad_zero", "opt_zero_grad"):
        drv.event("zero_grad")
        if kind == "opt_zero_grad":
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=kind == "zero_grad_none")
    elif kind == "clip":
        drv.event("clip")
        torch.nn.utils.clip_grad_norm_(params, 1e-6)
    elif kind == "scale_grad":
        drv.event("grad write")
        for q in params:
            if q.grad is not None:
                q.grad.mul_(0.5)
    elif kind == "opt_step":
        optimizer_step(lambda: opt.step(), model, drv, log)
    elif kind == "param_write":
        try:
            drv.event("parameter write")
        finally:               # the reference's refusal comes after the write, as jaggc's at the next step
            with torch.no_grad():
                params[0].mul_(1.01)
        log.setdefault("moved_at", len(log["values"]))


def optimizer_step(fn, model, drv, log) -> None:
    drv.event("optimizer step")
    before = [q.detach().clone() for q in model.parameters()]
    try:
        fn()
    except jaggc.JaggError:
        log["moved_by_refused_step"] = not all(torch.equal(a, q) for a, q in zip(before, model.parameters()))
        raise
    log.setdefault("moved_at", len(log["values"]))


def execute(p: Program, drv: Plain, model, log: dict) -> list:
    """Run ``p`` on ``model`` through ``drv``; ``log["values"]`` gets each step's loss; returns the
    side buffer of per-step ``torch.autograd.grad`` gradients."""
    params = trainable(model)
    opt = torch.optim.SGD(params, lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if p.scaler else None
    side = [torch.zeros_like(q) for q in params]
    plan = positions(p)
    values = log.setdefault("values", [])
    drv.install(model)
    for i in range(p.trajectories + 1):
        for d, traj, pos in plan:
            if traj == i and pos is None:
                disrupt(d.kind, model, opt, drv, log)
        if i == p.trajectories:
            break
        data = traj_data(p, i)
        if p.term == "ppo" or p.rollout_cache:
            rollout(p, model, data)
        visit = data["visit"]
        here = [(d, pos) for d, traj, pos in plan if traj == i and pos is not None]
        fewer = [pos for d, pos in here if d.kind == "fewer"]
        iterate = visit[:min(fewer) + 1] if fewer else visit
        rows = {j: torch.cat([data["times"][j]] * 2) if p.cfg else data["times"][j] for j in visit}
        declared_times = data["times"][visit].t().contiguous()      # (batch, steps)
        drv.declare(visit, declared_times, rows)
        raised = None
        try:
            for q, j in enumerate(drv.loop(iterate, declared_times)):
                out = drv.call(j, lambda j=j: dit_call(p, model, data, j))
                loss = step_loss(p, model, data, j, out)
                values.append(loss.detach())
                kinds = [d.kind for d, pos in here if pos == q]
                if "exception" in kinds:
                    raised = j
                    raise BodyError("a NaN loss")
                form = next((k for k in kinds if k in ("autograd_grad", "backward_inputs")), "plain")
                drv.backward(j, loss, form, scaler, params, side)
                stop = False
                for k in kinds:
                    if k == "break":
                        stop = True
                        break
                    disrupt(k, model, opt, drv, log)
                if stop:
                    break
        except BodyError:
            pass
        drv.loop_ended(raised)
        if (i + 1) % p.accumulate == 0 and i < p.trajectories - 1:
            if p.clip_at_sync:
                drv.event("clip")
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            if scaler is not None:
                optimizer_step(lambda: scaler.step(opt), model, drv, log)
                scaler.update()
            else:
                optimizer_step(lambda: opt.step(), model, drv, log)
            drv.event("zero_grad")
            opt.zero_grad()
    drv.close()
    return side


