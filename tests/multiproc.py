"""Run a test's rank function on WORLD forked processes (gloo on 127.0.0.1) and collect results.

Each rank function ``body(rank, world, port, out_dir)`` saves ``rank{r}.pt`` into ``out_dir``; a
rank that raises writes its traceback to ``rank{r}.err`` and exits 1. ``run_ranks`` returns the
loaded results in rank order, or fails the test with every rank's traceback; it retries once when
the free port it picked was taken in between.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _guarded(body: Callable, rank: int, world: int, port: int, out_dir: str) -> None:
    try:
        body(rank, world, port, out_dir)
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


def run_ranks(body: Callable, world: int, tmp_path_factory, *, name: str, timeout_s: float) -> list:
    if "fork" not in multiprocessing.get_all_start_methods() or not dist.is_available():
        pytest.skip("needs the fork start method and torch.distributed")
    ctx = multiprocessing.get_context("fork")
    errors = ""
    for _attempt in range(2):  # a second try only if the free port was taken in between
        out = tmp_path_factory.mktemp(name)
        port = free_port()
        target = functools.partial(_guarded, body)
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
