"""The cases in which a trajectory's windows cannot run as planned, and what jaggc does in each.

Never a silently wrong or partial ``.grad``: each case either runs the affected window exactly,
with one warning, or raises a ``JaggUnsupportedError`` that names the step, its line and the fix.
The rule that decides: jaggc runs a window exactly when the exact gradient of its visited steps can
still be formed (their graphs are held, or their calls can be re-run on unchanged parameters and
inputs) and nothing has read ``.grad`` in between; otherwise it raises.

| case | detected | what happens |
|---|---|---|
| a step visited twice | at its second call | its window runs exactly (warning) |
| ``zero_grad()`` between two steps of a window, or after the last step and before the trajectory ends | at the next step or the end (ledger: ``.grad`` is marked while a step's gradient is held back, so a reset of gradients that were None is seen too) | the earlier steps' gradient is dropped, as ``zero_grad`` drops it in the loop; the window runs exactly (warning) |
| ``.grad`` written otherwise (``clip_grad_norm_``, ``unscale_``, a hand-written scaling) while a step's gradient is held back | at the next step or the end | error |
| either of the two between a step's forward and its backward | when its gradient reaches jaggc's node (unless that backward ran an exact step's DiT backward first) | as above |
| either of the two while no step's gradient is held back (the window's steps so far have not run their backward) | | nothing to do: ``.grad`` is the unchanged loop's |
| a parameter written between two steps of a window | at the next step, or before the window's backward | error |
| DeepSpeed ZeRO: ``engine.zero_grad()``, the ZeRO optimizer's or ``engine.module``'s ``zero_grad()`` (``.grad`` is ZeRO's, not watched) while a step's gradient is held back | in a wrapper of those calls (runtime/engines.py, ``watch_zero_grad``), before it runs | error (while nothing is held back: allowed) |
| ``optimizer.step()`` while a step's gradient is held back | in a pre-hook on every optimizer step of the module's parameters, before any parameter moves | error |
| a trajectory ending early: the ``steps()`` loop left by ``break`` or an exception, fewer steps than declared, a new ``trajectory()`` before the last one finished, ``Stepwise.close()`` | at that moment | open windows run exactly (warning), unless ``.grad`` was written since: error |
| DeepSpeed (stage 0, ZeRO-1/2): a window that must run exactly outside a loop backward (an early end or a step visited twice after a step's gradient was held back) | at that moment | error: the engine reduces gradients only inside ``engine.backward`` (runtime/engines.py, ``reduces_only_in_engine_backward``) |
| ``backward(inputs=...)``, ``torch.autograd.grad`` through a JAGG step (the parameters are inputs of its node, tap.py) | at that step's backward | error |
| a step's gradient never arriving (an exception or a loss left without backward) | when the trajectory ends | it adds nothing, as in the loop; its window runs exactly (warning); under DDP/FSDP, where the forms above do not enter jaggc's node, error |
| DDP/FSDP, steps out of σ order (the deferred schedule, ranks.py): ``optimizer.step()`` (or a clip) before every declared step's backward ran | in the optimizer pre-hook (the ledger) | error (the windows' backward runs at the end of the last declared step's backward: step in or after that step's body) |

After an error the trajectory is dropped: the next one starts clean. Dropping it makes no collective
(a refusal may be one rank's alone, run.py's order check: the rank must raise, not wait in an agreement
its peers never join); under DDP/FSDP/DeepSpeed the error names the rank.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .._compat import in_backward
from ..errors import JaggUnsupportedError
from .roles import StepwiseOwner

if TYPE_CHECKING:
    from .run import StepVisit, TrajectoryRun, WindowRun

FIX_STEP = ("step the optimizer (and clip, zero_grad) only after a trajectory's last step: with accelerate, "
            "gradient_accumulation_steps = (your accumulation) x (steps per trajectory)")


class Safety:
    def __init__(self, owner: StepwiseOwner):
        self.owner = owner

    def warn(self, message: str) -> None:
        """A fallback the run takes: counted, kept in the notes, and one warning."""
        self.owner.counts.fallbacks += 1
        self.owner.notes.append(message)
        warnings.warn(f"jaggc: {message}", stacklevel=4)

    def refuse(self, run: "TrajectoryRun", message: str, *, where: str = "") -> JaggUnsupportedError:
        """The error to raise for ``run``, which is dropped (its graphs freed, the next trajectory clean).
        Dropping it makes no collective (``Stepwise.drop``): a refusal may be one rank's alone, and that
        rank raises at once; under DDP/FSDP/DeepSpeed the message names the rank."""
        self.owner.drop(run)
        return JaggUnsupportedError(message + f" (jaggc dropped this trajectory{_on_rank(self.owner)}; the next one "
                                              f"starts clean)", where=where)

    # --- before a step runs ------------------------------------------------------------------
    def before_step(self, run: "TrajectoryRun", step: int, where: str) -> None:
        ledger = self.owner.ledger
        if not run.open_windows():
            ledger.snapshot()
            return
        self._grads_changed(run, f"before step {step}", where)
        open_windows = run.open_windows()       # a zero_grad may have dropped what was held back
        if not open_windows:
            ledger.snapshot()
            return
        name = ledger.changed_parameter()
        if name is not None:
            steps = sorted(v.step for w in open_windows for v in w.pending())
            raise self.refuse(run, (
                f"parameter {name!r} was written between the steps of an open JAGG window (steps {steps} "
                f"ran before step {step}: an optimizer step or an in-place write). The window's gradient needs the "
                f"parameters its steps ran with; {FIX_STEP}"), where=where)

    def before_outside_call(self, run: "TrajectoryRun", where: str) -> None:
        """The loop calls the module outside a step (run.py's ``outside_step``): as before a step."""
        if run.open_windows():
            self._grads_changed(run, "before a no-grad call of the DiT", where)

    def before_grads(self, run: "TrajectoryRun", visit: "StepVisit") -> None:
        """A step's gradient arrives (its backward reached jaggc's node, before any joint backward of
        that backward ran): what the loop did to ``.grad`` since its forward, as before a step."""
        self._grads_changed(run, f"between step {visit.step}'s forward and its backward", visit.where)

    def _grads_changed(self, run: "TrajectoryRun", when: str, where: str) -> None:
        """What the loop did to ``.grad`` while a step's gradient was held back: a reset drops it, as
        the loop drops it; any other write is refused (it read or scaled a gradient that lacks it)."""
        ledger = self.owner.ledger
        change = ledger.grad_change()
        if change is None:
            return                          # the snapshot already holds .grad as it is
        if not run.withheld():
            # no step's gradient is held back: .grad is what the unchanged loop has, whatever read or reset it
            ledger.snapshot_grads()
            return
        if change.kind == "reset":
            self._zero_grad(run, run.open_windows(), when)
            return
        raise self.refuse(run, (
            f"the .grad of {change.name!r} was written between the steps of an open JAGG window ({when}, "
            f"while the gradient of steps {run.withheld_steps()} was held back for the window's joint "
            f"backward: clip_grad_norm_, a GradScaler's unscale_ or another write read or scaled a gradient that "
            f"lacks them). {FIX_STEP}"), where=where)

    def _zero_grad(self, run: "TrajectoryRun", open_windows: list["WindowRun"], when: str) -> list[int]:
        """A zero_grad ``when``: the loop would have dropped what the steps whose backward ran
        contributed; their windows run exactly from now on. Returns the dropped steps. On the deferred
        schedule (ranks in their own orders: steps/ranks.py) refused: running a window exactly there
        re-runs DiT calls (collective forwards) that other ranks, at other steps, do not make."""
        if run.deferred:
            self.refuse_deferred(run, f"zero_grad() ran {when}")
        dropped = []
        for win in open_windows:
            for visit in list(win.pending()):
                if visit.grads is not None:       # its backward ran before the zero_grad
                    dropped.append(visit.step)
                    win.dropped.add(visit.step)
                    del win.visits[visit.step]
                    visit.held = visit.grads = None
            self.demote(run, win)
        self.owner.ledger.withholding(run.withheld())
        self.warn(f"zero_grad() ran between the steps of a JAGG window ({when}): the gradient of steps "
                   f"{sorted(dropped)} was dropped, as the loop drops it, and the window runs exactly. {FIX_STEP}")
        return dropped

    def refuse_deferred(self, run: "TrajectoryRun", what: str) -> None:
        """Raise for ``what`` on the deferred schedule (ranks visiting their steps in their own orders,
        steps/ranks.py), where a window run exactly re-runs calls (collective) its peers do not make: the
        two-rank fuzzer measured hangs and wrong gradients there (docs/reliability.md, "On two ranks")."""
        raise self.refuse(run, (
            f"{what}, while the ranks visit their steps in their own orders (the deferred schedule: every "
            f"window's backward runs at the trajectory's last step, the same on every rank). Running the open "
            f"windows exactly now would re-run DiT calls (collective under DDP/FSDP) that the other ranks do not "
            f"make. Keep zero_grad() and the loop's end after the trajectory's last step, or declare the steps in "
            f"the same (σ) order on every rank"))

    def visited_twice(self, run: "TrajectoryRun", win: "WindowRun", step: int, where: str) -> None:
        if not win.exact:
            self.demote(run, win)
        self.warn(f"{where}: step {step} (window {win.planned.index}) was called twice in one trajectory; its window "
                   f"runs exactly (each call its own backward, as in the loop). Declare each trajectory's steps once")

    def demote(self, run: "TrajectoryRun", win: "WindowRun") -> None:
        """Run ``win`` exactly from now on: visited steps whose gradient is known go through their own
        graphs now; the others when their gradient arrives; later steps run as written."""
        win.exact = True
        ready = [v for v in win.pending() if v.grads is not None]
        engine = self.owner.engine
        if ready and engine.reduces_only_in_engine_backward and not in_backward():
            # DeepSpeed reduces the gradient only inside its own backward (ZeRO-2 takes each into its
            # buckets there; stage 0 all-reduces .grad at its end: runtime/engines.py): outside one the
            # gradient would be lost, or stay this rank's alone
            into = "ZeRO's partitions" if engine.reduces_in_loop_backward else "DeepSpeed's reduction over the ranks"
            raise self.refuse(run, (
                f"window {win.planned.index} must run exactly (its steps {sorted(v.step for v in ready)} ran their "
                f"backward, and the trajectory ended early or a step was visited twice), but on {engine.name} a "
                f"gradient reaches {into} only inside engine.backward: the held-back gradient cannot be "
                f"added now. Run every declared step once, each with its engine.backward, before the trajectory ends"),
                where=ready[-1].where)
        run.run_backward([(v, v.grads) for v in ready])
        for v in ready:
            v.exact, v.grads = True, None

    # --- before jaggc backpropagates or re-runs -------------------------------------------------
    def before_backward(self, run: "TrajectoryRun", entries) -> None:
        name = self.owner.ledger.changed_parameter()
        if name is not None:
            visit = entries[0][0]
            raise self.refuse(run, (
                f"parameter {name!r} was written after step {visit.step} ran and before its window's "
                f"backward; {FIX_STEP}"), where=visit.where)

    def before_rerun(self, run: "TrajectoryRun", visit: "StepVisit") -> None:
        self.before_backward(run, [(visit, None)])

    def engine_zero_grad(self, run: "TrajectoryRun", call: str) -> None:
        """A ``zero_grad`` of the engine's own gradient store (DeepSpeed ZeRO: ``call``), which the
        ledger cannot see on ``.grad``: harmless while nothing is held back; otherwise refused before it
        runs. What the unchanged loop would have lost is not jaggc's to guess: ZeRO-1 drops the
        accumulated gradient, ZeRO-2 keeps what it already reduced into its partitions, and a held-back
        step's gradient can reach them only inside an ``engine.backward``."""
        if not run.withheld():
            return
        steps = run.withheld_steps()
        raise self.refuse(run, (
            f"{call} ran between the steps of an open JAGG window on {self.owner.engine.name} (after step "
            f"{run.visited[-1] if run.visited else None}), while the gradient "
            f"of steps {steps} was held back for the window's joint backward: in the unchanged loop it would act on "
            f"a gradient that lacks them, and ZeRO takes a held-back gradient only inside engine.backward, so jaggc "
            f"cannot drop or add it as the loop would. The zero_grad was not run. Call zero_grad only at an "
            f"accumulation boundary (engine.step() does it there), not inside a trajectory; {FIX_STEP}"),
            where=run.latest.where if run.latest else "")

    # --- an optimizer step ------------------------------------------------------------------------
    def optimizer_step(self, run: "TrajectoryRun") -> None:
        """An optimizer step while a step's gradient is held back would step without it: refused. A
        window whose visited steps ran no backward yet holds nothing back (``.grad`` is the loop's);
        a later step or backward of it then meets the moved parameters and is refused there."""
        if not run.withheld():
            return
        # a zero_grad just before the step dropped what was held back (the loop steps on its own .grad)
        self._grads_changed(run, "before optimizer.step()", run.latest.where if run.latest else "")
        if not run.withheld():
            return
        open_windows = run.open_windows()
        visits = [v for w in open_windows for v in w.pending()]
        waiting = [s for w in open_windows for s in w.planned.steps
                   if s not in w.visits or w.visits[s].grads is None]
        raise self.refuse(run, (
            f"optimizer.step() ran while JAGG window(s) {[w.planned.index for w in open_windows]} "
            f"were open (steps {sorted(v.step for v in visits)} ran, steps {waiting} not yet, or without their backward()): .grad lacks those "
            f"steps' gradient, so the step was not taken. {FIX_STEP}; a loop that ends early must leave the "
            f"trajectory first (iterate it with Stepwise.steps(...) so that break and exceptions are seen)"),
            where=visits[-1].where)

    # --- the end of a trajectory --------------------------------------------------------------------
    def close(self, run: "TrajectoryRun", reason: str, *, raised: bool = False) -> None:
        """The trajectory is over (``reason``; ``raised``: the loop left by an exception): its open
        windows run exactly, or it raises."""
        open_windows = run.open_windows()
        if not open_windows:
            return
        ledger = self.owner.ledger
        change = ledger.grad_change() if run.withheld() else None
        if change is not None and change.kind == "written":
            raise self.refuse(run, (
                f"the trajectory ended {reason} with JAGG windows open, and the .grad of {change.name!r} was written "
                f"since its last step (a clip or optimizer step read a partial gradient); {FIX_STEP}"))
        if change is not None:
            # a zero_grad after the last step's backward: the loop dropped what the steps before it gave
            self._zero_grad(run, open_windows, f"after step {run.visited[-1]}, before the trajectory ended {reason}")
            open_windows = run.open_windows()
            if not open_windows:
                return
        name = ledger.changed_parameter()
        if name is not None and run.withheld():
            raise self.refuse(run, (
                f"the trajectory ended {reason} with JAGG windows open, and parameter {name!r} was written since "
                f"its last step (an optimizer step or an in-place write) while the gradient of steps "
                f"{run.withheld_steps()} was held back; {FIX_STEP}"))
        if run.deferred and run.ready():
            run.complete_all()              # the deferred schedule's end: as planned, no warning
            return
        if run.deferred:
            self.refuse_deferred(run, f"the trajectory ended {reason} before every declared step had its gradient")
        no_grad = [v for w in open_windows for v in w.pending() if v.grads is None]
        # the step an exception left its loop in never reached its backward(), as in the loop itself
        unexplained = [v for v in no_grad if not (raised and run.visited and v.step == run.visited[-1])]
        if unexplained and self.owner.distributed:
            # under DDP/FSDP backward(inputs=...) and torch.autograd.grad do not enter jaggc's node (tap.py):
            # a step without its gradient may have been backpropagated so
            raise self.refuse(run, (
                f"step(s) {sorted(v.step for v in unexplained)} of this trajectory never got a "
                f"gradient: no backward() went through their DiT output, or it went through backward(inputs=...) "
                f"or torch.autograd.grad, which jaggc's stepwise JAGG cannot serve (each step's gradient reaches "
                f".grad only through its window's joint backward). Call loss.backward() once per step"),
                where=unexplained[0].where)
        indices = [w.planned.index for w in open_windows]
        for v in no_grad:
            # no backward reached it (an exception, a loss left unused): it adds nothing, as in the loop
            win = run.window(v.step)
            del win.visits[v.step]
            win.dropped.add(v.step)
            v.held = v.probe_graph = None
        for win in open_windows:
            self.demote(run, win)
        missing = run.missing()
        unused = sorted(v.step for v in no_grad)
        self.warn(
            f"the trajectory ended {reason} ({len(run.visited)} of {len(run.plan)} declared steps ran"
            + (f"; steps {missing} did not" if missing else "")
            + (f"; steps {unused} ran no backward and add nothing, as in the loop" if unused else "")
            + f"): JAGG window(s) {indices} ran exactly")


def _on_rank(owner: StepwiseOwner) -> str:
    """`` on rank r of n`` where the module's backward passes are collective (a refusal may be one
    rank's alone: its peers go on until they block in a collective this rank never joins)."""
    import torch.distributed as dist

    if not owner.distributed or not (dist.is_available() and dist.is_initialized()):
        return ""
    return f" on rank {dist.get_rank()} of {dist.get_world_size()}"


__all__ = ["FIX_STEP", "Safety"]
