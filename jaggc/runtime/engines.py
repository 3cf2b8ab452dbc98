"""The engines that hold, hook and reduce a module's gradients, one row each (``engine_of``).

A stepwise window withholds the gradient of its steps until its joint backward; what that must do
depends on where the engine keeps the gradient between backward passes, which hooks it runs and when
it communicates. The table below is that knowledge, one row per ``EngineKind`` (``_ROWS``); every path
asks ``engine_of(module)`` for it and reads its flags and methods, never the engine's name: the
stepwise path (steps/ranks.py, run.py, stepwise.py, stepwise_install.py, ledger.py, probe.py,
safety.py) and the whole-loss runtime (deferred.py: ``sync_skipped``, the per-window refusal of a
returned gradient; lowmem.py and guard_probe.py: ``sharded``, ``gradient_slots``, ``local_module``,
``process_group``; guard.py: ``collective_backward``; sharded_grads.py: ``gradient_slots``, FSDP's
storages behind ``_compat.GradSlot``; rollout_cache.py: ``lasting_parameters``, FSDP2's sharded parameters). The next engine (VeOmni, Megatron) is one more kind, one more
row and one more branch of ``engine_of``.

What is left (issue 55, item 3): three module-type checks outside this file and _compat/, in files this
change did not own: runtime/checks.py (``fsdp_version``: FSDP casts the stored states itself, so the
input dtype check leaves them alone), runtime/module_state.py (``module_chain`` unwraps DDP, FSDP,
DataParallel and DeepSpeed engines by class name: the generic unwrapping ``engine_of`` itself walks)
and frontends/dynamo.py (``_DISTRIBUTED``: the wrapper class names Dynamo must not trace into).
Stepwise's ``fsdp1`` (stepwise_install.py: FSDP1's no-grad rollout forward) reads the kind itself.
The ledger reads ``Engine.watched_parameters`` (ZeRO-3: the partitions), passed in by stepwise.py.

| engine | holds the gradient | hooks | reduces | what a window must do |
|---|---|---|---|---|
| none (one process) | ``.grad`` | none | never | nothing; the tap takes the parameters as inputs (tap.py) |
| DDP | ``.grad`` (full) | on the gradient accumulators; its reducer prepared by the latest forward | all-reduce per bucket in every synced backward | the ranks agree on one plan; a synced backward needs the latest forward among its roots (re-run) |
| FSDP1 | the FlatParameter's ``.grad`` (a shard), views on the originals with ``use_orig_params`` | on the FlatParameter's accumulator, unshard in the forward | reduce-scatter per unit in every backward | as DDP, and every backward's latest forward (its unshard) |
| FSDP2 | the sharded DTensor's ``.grad`` | on the unsharded parameters | reduce-scatter per group in every backward | as FSDP1 |
| DeepSpeed stage 0 (no ZeRO: a config without a ``zero_optimization`` section, or stage 0) | ``.grad`` (full, this rank's, accumulated between boundaries); fp16/bf16: the low-precision parameters' ``.grad`` (FP16_Optimizer) | none | all-reduce of every ``.grad`` at the end of the boundary's ``engine.backward`` | as DDP: the ranks agree on one plan, the ledger watches ``.grad`` (a clip between steps is seen, a ``zero_grad`` by its effect); every window's backward inside a loop backward, before the engine's reduction (run.py does that); a window that must run exactly outside a loop backward is refused (its gradient would miss the reduction). The pipeline engine's BF16_Optimizer (``.grad`` moved out in hooks) is refused |
| DeepSpeed ZeRO-1 | ``.grad`` until the accumulation boundary, then ZeRO's partition | post-accumulate hooks (bookkeeping) | at the end of the boundary's ``engine.backward``, which empties ``.grad`` | as ZeRO-2 (the ledger must not take that emptying for a ``zero_grad``); its ``zero_grad`` (engine's or optimizer's) watched as ZeRO-2's |
| DeepSpeed ZeRO-2 | ZeRO's buckets and partitions: ``.grad`` is None after every backward | post-accumulate hooks that move each gradient into a bucket | reduce per bucket in every backward; accumulates in its partition | one gradient backward per ``engine.backward`` (ZeRO asserts one reduction per parameter per backward): a window's joint backward runs inside the backward of its last step; on the deferred schedule every window in the trajectory's last step's backward, jointly; ZeRO's buckets readied in a backward with no parameter gradient; ``.grad`` is not watched: the engine's and the ZeRO optimizer's ``zero_grad`` are (``watch_zero_grad``), and refused while a gradient is held back |
| DeepSpeed ZeRO-3 | as ZeRO-2 (buckets, then the partition; ``.grad`` None after every backward); the parameters themselves partitioned: ``p.data`` empty at rest, the rank's partition in ``p.ds_tensor`` | forward pre-/post-hooks on every submodule gather and release its parameters (an all-gather per forward: every forward is collective); backward hooks gather them again; post-accumulate hooks move each gradient into a bucket | reduce-scatter per bucket in every backward (ZeRO-3's epilogue: after the hooks that fire, or the engine's end of backward) | as ZeRO-2, but nothing to ready in a backward with no parameter gradient; a knot's graph keeps the gathered weights it saved (ZeRO-3's backward hooks gather them again for its joint backward); the ledger watches the partitions (``watched_parameters``: ``p.data`` is swapped by every forward); the guard sizes a parameter by ``ds_numel`` (``numel``) and runs its interior forwards through the module's forward, not its call (a nested call would run the root's collective hooks again on one rank alone where the ranks' roles differ). The whole-loss path is refused (``refuse_zero3``: its capture runs the DiT on fake tensors, which ZeRO-3's gathering hook cannot handle) |

DeepSpeed: ``jaggc.stepwise(engine)`` installs on ``engine.module`` (the engine's forward calls it):
each step's output then reaches the engine's own output hooks (its backward prologue and
``gradient_accumulation_steps`` scaling) exactly as in the unchanged loop, and jaggc's own forwards
and joint backwards go through the bare module, whose parameters carry ZeRO's hooks. The private
DeepSpeed names used sit in ``jaggc/_compat/deepspeed.py``; a stepwise install checks them by name
(``refuse_unsupported_engine``) and refuses an engine that lacks one, naming the DeepSpeed versions
jaggc was tested with.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .._compat import (DEEPSPEED_TESTED, after_zero_optimizer_step, zero_optimizer_steps, Zero3Partitions, deepspeed_internals_missing, deepspeed_version,
                       fsdp2_sharded_parameters, fsdp_gradient_slots, fsdp_version, intercept_zero_grad, is_deepspeed_engine, zero12_managed,
                       zero3_numel, zero3_partitioned, zero_data_parallel_group, zero_ready_buckets,
                       zero_torch_optimizer)
from ..errors import JaggUnsupportedError
from .module_state import module_chain


class EngineKind(enum.Enum):
    """The engines of the module docstring's table, one per row (its value: the name messages use)."""

    NONE = "none"
    DDP = "DDP"
    FSDP1 = "FSDP1"
    FSDP2 = "FSDP2"
    DEEPSPEED_STAGE0 = "DeepSpeed stage 0"
    ZERO1 = "DeepSpeed ZeRO-1"
    ZERO2 = "DeepSpeed ZeRO-2"
    ZERO3 = "DeepSpeed ZeRO-3"

    @property
    def deepspeed(self) -> bool:
        return self in _ZERO_STAGE

    @property
    def fsdp(self) -> bool:
        return self in (EngineKind.FSDP1, EngineKind.FSDP2)


#: the ZeRO stage of each DeepSpeed kind (0: DeepSpeed without ZeRO)
_ZERO_STAGE = {EngineKind.DEEPSPEED_STAGE0: 0, EngineKind.ZERO1: 1, EngineKind.ZERO2: 2, EngineKind.ZERO3: 3}
_DEEPSPEED_KINDS = {stage: kind for kind, stage in _ZERO_STAGE.items()}


@dataclass(frozen=True)
class _Row:
    """One row of the table: what jaggc reads of an engine (``Engine``'s fields)."""

    hooks_accumulators: bool = False
    grad_in_dot_grad: bool = True
    reduces_in_loop_backward: bool = False
    reduces_only_in_engine_backward: bool = False
    ready_buckets: bool = False
    partitioned_parameters: bool = False
    sharded_grad_slots: bool = False
    no_sync_between_windows: bool = False
    swaps_parameters: bool = False


_ZERO = _Row(hooks_accumulators=True, grad_in_dot_grad=False, reduces_in_loop_backward=True,
             reduces_only_in_engine_backward=True, ready_buckets=True)
_ROWS: dict[EngineKind, _Row] = {
    EngineKind.NONE: _Row(),
    EngineKind.DDP: _Row(hooks_accumulators=True, no_sync_between_windows=True),
    EngineKind.FSDP1: _Row(hooks_accumulators=True, sharded_grad_slots=True),
    EngineKind.FSDP2: _Row(hooks_accumulators=True, sharded_grad_slots=True, swaps_parameters=True),
    EngineKind.DEEPSPEED_STAGE0: _Row(reduces_only_in_engine_backward=True),
    EngineKind.ZERO1: _ZERO,
    EngineKind.ZERO2: _ZERO,
    EngineKind.ZERO3: _Row(hooks_accumulators=True, grad_in_dot_grad=False, reduces_in_loop_backward=True,
                           reduces_only_in_engine_backward=True, partitioned_parameters=True),
}


@dataclass(frozen=True)
class Engine:
    """What jaggc must know of the engine that runs a module's backward (module docstring); made by
    ``Engine.of(kind, ...)`` from its kind's row."""

    kind: EngineKind
    wrapper: nn.Module | None = None
    #: every backward communicates, or the ranks' plans must agree (the probe's reductions, DeepSpeed's
    #: boundary all-reduce): the ranks must make the same backward passes in the same order
    collective_backward: bool = False
    #: the engine's hooks sit on the gradient accumulators (the tap takes no parameter inputs)
    hooks_accumulators: bool = False
    #: ``.grad`` holds the accumulating gradient between backward passes (the ledger watches it)
    grad_in_dot_grad: bool = True
    #: the engine takes gradients only inside its own backward (``engine.backward``), whose end reduces
    #: them, at most once per parameter (ZeRO-2 asserts it): every window's backward runs inside one
    #: loop backward, jointly (DeepSpeed ZeRO-1/2)
    reduces_in_loop_backward: bool = False
    #: the engine reduces the gradient only at the end of its own ``engine.backward`` (DeepSpeed, any
    #: stage): a gradient added outside one (a window run exactly after the loop left its backward
    #: passes) would miss the reduction: refused (safety.py)
    reduces_only_in_engine_backward: bool = False
    #: a loop backward that reaches no parameter must ready the engine's gradient buckets, as a first
    #: gradient would (ZeRO-1/2's ``setup_buckets``; ZeRO-3 readies nothing: its epilogue counts the
    #: hooks that fire)
    ready_buckets: bool = False
    #: the parameters are partitioned at rest and gathered by the engine's module hooks for each forward
    #: and each module's backward (ZeRO-3): ``p.data`` is empty between them, the rank's partition is
    #: ``p.ds_tensor`` and the full size ``p.ds_numel`` (``watched_parameters``, ``numel``)
    partitioned_parameters: bool = False
    #: the gradient lives in FSDP's private storages, one shard per rank (``gradient_slots``)
    sharded_grad_slots: bool = False
    #: the whole-loss per-window mode runs every knot forward but the last in ``no_sync()`` (DDP: one
    #: all-reduce per loss); FSDP reduce-scatters per window instead (deferred.py)
    no_sync_between_windows: bool = False
    # the module's registered parameters are other tensors while a forward holds them gathered (FSDP2
    # registers the unsharded ones, and keeps the root's after a forward): ``lasting_parameters``
    swaps_parameters: bool = False

    @classmethod
    def of(cls, kind: EngineKind, wrapper: nn.Module | None = None, *, collective: bool = False) -> "Engine":
        """The engine of ``kind`` (its row of the table), ``wrapper`` the object that runs it (DDP's
        module, the DeepSpeed engine), ``collective``: in an initialized process group."""
        return cls(kind, wrapper, collective_backward=collective and kind is not EngineKind.NONE,
                   **vars(_ROWS[kind]))

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def zero_stage(self) -> int | None:
        """The DeepSpeed engine's ZeRO stage (0: DeepSpeed without ZeRO), None elsewhere."""
        return _ZERO_STAGE.get(self.kind)

    @property
    def ddp(self) -> nn.Module | None:
        """The DistributedDataParallel wrapper, None under any other engine."""
        return self.wrapper if self.kind is EngineKind.DDP else None

    def backward_needs_latest_forward(self) -> bool:
        """Whether a backward must have the module's latest forward among its roots: DDP outside
        ``no_sync`` (its reducer is prepared there), FSDP (its hooks unshard there)."""
        if self.kind is EngineKind.DDP:
            return bool(self.wrapper.require_backward_grad_sync)
        return self.kind.fsdp

    def process_group(self):
        """The process group the engine reduces gradients over, where jaggc's agreements between its
        ranks run (runtime/collectives.py); None: the default group."""
        if self.kind.deepspeed and self.wrapper is not None:
            return zero_data_parallel_group(self.wrapper)
        return getattr(self.wrapper, "process_group", None) if self.wrapper is not None else None

    def install_target(self, module: nn.Module) -> nn.Module:
        """The module a stepwise installs on: DeepSpeed's ``engine.module`` (module docstring)."""
        return self.wrapper.module if self.kind.deepspeed and self.wrapper is not None else module

    def ready_gradient_free_backward(self) -> None:
        """A loop backward that reaches no parameter (a JAGG step's: its gradient goes to jaggc):
        ZeRO-2 readies its buckets when the first gradient arrives, and its end of backward
        reduces them, so it needs them readied also where none arrives (once per backward, as
        the first gradient does). ZeRO-3 has no such step (its epilogue runs from the hooks that
        fire, and from the engine's end of backward where none does)."""
        if self.ready_buckets and self.wrapper is not None:
            zero_ready_buckets(self.wrapper)

    @property
    def grad_from_taps(self) -> bool:
        """A stepwise guard sums the loop's gradient from what its backward passes hand autograd's
        accumulators (steps/probe.py): DeepSpeed, any stage (ZeRO moves ``.grad`` into its partitions,
        stage 0 all-reduces it at the end of ``engine.backward``)."""
        return self.kind.deepspeed

    @property
    def sharded(self) -> bool:
        """The gradient is FSDP's, sharded, in private storages (``gradient_slots``): autograd sees only
        gathered copies of the parameters."""
        return self.sharded_grad_slots

    def gradient_slots(self, module: nn.Module) -> list:
        """FSDP's gradient storages of ``module`` (``_compat.GradSlot``), one per sharded tensor."""
        if not self.sharded_grad_slots:
            raise TypeError(f"{self.name} keeps no sharded gradient slots")
        return fsdp_gradient_slots(module)

    def local_module(self, module: nn.Module) -> nn.Module:
        """The module jaggc's own forwards run on: DDP's wrapped module (its reducer does not see
        them), DeepSpeed's ``engine.module`` where ``module`` is the engine, else ``module``."""
        if self.kind is EngineKind.DDP and module is self.wrapper:
            return module.module
        return self.install_target(module) if module is self.wrapper else module

    def sync_skipped(self, module: nn.Module):
        """The context a whole-loss per-window knot forward that is not the last runs in: DDP's
        ``no_sync()`` (one all-reduce per loss), else none (deferred.py)."""
        if self.no_sync_between_windows and hasattr(module, "no_sync"):
            return module.no_sync()
        return contextlib.nullcontext()

    def numel(self, p: torch.Tensor) -> int:
        """The elements of ``p``'s full gradient (ZeRO-3: the partitioned parameter's full size)."""
        return zero3_numel(p) if self.partitioned_parameters else p.numel()

    def lasting_parameters(self, module: nn.Module) -> list[torch.Tensor]:
        """``module``'s parameters as the tensors that last from a rollout through the optimizer's steps
        (the rollout cache's test that they are unchanged): under FSDP2 each one's sharded DTensor,
        whichever form the module holds now; elsewhere the parameters themselves."""
        if not self.swaps_parameters:
            return list(module.parameters())
        sharded = fsdp2_sharded_parameters(module)
        return [sharded.get(id(p), p) for p in module.parameters()]

    @property
    def steps_through_copies(self) -> bool:
        """The engine's optimizer steps fp32 copies of the parameters and writes them back without bumping
        the parameters' version counters (DeepSpeed's ZeRO optimizers, stage 0's fp16/bf16 wrapper):
        its steps are counted instead (``optimizer_generation``)."""
        return self.kind.deepspeed and self.wrapper is not None and zero_torch_optimizer(self.wrapper) is not None

    def optimizer_generation(self) -> int | None:
        """How many steps the engine's optimizer made (``steps_through_copies``), None elsewhere (there
        the parameters' version counters show every step)."""
        return zero_optimizer_steps(self.wrapper) if self.steps_through_copies else None

    def after_optimizer_step(self, fn) -> bool:
        """Have ``fn()`` run when a step of the engine's optimizer has written the parameters (weakly
        held); True where it will (``steps_through_copies``: torch's global post-hook fires before
        DeepSpeed writes its copies back), False elsewhere (that hook is the step's end)."""
        if not self.steps_through_copies:
            return False
        after_zero_optimizer_step(self.wrapper, fn)
        return True

    def watched_parameters(self, module: nn.Module):
        """What a stepwise ledger reads to see a parameter written (``named_parameters()``): the module,
        or under ZeRO-3 the ranks' partitions (``p.data`` is gathered and released by every forward; the
        optimizer writes the partition)."""
        return Zero3Partitions(module) if self.partitioned_parameters else module

    def watch_zero_grad(self, before) -> Callable[[], None]:
        """Have ``before(call)`` run ahead of every ``zero_grad`` that reaches the gradient the engine
        accumulates where the ledger cannot see it (ZeRO: ``engine.zero_grad()``, the ZeRO optimizer's, the
        bare module's);
        ``before`` may raise to keep it from running. Returns the remover (a no-op elsewhere: there
        ``.grad`` holds the gradient and the ledger sees a ``zero_grad`` by its effect, DeepSpeed stage 0
        included)."""
        if self.grad_in_dot_grad or self.wrapper is None:
            return lambda: None
        return intercept_zero_grad(self.wrapper, before)

    def steps(self, optimizer, module: nn.Module) -> bool:
        """Whether ``optimizer``'s step moves ``module``'s parameters: one holding them, or the
        torch optimizer DeepSpeed's optimizer (ZeRO's, or stage 0's fp16/bf16 wrapper) steps on its
        fp32 copies."""
        if self.kind.deepspeed and self.wrapper is not None and optimizer is zero_torch_optimizer(self.wrapper):
            return True
        mine = {id(p) for p in module.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])


def engine_of(module: nn.Module) -> Engine:
    """The engine entry of ``module`` (the module the loop calls, or a wrapper's inner module
    reached through ``module_chain``)."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    chain = module_chain(module)
    for m in chain:
        if is_deepspeed_engine(m):
            stage = int(m.zero_optimization_stage())
            return Engine.of(_DEEPSPEED_KINDS.get(stage, EngineKind.ZERO3), m, collective=initialized)
    if zero3_partitioned(module):
        return Engine.of(EngineKind.ZERO3, None, collective=initialized)
    version = fsdp_version(module)
    if version is not None:
        return Engine.of(EngineKind.FSDP1 if version == 1 else EngineKind.FSDP2, None, collective=initialized)
    for m in chain:
        if isinstance(m, nn.parallel.DistributedDataParallel):
            return Engine.of(EngineKind.DDP, m, collective=initialized)
    return Engine.of(EngineKind.NONE)


def install_target_of(module: nn.Module) -> nn.Module:
    """Where a stepwise of ``module`` sits (``Engine.install_target``), without building its engine entry
    (looked up at every call of a module): DeepSpeed's ``engine.module``, else ``module``."""
    return module.module if is_deepspeed_engine(module) else module


def refuse_unsupported_engine(engine: Engine, what: str) -> None:
    """Raise where a stepwise cannot serve ``engine`` (``what``: the jaggc entry point): a DeepSpeed
    engine that lacks an internal jaggc uses (checked by name: another DeepSpeed release may have
    moved it), or whose stage-0 optimizer moves the gradients off ``.grad`` in hooks (the pipeline
    engine's BF16_Optimizer)."""
    if not engine.kind.deepspeed or engine.wrapper is None:
        return
    missing = deepspeed_internals_missing(engine.wrapper, engine.zero_stage)
    if missing:
        raise JaggUnsupportedError(
            f"{what} on a {engine.name} engine of DeepSpeed {deepspeed_version()}: jaggc needs DeepSpeed internals "
            f"this release lacks ({', '.join(missing)}; jaggc/_compat/deepspeed.py). jaggc is tested with DeepSpeed "
            f"{', '.join(DEEPSPEED_TESTED)}: install one of those (pip install 'deepspeed=={DEEPSPEED_TESTED[-1]}')")
    if engine.kind is EngineKind.DEEPSPEED_STAGE0 and type(engine.wrapper.optimizer).__name__ == "BF16_Optimizer":
        raise JaggUnsupportedError(
            f"{what} on a DeepSpeed stage-0 engine whose optimizer is DeepSpeed's BF16_Optimizer (the pipeline "
            f"engine's bf16 mode): it moves each gradient off .grad into its fp32 buffers in hooks, which jaggc "
            f"does not follow at stage 0. Use ZeRO stage 1 or 2, or bf16 without pipeline parallelism")


def refuse_bare_zero_module(module: nn.Module, what: str) -> None:
    """Raise where ``module`` is the bare module of a DeepSpeed ZeRO engine (``engine.module``): its
    parameters' gradient hooks are ZeRO's (ZeRO-1/2: numbered by the optimizer; ZeRO-3: partitioned),
    but the engine, whose ``backward`` alone takes and reduces their gradients, is out of reach from it
    (jaggc would hold gradients ZeRO never gets)."""
    engine = engine_of(module)
    bare = (engine.zero_stage is None and zero12_managed(module)) or (engine.kind.deepspeed and engine.wrapper is None)
    if bare:
        raise JaggUnsupportedError(
            f"{what} on {type(module).__name__}, whose parameters a DeepSpeed ZeRO optimizer manages (the "
            f"engine's module, engine.module): jaggc must know the engine, since a gradient reaches ZeRO's "
            f"partitions only inside engine.backward. Pass the engine: jaggc.stepwise(engine) (or the model "
            f"accelerator.prepare returned); it installs on engine.module, so a loop that calls either is served")


#: ``jaggc.stepwise`` on ZeRO-3, under development: the install path serves it (the partition-watching
#: ledger, the guard's sizes) and its tests pass (W=2 the unchanged loop, W=4 the ranks' average JAGG, the
#: guard's figures; tests/steps/test_stepwise_deepspeed_zero3.py turns this on), but the two-rank fuzzer
#: (tests/step_fuzz_distributed.py, seed 3141) measured silently wrong gradients in 21 of its 56 ZeRO-3
#: cases, every one with the loop's optimizer step at every step; until those pass it is refused
ZERO3_STEPWISE = False


def refuse_zero3_stepwise(engine: Engine, what: str) -> None:
    """Raise where a stepwise would run on ZeRO-3 while ``ZERO3_STEPWISE`` is off (its comment says why)."""
    if engine.kind is EngineKind.ZERO3 and not ZERO3_STEPWISE:
        raise JaggUnsupportedError(
            f"{what} on a DeepSpeed ZeRO-3 engine: refused for now. jaggc's two-rank fuzzer measured wrong "
            f"gradients on ZeRO-3 where the loop steps the engine at every step (21 of 56 cases), which no "
            f"test of the ZeRO-3 path catches yet. Use ZeRO stage 2 (\"zero_optimization\": {{\"stage\": 2}}: "
            f"gradients and optimizer states stay partitioned) or FSDP2 (fully_shard), on which {what} is "
            f"supported (docs/distributed.md)")


def refuse_zero3(module: nn.Module, what: str) -> None:
    """Raise where a whole loss (``what``: ``jagg_compile``) runs a DiT under DeepSpeed ZeRO-3, at its first
    call, before any capture touches the partitioned parameters. A stepwise serves ZeRO-3 (module
    docstring; its install checks ZeRO-3's internals, ``refuse_unsupported_engine``); the whole-loss
    capture does not: it runs the DiT on fake tensors to learn its outputs' shapes (the FX path's shape
    propagation, the intercept path's recording), and ZeRO-3's forward pre-hook then swaps a real
    parameter's ``.data`` for a gathered buffer made under the fake mode, which torch refuses
    ("Attempted to call `variable.set_data(tensor)`, but `variable` and `tensor` have incompatible tensor
    type"; measured with DeepSpeed 0.19.8 on both capture paths, tests/steps/test_stepwise_deepspeed_zero3.py).
    Serving it needs the capture to gather outside the fake mode or to read ``ds_shape``: not done."""
    if engine_of(module).kind is EngineKind.ZERO3:
        raise JaggUnsupportedError(
            f"{what} on a DeepSpeed ZeRO-3 engine: the whole-loss capture runs the DiT on fake tensors to learn "
            f"its outputs' shapes, and ZeRO-3's forward hook then swaps each real parameter's data for a gathered "
            f"buffer made under the fake mode, which torch refuses (variable.set_data: incompatible tensor type). "
            f"Write the loop per step and use jaggc.stepwise(engine) (supported on ZeRO-3), or use ZeRO stage 2 "
            f"(\"zero_optimization\": {{\"stage\": 2}}) or FSDP2 (fully_shard), on which {what} is supported "
            f"(docs/distributed.md)")


def refuse_whole_loss_guard_on_zero(module: nn.Module) -> None:
    """Raise where a guarded ``jagg_compile`` loss runs a DiT under DeepSpeed (any stage): the whole-loss
    probe reads the call's gradient from ``.grad``, which ZeRO empties into its partitions."""
    engine = engine_of(module)
    if engine.kind is EngineKind.DEEPSPEED_STAGE0:
        raise JaggUnsupportedError(
            f"jagg_compile(guard=...) on {type(module).__name__} under DeepSpeed stage 0: the whole-loss guard's probe "
            f"reads the call's gradient from .grad when its backward ends, before engine.backward reduces it over "
            f"the ranks, so its figures would be one rank's. Guard a per-step loop instead (jaggc.stepwise(engine, "
            f"guard=...) is supported on DeepSpeed stage 0), or run this loss without guard= on DeepSpeed")
    if engine.zero_stage is not None or zero12_managed(module):
        raise JaggUnsupportedError(
            f"jagg_compile(guard=...) on {type(module).__name__} under DeepSpeed ZeRO: the whole-loss guard's probe "
            f"reads the call's gradient from .grad, which ZeRO takes into its own partitions, so its figures "
            f"would not be the gradient's. Guard a per-step loop instead (jaggc.stepwise(engine, guard=...) is "
            f"supported on ZeRO-1/2/3), or run this loss without guard= on DeepSpeed")


__all__ = ["Engine", "EngineKind", "ZERO3_STEPWISE", "engine_of", "install_target_of", "refuse_bare_zero_module",
           "refuse_unsupported_engine", "refuse_whole_loss_guard_on_zero", "refuse_zero3", "refuse_zero3_stepwise"]
