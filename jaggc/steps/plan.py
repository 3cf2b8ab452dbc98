"""A declared trajectory: its steps in σ order, cut into windows, and which declared step a DiT call is.

The trainers call the DiT once per step and ``backward()`` after each step, in their own order
(Flow-GRPO and MixGRPO in sampler order, DanceGRPO in a random permutation of a random subset).
Before the first step of a trajectory the user declares the timesteps of the steps it will train
(``Stepwise.trajectory``). From them the plan forms the windows the whole-loss path forms for the
same steps: sorted by noise level, high to low (the sampler's order), cut into consecutive windows
of ``window`` steps by ``runtime.window.partition`` (a shorter tail is a window of its own), each
window's knots and its exactness from the basis (``Basis.knot_positions``, ``Basis.runs_exact``:
σ-aware placement runs a window that reaches σ < ``exact_below`` exactly; a window of <= 2 steps
is all knots, so exact).

A DiT call is matched to a declared step by its timestep: per sample, the call's timestep equals
the declared one (within float32 roundoff), in the units the user declared or, if those differ by
the 0..1000 vs 0..1 convention (DanceGRPO stores ``int(σ * 1000)`` and calls the DiT with
``timesteps / 1000``), in noise levels σ. A call whose batch is a multiple of the declared batch
(classifier-free guidance on ``[uncond; cond]``) matches the declaration tiled.

A loop that casts the timestep to its latents' dtype before the call (Flow-Factory's SD3.5 adapter:
``t.expand(B).to(latents.dtype)`` with bf16 or fp16 latents) calls the DiT at the declared timestep
rounded to that dtype (964.29 → 964.0 in bf16), 2.5e-4 and more away from it. Such a call is
recognised as a cast, not by a wider tolerance: a call whose timestep is a bf16 or fp16 tensor
matches the declared step whose value, rounded to that dtype, it equals exactly, when exactly one
declared step rounds to it. Two declared steps that round to the same value are the same call to
the DiT; jaggc cannot tell which step it makes and refuses (``JaggInputError``).

Reading a call's timestep on the host stops the CPU until the GPU has caught up (the next step's
kernels cannot be queued meanwhile), so the host match (``match``) is the last resort:

* ``match_view``: a call whose timestep is a view of the declared tensor (Flow-GRPO without CFG
  declares ``sample["timesteps"]`` and calls with ``sample["timesteps"][:, j]``) is step ``j`` by its
  place in the declared tensor's memory (same root tensor, offset, stride, dtype; the memory not
  written since the declaration): no value is read;
* ``expect``: a device flag that says whether ``match`` would give an expected step (run.py
  predicts the next step in σ order for a loop that visits them so); the run reads these flags
  together, once per window, and re-reads the calls on the host if one is false.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from .._compat import version_counter
from ..errors import JaggInputError
from ..runtime.calls import DitCall, get_time, per_sample_time, resolve_time_arg
from ..runtime.weights import Basis, noise_levels
from ..runtime.window import partition

# a call's timestep and a declared one are the same step when they agree to this relative
# tolerance (a float32 timestep of a float64 declaration, `long / 1000` against `σ`); distinct
# steps of any sampler schedule differ by far more (25 steps at shift 3: Δσ >= 1e-2 near σ = 1)
MATCH_RTOL = 1e-5

#: the dtypes a loop casts its timestep to (its latents'), whose rounding a call's timestep may carry
CAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PlannedWindow:
    """One window of the plan: declared step indices in σ order, knot positions within it, and
    whether it runs exactly (every step its own backward, as the unchanged loop runs it)."""

    index: int
    steps: tuple[int, ...]
    knots: tuple[int, ...]
    exact: bool
    reason: str = ""          # why it is exact ("σ < 0.5", "2 steps"), for reports and warnings

    def role(self, step: int) -> str:
        if self.exact:
            return "exact"
        return "knot" if self.steps.index(step) in self.knots else "interior"


def declared_times(timesteps, *, on_host: bool = True) -> torch.Tensor:
    """The declaration as a float64 (steps, batch) tensor; batch 1 when the steps are shared by
    the batch. Accepted: a sequence of numbers or a 1-d tensor (one timestep per step), or a 2-d
    tensor (batch, steps): the trainers' ``sample["timesteps"][:, trained]``."""
    if isinstance(timesteps, torch.Tensor):
        t = timesteps.detach()
        if t.ndim == 1:
            t = t[:, None]
        elif t.ndim == 2:
            t = t.t()
        else:
            raise JaggInputError(
                f"trajectory(timesteps=...) has shape {tuple(t.shape)}; pass one timestep per trained step, "
                f"shape (steps,) or (batch, steps) as the trainers store them (sample['timesteps'][:, steps])")
        # MPS has no float64: its declaration is read at once
        return t.to(device="cpu" if on_host or t.device.type == "mps" else t.device, dtype=torch.float64)
    if isinstance(timesteps, (list, tuple)) and all(isinstance(x, numbers.Number) for x in timesteps):
        return torch.tensor([[float(x)] for x in timesteps], dtype=torch.float64)
    raise JaggInputError(
        f"trajectory(timesteps=...) got a {type(timesteps).__name__}; pass the trained steps' timesteps as a "
        f"tensor of shape (steps,) or (batch, steps), or a list of numbers")


class TrajectoryPlan:
    """The windows of one declared trajectory and the rule that maps a DiT call to its step.

    A declaration on an accelerator is read on the host once, to plan the windows. With ``lazy`` the
    read waits until the plan is first needed; the run (run.py) folds it into the first call's
    rollout-cache lookup, whose read it then shares (``needs_read``, ``declared``, ``settle_times``):
    the cache's one read per call is then the trajectory's only one. Until then the declared values
    are unchecked; every attribute below reads them first."""

    def __init__(self, timesteps, *, window: int, basis: Basis, time_arg: str | int | None = None, guard=None,
                 lazy: bool = False):
        declared = declared_times(timesteps, on_host=False)      # (N, Bd) float64, where it lies
        self.source = _DeclaredMemory.of(timesteps)              # where the declaration lies (match_view)
        self._device_times: dict = {}                            # device -> (N, Bd) float64 copy (expect)
        if declared.device.type not in ("cpu", "mps"):
            self._device_times[declared.device] = declared
        self.time_arg = time_arg
        self.shape = tuple(declared.shape)
        if self.shape[0] == 0:
            raise JaggInputError("trajectory(timesteps=...) declares no step; declare the steps the loop trains")
        self._window, self._basis, self._guard = window, basis, guard
        self._declared = declared
        self._planned = False
        self._after_planned = None
        if not lazy or declared.device.type == "cpu":
            self.settle_times(declared.to("cpu"))

    @property
    def after_planned(self):
        return self._after_planned

    @after_planned.setter
    def after_planned(self, hook) -> None:
        """``hook()`` runs once the windows are planned (now, if they are)."""
        self._after_planned = hook
        if self._planned:
            hook()

    # --- the declaration's one host read ---------------------------------------------------------
    @property
    def needs_read(self) -> bool:
        return not self._planned

    @property
    def declared(self) -> torch.Tensor:
        """The declaration as it lies (float64, (steps, batch)), for a read that carries it."""
        return self._declared

    def settle_times(self, host_times: torch.Tensor) -> None:
        """Plan the windows from the declaration's values read on the host (module docstring)."""
        self.times = host_times.to(dtype=torch.float64)
        num_steps = self.shape[0]
        if not bool(torch.isfinite(self.times).all()):
            raise JaggInputError("trajectory(timesteps=...) holds NaN or Inf; declare each trained step's timestep")
        # σ order: high noise first, as the sampler visits them; every sample must agree on it
        order = sorted(range(num_steps), key=lambda k: -float(self.times[k].max()))
        ordered = self.times[order]
        if num_steps > 1:
            steps_down = ordered[1:] < ordered[:-1]
            if not bool(steps_down.all()):
                i = int(torch.nonzero(~steps_down.all(1))[0])
                a, b = order[i], order[i + 1]
                raise JaggInputError(
                    f"declared steps {a} and {b} have the same timestep, or samples disagree on their order "
                    f"({ordered[i].tolist()} vs {ordered[i + 1].tolist()}); declare each trained step once, with "
                    f"per-sample timesteps that follow one schedule")
        self._order = order
        self._in_sigma_order = order == list(range(num_steps))    # declared as the sampler visits them
        self._windows: list[PlannedWindow] = []
        self._window_of: dict[int, PlannedWindow] = {}
        basis, guard = self._basis, self._guard
        for w, positions in enumerate(partition(num_steps, self._window)):
            steps = tuple(order[p] for p in positions)
            win_times = self.times[list(steps)]
            if len(steps) <= 2:
                planned = PlannedWindow(w, steps, tuple(range(len(steps))), True, f"{len(steps)} step(s): all knots")
            elif basis.runs_exact(win_times):
                planned = PlannedWindow(w, steps, tuple(range(len(steps))), True,
                                        f"σ-aware placement: reaches σ < {basis.exact_below:g}")
            elif guard is not None and (guard.jagg_off or guard.runs_exact(win_times)):
                # the guard's policy (runtime/guard.py): its σ range drifted (adapt), or JAGG is off (exact)
                planned = PlannedWindow(w, steps, tuple(range(len(steps))), True,
                                        "guard: JAGG off (on_drift='exact')" if guard.jagg_off
                                        else "guard: its σ range drifted (on_drift='adapt')")
            else:
                planned = PlannedWindow(w, steps, basis.knot_positions(len(steps)), False)
            self._windows.append(planned)
            self._window_of.update((k, planned) for k in steps)
        self._planned = True
        if self._after_planned is not None:
            self._after_planned()

    def _read_declaration(self) -> None:
        if not self._planned:
            self.settle_times(self._declared.to("cpu"))

    # --- what the declaration plans ---------------------------------------------------------------
    def __getattr__(self, name: str):
        # times, order, in_sigma_order, windows, window_of: read on first use where the read waited
        if name in ("times", "_order", "_in_sigma_order", "_windows", "_window_of") and not self.__dict__.get("_planned", True):
            self._read_declaration()
            return getattr(self, name)
        raise AttributeError(name)

    @property
    def order(self) -> list[int]:
        return self._order

    @property
    def in_sigma_order(self) -> bool:
        return self._in_sigma_order

    @in_sigma_order.setter
    def in_sigma_order(self, value: bool) -> None:
        self._read_declaration()
        self._in_sigma_order = value

    @property
    def windows(self) -> list[PlannedWindow]:
        return self._windows

    @property
    def window_of(self) -> dict[int, PlannedWindow]:
        return self._window_of

    @property
    def batch(self) -> int:
        """The declared batch (1 when the steps are shared by the batch)."""
        return self.shape[1]

    def replace_window(self, planned: PlannedWindow) -> None:
        self.windows[planned.index] = planned
        for k in planned.steps:
            self.window_of[k] = planned

    def __len__(self) -> int:
        return self.shape[0]

    def match(self, call: DitCall) -> int | None:
        """The declared step ``call`` makes, or None if its timestep is none of the declared ones.
        A bf16/fp16 timestep that is the declared one rounded to its dtype matches it (a cast: module
        docstring); one that two declared steps round to is refused."""
        arg = resolve_time_arg(call, self.time_arg)
        observed = per_sample_time(call, arg).detach()
        t = observed.to(device="cpu", dtype=torch.float64)
        bd = self.times.shape[1]
        if t.shape[0] % bd:
            return None
        declared = self.times.repeat(1, t.shape[0] // bd)         # (N, Bc): CFG doubles the batch
        for candidates, value in ((declared, t), (noise_levels(declared), noise_levels(t))):
            close = (candidates - value).abs() <= MATCH_RTOL * candidates.abs().clamp_min(1e-3)
            hits = torch.nonzero(close.all(1)).flatten().tolist()
            if len(hits) == 1:
                return hits[0]
        if observed.dtype in CAST_DTYPES:
            return self._match_cast(declared, t, observed.dtype)
        return None

    def match_view(self, call: DitCall) -> int | None:
        """The declared step whose timestep ``call`` passes as a view of the declared tensor (module
        docstring), or None (no read: the tensor's place in memory, not its values)."""
        if self.source is None:
            return None
        t = get_time(call, resolve_time_arg(call, self.time_arg))
        return self.source.step_of(t) if isinstance(t, torch.Tensor) else None

    def expect(self, call: DitCall, step: int) -> torch.Tensor | None:
        """A 0-d bool tensor on the call's device, true iff ``match(call) == step``, computed there
        without a host read; None where only the host can tell (a bf16/fp16 timestep: a cast's match;
        a batch that is no multiple of the declared one; a device without float64)."""
        arg = resolve_time_arg(call, self.time_arg)
        observed = per_sample_time(call, arg).detach()
        bd = self.shape[1]
        if observed.dtype in CAST_DTYPES or observed.ndim != 1 or observed.shape[0] % bd \
                or observed.device.type == "mps":
            return None
        device = observed.device
        declared = self._device_times.get(device)
        if declared is None:
            declared = self._device_times[device] = self.times.to(device)
        declared = declared.repeat(1, observed.shape[0] // bd)
        t = observed.to(torch.float64)[None]
        found = None
        for candidates, value in ((declared, t), (noise_levels(declared), noise_levels(t))):
            hits = ((candidates - value).abs() <= MATCH_RTOL * candidates.abs().clamp_min(1e-3)).all(1)
            unique = hits.sum() == 1
            mine = unique & hits[step]
            # the host takes the first rule that has exactly one hit (match)
            found = mine if found is None else found | (~first_unique & mine)
            first_unique = unique
        return found

    def _match_cast(self, declared: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> int | None:
        """The declared step whose timestep, cast to ``dtype`` (in the declared units or as noise
        levels), is the call's exactly; None if none is; refused if several are."""
        for candidates, value in ((declared, t), (noise_levels(declared), noise_levels(t))):
            rounded = candidates.to(dtype).to(torch.float64)
            hits = torch.nonzero((rounded == value).all(1)).flatten().tolist()
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                values = ", ".join(f"{float(self.times[k].max()):.6g}" for k in hits)
                raise JaggInputError(
                    f"the DiT is called with a {str(dtype).replace('torch.', '')} timestep "
                    f"({float(value.max()):.6g}) that declared steps {hits} (timesteps {values}) all round to: the "
                    f"cast to {str(dtype).replace('torch.', '')} (t.to(latents.dtype)) makes them one call, so jaggc "
                    f"cannot tell which step it is. Call the DiT with a float32 timestep (cast it after the call "
                    f"reaches the module, or keep latents in float32), or declare and train steps whose timesteps "
                    f"stay distinct in {str(dtype).replace('torch.', '')}")
        return None

    def describe_call(self, call: DitCall) -> str:
        arg = resolve_time_arg(call, self.time_arg)
        t = per_sample_time(call, arg).detach().to(dtype=torch.float64).flatten().tolist()
        shown = t[0] if len(set(t)) == 1 else t[:4]
        return f"timestep {shown!r}"

    def describe_steps(self) -> str:
        values = [float(self.times[k].max()) for k in self.order]
        return ", ".join(f"{v:g}" for v in values[:8]) + (", ..." if len(values) > 8 else "")


class _DeclaredMemory:
    """Where a declared timesteps tensor lies: its root tensor (held: its memory cannot be reused),
    offset, strides, dtype and in-place version. A call's timestep that is one column of it (one
    element for a 1-d declaration, possibly expanded to the batch) is that step, while the memory
    is unwritten (the version counter, which views share, is unchanged)."""

    __slots__ = ("root", "offset", "shape", "stride", "dtype", "version")

    @classmethod
    def of(cls, timesteps) -> "_DeclaredMemory | None":
        if not isinstance(timesteps, torch.Tensor) or timesteps.ndim not in (1, 2) or timesteps.is_sparse:
            return None
        out = cls()
        t = timesteps.detach()
        out.root = timesteps._base if timesteps._base is not None else timesteps
        out.offset, out.shape, out.stride = t.storage_offset(), tuple(t.shape), tuple(t.stride())
        out.dtype, out.version = t.dtype, version_counter(timesteps)
        return out

    def step_of(self, t: torch.Tensor) -> int | None:
        root = t._base if t._base is not None else t
        if root is not self.root or t.dtype != self.dtype or version_counter(t) != self.version:
            return None
        delta = t.storage_offset() - self.offset
        if len(self.shape) == 2:                      # (batch, steps): a column, t of shape (batch,)
            batch, steps = self.shape
            if tuple(t.shape) != (batch,) or (batch > 1 and t.stride() != (self.stride[0],)):
                return None
            step_stride = self.stride[1]
        else:                                         # (steps,): one element, maybe expanded
            steps = self.shape[0]
            if t.numel() != 1 and not (t.ndim == 1 and t.stride() == (0,)):
                return None
            step_stride = self.stride[0]
        if step_stride == 0:
            return None
        step, rest = divmod(delta, step_stride)
        return step if rest == 0 and 0 <= step < steps else None


__all__ = ["CAST_DTYPES", "MATCH_RTOL", "PlannedWindow", "TrajectoryPlan", "declared_times"]
