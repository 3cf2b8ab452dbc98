"""``jaggc bench`` on a device and dtype: the device check, the CUDA clock and memory meter (on a
stand-in CUDA module that records what they call, so they are tested without a GPU), the published
model configs (built on the meta device: no memory, no download), a bf16 run on the CPU, and a
mode that runs out of memory reported as such.

No timing assertion: the clocks are driven by the stand-in, the bench by the cost-model clock.
"""

from __future__ import annotations

import pytest
import torch

from jaggc import cli
from jaggc_studies.bench import BenchConfig, run_bench
from jaggc_studies.bench.device import (CudaEventClock, CudaPeakMemory, DeviceUnavailable, SyncedClock, resolve_device,
                                        resolve_dtype)
from jaggc_studies.bench.model_configs import PUBLISHED, depth_cut, latent_side, model_class
from jaggc_studies.bench.problems import build_problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_fails_with_one_line(capsys):
    rc = cli.main(["bench", "--device", "cuda", "--modes", "exact,jagg@4", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "--device cpu" in err and "CUDA" in err and "Traceback" not in err


class FakeCuda:
    """A stand-in for ``torch.cuda``: a GPU clock that advances only when told, and an allocator."""

    def __init__(self, available=True):
        self.available, self.gpu_ms, self.calls = available, 0.0, []
        self.allocated = self.peak = 0

    def is_available(self):
        return self.available

    def device_count(self):
        return 1

    def current_stream(self, device):
        return "stream"

    def synchronize(self, device=None):
        self.calls.append("synchronize")

    def Event(self, enable_timing=False):
        assert enable_timing
        cuda = self

        class Event:
            def record(self, stream):
                cuda.calls.append("record")
                self.ms = cuda.gpu_ms

            def synchronize(self):
                cuda.calls.append("event.synchronize")

            def elapsed_time(self, end):
                return end.ms - self.ms

        return Event()

    def reset_peak_memory_stats(self, device):
        self.calls.append("reset")
        self.peak = self.allocated

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak


def test_resolve_device_refuses_missing_cuda():
    with pytest.raises(DeviceUnavailable, match="--device cpu"):
        resolve_device("cuda", cuda=FakeCuda(available=False))
    assert resolve_device("cuda", cuda=FakeCuda()).type == "cuda"
    with pytest.raises(DeviceUnavailable, match="cuda:0..cuda:0"):
        resolve_device("cuda:3", cuda=FakeCuda())
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_dtype("bf16")


def test_cuda_event_clock_reads_gpu_seconds_at_a_synchronised_boundary():
    cuda = FakeCuda()
    clock = CudaEventClock("cuda", cuda=cuda)
    cuda.gpu_ms = 1500.0
    assert clock() == pytest.approx(1.5)                    # milliseconds -> seconds since the first event
    assert cuda.calls[-2:] == ["record", "event.synchronize"]
    cuda.gpu_ms = 1750.0
    assert clock() == pytest.approx(1.75)


def test_synced_clock_waits_for_the_device_before_reading():
    cuda, reads = FakeCuda(), []
    clock = SyncedClock("cuda", clock=lambda: reads.append(list(cuda.calls)) or 7.0, cuda=cuda)
    assert clock() == 7.0 and reads == [["synchronize"]]


def test_cuda_peak_memory_is_reset_per_step():
    cuda = FakeCuda()
    cuda.allocated = cuda.peak = 100
    meter = CudaPeakMemory("cuda", cuda=cuda)
    with meter:
        assert cuda.calls[-1] == "reset"
        cuda.peak = 350          # the step's high-water mark
    assert meter.peak_bytes == 350 and meter.step_bytes == 250
    cuda.peak = 999              # an earlier, larger peak must not leak into the next step
    with meter:
        cuda.peak = max(cuda.peak, 120)
    assert meter.peak_bytes == 120 and meter.step_bytes == 20


# ---------------------------------------------------------------------------------------------
# the published configs


def _meta_params(name: str, layers=None) -> int:
    with torch.device("meta"):
        model = model_class(PUBLISHED[name].family)(**depth_cut(name, layers))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, published_b", [("sd35-medium", 2.5), ("flux-dev", 12.0), ("qwen-image", 20.0)])
def test_published_configs_have_the_published_sizes(name, published_b):
    params = _meta_params(name)
    assert params / 1e9 == pytest.approx(PUBLISHED[name].params_b, rel=0.01)
    assert params / 1e9 == pytest.approx(published_b, rel=0.12)     # the model cards' rounded sizes


def test_depth_cut():
    flux = depth_cut("flux-dev", 4)
    assert (flux["num_layers"], flux["num_single_layers"]) == (4, 8)
    sd = depth_cut("sd35-medium", 2)
    assert sd["num_layers"] == 2 and sd["dual_attention_layers"] == (0, 1)
    assert depth_cut("sd35-medium", None)["dual_attention_layers"] == tuple(range(13))
    assert _meta_params("sd35-medium", 1) < _meta_params("sd35-medium", 2) < 0.2e9
    with pytest.raises(ValueError, match="1..24"):
        depth_cut("sd35-medium", 25)
    assert (latent_side(512), latent_side(1024)) == (64, 128)
    with pytest.raises(ValueError, match="multiple of 16"):
        latent_side(500)


def test_published_problem_has_the_real_input_shapes():
    problem = build_problem(None, "sd35-medium", layers=1, resolution=32, num_steps=2, batch=2, dtype=torch.bfloat16)
    assert problem.family == "sd3" and problem.name == "sd35-medium-L1-32px"
    assert problem.model.config.num_layers == 1 and problem.model.config.caption_projection_dim == 1536
    assert problem.batch["latents"].shape == (2, 2, 16, 4, 4) and problem.batch["latents"].dtype == torch.bfloat16
    assert problem.batch["prompt_embeds"].shape == (2, 333, 4096)
    assert problem.batch["log_probs"].dtype == torch.float32
    with pytest.raises(ValueError, match="published sizes"):
        build_problem("sd3", "tiny", layers=2)


# ---------------------------------------------------------------------------------------------
# runs


def test_bf16_cpu_run_records_device_dtype_and_memory():
    config = BenchConfig(size="tiny", num_steps=8, batch=2, dtype="bfloat16", modes=("exact", "jagg@4"), repeats=1,
                         clocks=("passes",), compile_steps=(), recompile_iterations=0)
    out = run_bench(config)
    assert out["device"] == "cpu" and out["dtype"] == "bfloat16" and out["device_name"]
    assert out["peak_memory_kind"].startswith("autograd-saved tensors")
    for mode in out["modes"].values():
        assert mode["peak_memory_bytes"] == mode["activation_peak_bytes"] > 0
    # the pass clock: the bf16 run did the cost model's work
    assert out["modes"]["exact"]["whole"]["passes"] == [3 * 8]
    assert out["modes"]["jagg@4"]["whole"]["passes"] == [8 + 4 * 2]


def test_a_mode_that_runs_out_of_memory_is_reported(monkeypatch):
    from jaggc_studies.bench import strategies

    class OutOfMemory:
        def run(self, read):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    oom = strategies.Strategy("oom", lambda p, w: OutOfMemory(), strategies.exact_cost, False, "always OOM")
    monkeypatch.setitem(strategies.STRATEGIES, "oom", oom)
    out = run_bench(BenchConfig(size="tiny", num_steps=4, batch=2, modes=("exact", "oom"), repeats=1,
                                clocks=("passes",), compile_steps=(), recompile_iterations=0))
    assert set(out["modes"]) == {"exact"}
    assert out["failed_modes"] == {"oom": "out of memory: CUDA out of memory. Tried to allocate 80.00 GiB"}


def test_suite_and_size_usage_errors(capsys):
    for argv, expected in ((["bench", "--suite", "gpu", "--size", "10m"], "full, small"),
                           (["bench", "--size", "huge"], "sd35-medium"),
                           (["bench", "--size", "tiny", "--layers", "2"], "published sizes"),
                           (["bench", "--suite", "gpu", "--modes", "exact"], "drop --modes")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        assert expected in capsys.readouterr().err
