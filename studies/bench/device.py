"""Where ``jaggc bench`` runs: the device and dtype it is asked for, the clocks and the memory meter
that are right there, and the facts about the machine its JSON records.

On CUDA, work is queued: a host clock read after ``loss.backward()`` returns measures the launch,
not the kernels. So every CUDA clock read is a synchronisation point:
  * ``cuda`` (``CudaEventClock``): a CUDA event recorded on the current stream and waited for; the
    reading is the GPU time elapsed since the clock's first event (``Event.elapsed_time``), i.e.
    the kernels' time between two boundaries;
  * ``wall`` on CUDA (``SyncedClock``): ``torch.cuda.synchronize()`` then ``time.perf_counter()``.
A per-step loop is read twice per step (around each backward); a sync there costs the launch
latency of the next kernel (microseconds at these sizes).

Peak memory per step on CUDA (``CudaPeakMemory``): ``torch.cuda.reset_peak_memory_stats()`` before
the step, ``max_memory_allocated()`` after it: the absolute peak (what a user must have, weights and
optimizer-free gradients included) and the step's own share above what was allocated before it. The
CPU has no allocator peak; there the peak-memory field is the autograd-saved tensors' peak
(``jaggc.runtime.memory``), which the JSON names as such.

The CUDA module is injectable (``cuda=``) so that the clock and the meter are tested on a CPU with
a stand-in that records what they call.
"""

from __future__ import annotations

import platform
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda")


class DeviceUnavailable(RuntimeError):
    """The asked-for device is not there; the message is one line naming the fix."""


def resolve_device(name: str, *, cuda=torch.cuda) -> torch.device:
    """``name`` ("cpu", "cuda", "cuda:1") as a torch device, or ``DeviceUnavailable``."""
    device = torch.device(name)
    if device.type not in DEVICES:
        raise DeviceUnavailable(f"--device {name}: use one of {', '.join(DEVICES)}")
    if device.type == "cuda":
        if not cuda.is_available():
            if torch.version.cuda is None:
                raise DeviceUnavailable(
                    f"--device {name}: torch {torch.__version__} is a CPU-only build and sees no GPU; install a CUDA "
                    f"build of torch on a machine with an NVIDIA GPU, or use --device cpu")
            raise DeviceUnavailable(
                f"--device {name}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; check "
                f"the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or use --device cpu")
        if device.index is not None and device.index >= cuda.device_count():
            raise DeviceUnavailable(f"--device {name}: only {cuda.device_count()} CUDA device(s) visible; "
                                    f"use cuda:0..cuda:{cuda.device_count() - 1}")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype {name}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# clocks (a clock is a zero-argument callable returning seconds)


class CudaEventClock:
    """GPU time in seconds since the clock was made, read at a synchronised boundary."""

    def __init__(self, device, *, cuda=torch.cuda):
        self.cuda, self.device = cuda, torch.device(device)
        self._start = self._record()

    def _record(self):
        event = self.cuda.Event(enable_timing=True)
        event.record(self.cuda.current_stream(self.device))
        return event

    def __call__(self) -> float:
        event = self._record()
        event.synchronize()
        return self._start.elapsed_time(event) / 1e3    # elapsed_time is in milliseconds


class SyncedClock:
    """A host clock read after the device has finished its queued work."""

    def __init__(self, device, clock=time.perf_counter, *, cuda=torch.cuda):
        self.cuda, self.device, self.clock = cuda, torch.device(device), clock

    def __call__(self) -> float:
        self.cuda.synchronize(self.device)
        return self.clock()


def wall_clock(problem):
    return time.perf_counter if problem.device.type == "cpu" else SyncedClock(problem.device)


def cuda_clock(problem):
    if problem.device.type != "cuda":
        raise ValueError("clock 'cuda' (CUDA events) needs --device cuda; on the CPU use 'cpu' or 'wall'")
    return CudaEventClock(problem.device)


def cpu_clock(problem):
    if problem.device.type != "cpu":
        # process CPU time of the host says nothing about queued GPU kernels
        raise ValueError("clock 'cpu' (process CPU time) measures the host only; on CUDA use 'cuda' or 'wall'")
    return time.process_time


def default_clocks(device: torch.device) -> tuple[str, ...]:
    """The first is the one speedups are reported in."""
    return ("cpu", "wall") if device.type == "cpu" else ("cuda", "wall")


# ---------------------------------------------------------------------------------------------
# peak memory of one step


class CudaPeakMemory:
    """``with meter: step()`` then ``meter.peak_bytes`` (absolute) and ``meter.step_bytes`` (above
    what was allocated when the step began)."""

    kind = "cuda max_memory_allocated"

    def __init__(self, device, *, cuda=torch.cuda):
        self.cuda, self.device = cuda, torch.device(device)
        self.peak_bytes = self.step_bytes = None

    def __enter__(self):
        self.cuda.synchronize(self.device)
        self.cuda.reset_peak_memory_stats(self.device)
        self._before = self.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        self.cuda.synchronize(self.device)
        self.peak_bytes = self.cuda.max_memory_allocated(self.device)
        self.step_bytes = self.peak_bytes - self._before
        return False


SAVED_TENSORS_KIND = "autograd-saved tensors (the CPU has no allocator peak)"


# ---------------------------------------------------------------------------------------------
# the machine


def device_facts(device: torch.device, dtype: torch.dtype, *, cuda=torch.cuda) -> dict:
    """What the JSON records about where it ran."""
    facts = dict(device=device.type, dtype=dtype_name(dtype), torch_version=torch.__version__,
                 cuda_version=torch.version.cuda, machine=platform.machine())
    if device.type == "cuda":
        index = device.index if device.index is not None else cuda.current_device()
        props = cuda.get_device_properties(index)
        facts.update(device_name=cuda.get_device_name(index), device_memory_bytes=props.total_memory,
                     cudnn_version=torch.backends.cudnn.version(), device_index=index)
    else:
        facts.update(device_name=_cpu_name())
    return facts


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
