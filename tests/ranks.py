"""Multi-rank tests (DDP, FSDP2, accelerate): the harness, and the inputs the DDP and FSDP tests share.

``run_ranks(body, world, ...)`` forks ``world`` processes from the test process (torch and
diffusers are imported already: a cold ``import diffusers`` costs 10-20 s per process on a 2-core
machine). Each rank sets one intra-op thread and the torch.distributed environment variables
(accelerate reads them), joins a gloo process group on 127.0.0.1, runs ``body(rank, world)`` and
saves what it returns as ``rank{r}.pt``; a rank that raises writes its traceback to ``rank{r}.err``
and exits 1. ``run_ranks`` returns the results in rank order, or fails the test with every rank's
traceback; it retries once when the free port it picked was taken in between.

The shared inputs: ``T`` DiT calls of the tiny SD3 on stored states of a global batch of
``GLOBAL_B`` samples (per-sample timesteps), each rank holding its contiguous share (``shard``),
and the linear loss whose average over ranks is the global-batch mean (``loss_of``).
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing
import os
import socket
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from jaggc import models
from jaggc.runtime import DitCall

from helpers import rel_err

GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_process(body: Callable[[int, int], Any], rank: int, world: int, port: int, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=GROUP_TIMEOUT)
        try:
            results = body(rank, world)
            dist.barrier()   # no rank tears the group down while another still talks to it
            torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


def run_ranks(body: Callable[[int, int], Any], world: int, tmp_path_factory, *, name: str, timeout_s: float) -> list:
    """``body(rank, world)`` on ``world`` forked ranks in one gloo group; what each returned, in rank order."""
    if "fork" not in multiprocessing.get_all_start_methods() or not dist.is_available():
        pytest.skip("needs the fork start method and torch.distributed")
    ctx = multiprocessing.get_context("fork")
    errors = ""
    for _attempt in range(2):  # a second try only if the free port was taken in between
        out = tmp_path_factory.mktemp(name)
        port = free_port()
        target = functools.partial(_rank_process, body)
        procs = [ctx.Process(target=target, args=(r, world, port, str(out))) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if hung:
            pytest.fail(f"{name} ranks did not finish within {timeout_s}s")
        if all(p.exitcode == 0 for p in procs):
            return [torch.load(out / f"rank{r}.pt") for r in range(world)]
        errors = "\n".join(f"--- rank {r} (exit code {p.exitcode}):\n"
                           + ((out / f"rank{r}.err").read_text() if (out / f"rank{r}.err").exists() else "")
                           for r, p in enumerate(procs))
        if "address already in use" not in errors.lower():
            break
    pytest.fail(f"{name} ranks failed:\n{errors}")


# --------------------------------------------------------------------------- shared inputs (DDP, FSDP)

GLOBAL_B = 4
T = 7  # steps 0..3 are a W=4 window, 4..6 a W=3 window
START = 3
OFFSETS = (0, 1, 0, 2)  # per-sample schedule offset: per-sample timesteps, hence per-sample α


def _sigmas() -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(16)
    return sched.sigmas.to(torch.float32)


def global_inputs(model):
    """T DiT calls on stored states of the full global batch, and the upstream signals g_k."""
    sigmas = _sigmas()
    cond = models.sd3_conditioning(model, GLOBAL_B, seed=1).kwargs
    shape = models.sd3_latent_shape(model, GLOBAL_B)
    g = torch.Generator().manual_seed(2)
    calls = []
    for k in range(T):
        t = torch.stack([sigmas[START + off + k] for off in OFFSETS]) * 1000.0
        calls.append(DitCall((), dict(hidden_states=torch.randn(shape, generator=g), timestep=t,
                                      return_dict=False, **cond)))
    gs = [torch.randn(shape, generator=g) for _ in range(T)]
    return calls, gs


def shard(calls, gs, rank: int, world: int):
    """The rank's contiguous share of every batched input (conditioning included)."""
    per = GLOBAL_B // world
    sl = slice(rank * per, (rank + 1) * per)

    def cut(v):
        return v[sl] if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == GLOBAL_B else v

    return ([DitCall(c.args, {k: cut(v) for k, v in c.kwargs.items()}) for c in calls],
            [g[sl] for g in gs])


def loss_of(outs, gs, world: int) -> torch.Tensor:
    """world/GLOBAL_B * Σ <v_k, g_k>: the average over ranks (DDP's, FSDP's) is the global-batch mean."""
    return sum((o[0] * g).sum() for o, g in zip(outs, gs)) * (world / GLOBAL_B)


def window_slices() -> dict[str, slice]:
    return {"w4": slice(0, 4), "w3": slice(4, 7)}


def assert_grads_match(got: dict, want: dict, tol: float = 1e-5):
    """Gradients by parameter name: close as a whole (relative error) and parameter by parameter."""
    assert rel_err(got, want) < tol, f"relative error {rel_err(got, want):.3g}"
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=tol, atol=tol * float(want[n].abs().max()) + 1e-12,
                                   msg=n)
