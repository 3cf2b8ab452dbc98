"""The process ``memory.measure_rss`` starts: ``python -m jaggc_studies.bench.rss_child '<json spec>'``.

Build the problem, run one warm-up step (for a compiled mode: the trace), free the gradients,
reset the kernel's RSS high-water mark (``/proc/self/clear_refs``), run the measured step and read
the high-water mark; print the numbers (MB) as one JSON line on stdout.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch

from jaggc_studies.bench.device import DTYPES
from jaggc_studies.bench.problems import build_problem
from jaggc_studies.bench.strategies import parse_mode


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


def measure_step(spec: dict) -> dict:
    """RSS (MB) after setup, just before the measured step, and its high-water mark."""
    if spec["threads"] is not None:
        torch.set_num_threads(spec["threads"])
    problem = build_problem(spec["family"], spec["size"], num_steps=spec["num_steps"], batch=spec["batch"],
                            seed=spec["seed"], cfg=spec.get("cfg", False), dtype=DTYPES[spec.get("dtype", "float32")],
                            layers=spec.get("layers"), resolution=spec.get("resolution"))
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
    print(json.dumps(measure_step(json.loads(sys.argv[1]))))
