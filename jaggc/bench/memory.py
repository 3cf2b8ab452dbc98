"""Peak RSS of one ``jaggc bench`` mode, measured in a fresh process (``jaggc bench --rss``).

In one long-lived process RSS says little about a single step: the allocator keeps what earlier
modes freed, and the next mode reuses it without the RSS moving. So each mode runs in its own
process: build the problem, run one warm-up step (for a compiled mode: the trace), free the
gradients, reset the kernel's RSS high-water mark (``/proc/self/clear_refs``), run the measured
step and read the high-water mark. ``MALLOC_MMAP_THRESHOLD_`` is fixed for the child so that glibc
returns large freed blocks to the OS instead of caching them (its default threshold grows after
the first large free, which would hide the next step's peak in reused heap).

``step_peak_mb`` = high-water mark during the measured step minus RSS just before it: the step's
own memory (activations, gradients, temporaries). The saved-tensor count in the main results is the
deterministic measure of activation memory; this one includes everything else the step allocates.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

_MMAP_THRESHOLD = "65536"
_TIMEOUT_S = 3600


def measure_rss(config, mode: str) -> dict:
    """Run ``mode`` of ``config`` in a fresh process and return its RSS numbers (MB)."""
    spec = dict(family=config.family, size=config.size, cfg=config.cfg, num_steps=config.num_steps, batch=config.batch,
                seed=config.seed, threads=config.threads, mode=mode)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD}
    proc = subprocess.run([sys.executable, "-m", "jaggc.bench.memory", json.dumps(spec)], capture_output=True,
                          text=True, env=env, timeout=_TIMEOUT_S)
    if proc.returncode != 0:
        return dict(error=proc.stderr.strip().splitlines()[-1:] or ["failed"], step_peak_mb=None)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024   # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # 5: reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _release_freed_memory() -> None:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _child(spec: dict) -> dict:
    import torch

    from .runner import parse_mode
    from .problems import build_problem

    if spec["threads"] is not None:
        torch.set_num_threads(spec["threads"])
    problem = build_problem(spec["family"], spec["size"], num_steps=spec["num_steps"], batch=spec["batch"],
                            seed=spec["seed"], cfg=spec.get("cfg", False))
    mode = parse_mode(spec["mode"])
    step = mode.strategy.build(problem, mode.window)
    setup_mb = _status_mb("VmRSS")

    def read():
        return {"wall": time.perf_counter()}

    step.run(read)   # warm-up: traces a compiled mode
    problem.model.zero_grad(set_to_none=True)
    _release_freed_memory()
    before_mb = _status_mb("VmRSS")
    reset = _reset_high_water_mark()
    step.run(read)
    peak_mb = _status_mb("VmHWM")
    return dict(setup_mb=setup_mb, before_mb=before_mb, peak_mb=peak_mb, step_peak_mb=peak_mb - before_mb,
                high_water_mark_reset=reset)


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
