"""Gradient accumulation with 🤗 accelerate and with plain DDP ``no_sync``, 2 processes, gloo, CPU.

A trainer accumulates the Flow-GRPO loss over K micro-batches per optimizer step, written the
accelerate way::

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    model, optimizer = accelerator.prepare(model, optimizer)      # DDP on 2 gloo ranks
    for batch in micro_batches:
        with accelerator.accumulate(model):
            loss = grpo_loss(model, batch)                          # exact, or @jagg_compile-d
            accelerator.backward(loss)
            optimizer.step(); optimizer.zero_grad()

and the plain-DDP way (``with ddp.no_sync()`` on all but every K-th micro-batch, ``loss / K``,
``optimizer.step()`` every K). For the exact loss and the ``@jagg_compile``-d loss (joint and
per-window and low-memory backward modes) the test records, per micro-step, the number of gradient all-reduces
(a counting DDP comm hook: one call per gradient bucket) and whether the optimizer really stepped
(a counter on the wrapped torch optimizer), and at the end the parameters. Checked:

  * JAGG syncs exactly where the exact loop syncs: no all-reduce inside ``no_sync`` micro-steps,
    the same number of bucket all-reduces on every K-th one (per-window mode included: its
    windows' nested backwards all-reduce once per loss; low-memory mode too: its windows'
    backwards inside the forward are no_sync'd, and the loss's backward all-reduces once);
  * the optimizer steps at the same micro-steps (K-1, 2K-1, ...);
  * the final parameters equal those of a single-process run of the same loss (exact or JAGG)
    over the union of both ranks' micro-batches with the same optimizer (fp32 tolerance), and
    are identical on both ranks.

Micro-batch i of rank r is samples [4i + 2r, 4i + 2r + 2) of one 16-sample Flow-GRPO rollout, so
the single-process micro-batch i is samples [4i, 4i + 4): DDP's average of the per-rank mean
losses is the mean over the 4 samples.
"""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch

import jaggc
from jaggc_studies import example_losses as el

from ranks import run_ranks


WORLD = 2
LOCAL_B = 2
MICRO = 4                       # micro-batches
K = 2                           # gradient accumulation steps: optimizer steps after micro-steps 1, 3
T = 6                           # trained steps: two JAGG windows of W=3
W = 3
LR = 0.05
TIMEOUT_S = 300
SCENARIOS = ("acc_exact", "acc_jagg", "acc_jagg_per_window", "acc_jagg_lowmem", "ddp_exact", "ddp_jagg",
             "ddp_jagg_lowmem")


def fresh(fn):
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def rollout():
    return el.build_example("flow_grpo_sd3", num_steps=T, batch=WORLD * LOCAL_B * MICRO, seed=0)


def micro_batch(batch: dict, i: int, lo: int, size: int) -> dict:
    n = WORLD * LOCAL_B * MICRO
    sl = slice(i * WORLD * LOCAL_B + lo, i * WORLD * LOCAL_B + lo + size)
    return {k: (v[sl].contiguous() if v.ndim >= 1 and v.shape[0] == n else v) for k, v in batch.items()}


def loss_fn(kind: str):
    if kind == "exact":
        return el.flow_grpo_sd3_loss
    mode = "per_window" if kind.endswith("per_window") else "lowmem" if kind.endswith("lowmem") else "joint"
    return jaggc.jagg_compile(fresh(el.flow_grpo_sd3_loss), window=W, backward=mode)


def optimizer_for(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


class StepCounter:
    """Wraps a torch optimizer's ``step`` to record the micro-steps at which it really ran."""

    def __init__(self, optimizer):
        self.steps: list[int] = []
        self.micro = -1
        inner = optimizer.step

        def step(*a, **k):
            self.steps.append(self.micro)
            return inner(*a, **k)

        optimizer.step = step


def counting_hook(counts: list):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        counts[-1] += 1
        return allreduce_hook(None, bucket)

    return hook


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- rank process


def run_rank(rank: int, world: int) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    assert accelerator.num_processes == world and accelerator.distributed_type.name == "MULTI_CPU"

    ex = rollout()
    base = ex.model
    batches = [micro_batch(ex.batch, i, rank * LOCAL_B, LOCAL_B) for i in range(MICRO)]
    results: dict = {}
    for name in SCENARIOS:
        kind = name.split("_", 1)[1]
        fn = loss_fn(kind)
        model = copy.deepcopy(base)
        counts: list[int] = []
        syncs: list[bool] = []
        if name.startswith("acc"):
            model, opt = accelerator.prepare(model, optimizer_for(model))
            counter = StepCounter(opt.optimizer)
            model.register_comm_hook(None, counting_hook(counts))
            for i, mb in enumerate(batches):
                counter.micro = i
                counts.append(0)
                with accelerator.accumulate(model):
                    loss = fn(model, mb)
                    accelerator.backward(loss)
                    syncs.append(accelerator.sync_gradients)
                    opt.step()
                    opt.zero_grad()
            inner = accelerator.unwrap_model(model)
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = optimizer_for(model)
            counter = StepCounter(opt)
            ddp.register_comm_hook(None, counting_hook(counts))
            for i, mb in enumerate(batches):
                counter.micro = i
                counts.append(0)
                sync = (i + 1) % K == 0
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    (fn(ddp, mb) / K).backward()
                syncs.append(sync)
                if sync:
                    opt.step()
                    opt.zero_grad()
            inner = model
        results[name] = dict(allreduces=counts, syncs=syncs, steps=counter.steps, params=params_of(inner),
                             path=getattr(getattr(fn, "report", None), "path", "uncompiled"))
    return results


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    pytest.importorskip("accelerate")
    rollout()  # warm the lazy imports before forking
    return run_ranks(run_rank, WORLD, tmp_path_factory, name="accelerate", timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def single_process():
    """The same training on one process: micro-batch i = both ranks' samples, loss / K."""
    ex = rollout()
    batches = [micro_batch(ex.batch, i, 0, WORLD * LOCAL_B) for i in range(MICRO)]
    out = {}
    for kind in ("exact", "jagg", "jagg_per_window", "jagg_lowmem"):
        fn = loss_fn(kind)
        model = copy.deepcopy(ex.model)
        opt = optimizer_for(model)
        for i, mb in enumerate(batches):
            (fn(model, mb) / K).backward()
            if (i + 1) % K == 0:
                opt.step()
                opt.zero_grad()
        out[kind] = params_of(model)
    out["initial"] = params_of(ex.model)
    return out


def _flat(d):
    return torch.cat([v.reshape(-1).double() for _, v in sorted(d.items())])


@pytest.mark.parametrize("name", SCENARIOS)
def test_sync_and_optimizer_steps_where_the_exact_loop_has_them(rank_results, name):
    exact = "acc_exact" if name.startswith("acc") else "ddp_exact"
    sync_steps = [i for i in range(MICRO) if (i + 1) % K == 0]
    for res in rank_results:
        r, e = res[name], res[exact]
        assert r["syncs"] == [(i + 1) % K == 0 for i in range(MICRO)]
        assert r["steps"] == e["steps"] == sync_steps
        assert r["allreduces"] == e["allreduces"], (name, r["allreduces"], e["allreduces"])
        assert all((n > 0) == s for n, s in zip(r["allreduces"], r["syncs"])), r["allreduces"]
        if name != exact:
            assert r["path"] == "fx"     # capture="auto" takes FX first


@pytest.mark.parametrize("name", SCENARIOS)
def test_final_parameters_equal_single_process(rank_results, single_process, name):
    kind = name.split("_", 1)[1]
    want = single_process[kind]
    moved = float((_flat(want) - _flat(single_process["initial"])).norm())
    assert moved > 1e-3, "the optimizer did not move the parameters"
    for res in rank_results:
        got = res[name]["params"]
        err = float((_flat(got) - _flat(want)).norm())
        assert err < 1e-5 * moved + 1e-7, f"{name}: |Δ| = {err:.3g} vs update size {moved:.3g}"
    for n in want:   # DDP-synced gradients give the same update on both ranks, bit for bit
        assert torch.equal(rank_results[0][name]["params"][n], rank_results[1][name]["params"][n]), n


def test_jagg_differs_from_exact(rank_results, single_process):
    """JAGG is an approximation: the compiled runs must not silently be the exact loop."""
    d = float((_flat(single_process["jagg"]) - _flat(single_process["exact"])).norm())
    assert d > 0
