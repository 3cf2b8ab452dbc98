"""The example LoRA trainer runs end to end (one process, 2 iterations) and logs what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lora_grpo_trainer_runs_and_saves_backwards():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "lora_grpo_trainer.py"), "--iterations", "2",
                          "--cos-every", "1"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"DiT backwards (\d+) \(exact loop: (\d+)\) cos\(jagg,exact\)=([-\d.]+)", out.stdout)
    assert len(rows) == 2, out.stdout
    for jagg, exact, cos in rows:
        assert int(jagg) * 4 == int(exact)          # 8 steps, W=4: 2 joint backwards per loss instead of 8
        assert float(cos) > 0.9
    assert "capture path: fx" in out.stdout
