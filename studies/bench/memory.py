"""Peak RSS of one ``jaggc bench`` mode, measured in a fresh process (``jaggc bench --rss``).

In one long-lived process RSS says little about a single step: the allocator keeps what earlier
modes freed, and the next mode reuses it without the RSS moving. So each mode runs in its own
process (``python -m jaggc_studies.bench.rss_child``, see there for what it measures).
``MALLOC_MMAP_THRESHOLD_`` is fixed for the child so that glibc returns large freed blocks to the
OS instead of caching them (its default threshold grows after the first large free, which would
hide the next step's peak in reused heap).

``step_peak_mb`` = high-water mark during the measured step minus RSS just before it: the step's
own memory (activations, gradients, temporaries). The saved-tensor count in the main results is the
deterministic measure of activation memory; this one includes everything else the step allocates.

The child is its own module, imported by nobody: ``python -m`` on a module that the package's
``__init__`` already imported would run it twice (runpy warns about exactly that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD_MODULE = "jaggc_studies.bench.rss_child"
_MMAP_THRESHOLD = "65536"
_TIMEOUT_S = 3600


def measure_rss(config, mode: str) -> dict:
    """Run ``mode`` of ``config`` in a fresh process and return its RSS numbers (MB)."""
    spec = dict(family=config.family, size=config.size, cfg=config.cfg, num_steps=config.num_steps, batch=config.batch,
                dtype=config.dtype, layers=config.layers, resolution=config.resolution,
                seed=config.seed, threads=config.threads, mode=mode)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD}
    proc = subprocess.run([sys.executable, "-m", CHILD_MODULE, json.dumps(spec)], capture_output=True,
                          text=True, env=env, timeout=_TIMEOUT_S)
    if proc.returncode != 0:
        return dict(error=proc.stderr.strip().splitlines()[-1:] or ["failed"], step_peak_mb=None)
    return json.loads(proc.stdout.strip().splitlines()[-1])
