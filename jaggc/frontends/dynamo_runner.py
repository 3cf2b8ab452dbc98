"""The Dynamo frontend: ``torch.compile(loss, fullgraph=True)`` with the DiT kept opaque
(``dynamo.py``), one backend shared by every compiled loss over the same modules
(``dynamo_backend.py``); each compiled loss rewrites its own copy of a captured graph.

Dynamo guards what the graph depends on itself (shapes, Python values, the autocast state), so
this frontend keeps no cache key: a changed input recompiles, up to Dynamo's recompile limit,
whose error names the guard that kept failing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .. import _compat
from ..errors import JaggCaptureError, JaggInputError
from ..runtime.autocast import current_autocast
from ..runtime.module_state import difference, module_state
from ..source import stack_location
from .contract import Captured, Session
from .dynamo import STATE_CHANGE_MARK, opaque_modules
from .dynamo_backend import copy_graph_module, running_loss, shared_backend
from .epilogue import aliasing_holds, check_ran, modes_restored, traced_aliasing
from .fx_module_states import restore_entry_states

RECOMPILE_FIX = (
    "If that value changes on purpose (a new subset of trained steps per sample, as in DanceGRPO), use "
    "capture='fx' (one graph per value, in a bounded cache) or pass it as a tensor the loss only indexes "
    "with; a new step count or input shape also recompiles. Otherwise reuse one compiled loss or call "
    "torch.compiler.reset().")


class DynamoFrontend:
    name = "dynamo"

    def __init__(self, session: Session, qualname: str):
        self.session = session
        self.qualname = qualname
        self._compiled = None
        self._modules: tuple[int, ...] = ()
        self._graphs: dict[int, tuple] = {}   # id(pristine capture) -> (pristine, runner of our rewrite)
        self._entry_autocast = None
        self._graph_ran = False

    def reset(self) -> None:
        self._compiled = None

    def run(self, args: tuple, kwargs: dict) -> Any:
        candidates = self.session.candidates(args, kwargs)
        modules = tuple(id(m) for m in candidates)
        if self._compiled is not None and modules != self._modules:
            # Dynamo's cached graph holds the module it traced; another module (same class) must
            # not silently reuse it (it would compute the first module's loss and gradient)
            self.reset()
        self._modules = modules
        if self._compiled is None:
            # one backend object per module set, shared by every compiled loss: Dynamo's cache
            # entries only match their own backend, and a backend per jagg_compile made each compiled
            # loss of one function a recompile of its code (dynamo_backend.py)
            self._compiled = torch.compile(self.session.fn, backend=shared_backend(candidates), fullgraph=True,
                                           dynamic=False)
        try:
            self._graph_ran = False
            self._entry_autocast = current_autocast()   # the backend's graph is entered in it
            traces = self.session.traces
            entry = {id(m): module_state(m) for m in candidates}
            with opaque_modules(candidates), running_loss(self):
                out = self._compiled(*args, **kwargs)
            self._refuse_replayed_state_change(candidates, entry)
            if not self._graph_ran:
                # Dynamo built no graph for these inputs (an empty trajectory: no DiT call, no tensor
                # op): the loss is a Python constant of its inputs, and it is what Dynamo returned
                self.session.show(self.session.empty_report(self.name, (
                    "no graph: the loss made no tensor op on these inputs (no DiT call); it ran as written")))
                return out
            return check_ran(out, candidates, self.qualname, new_graph=self.session.traces != traces)
        except _compat.backend_failed_type() as e:
            raise _compat.unwrap_backend_error(e) from None
        except _compat.dynamo_unsupported_types() as e:
            raise self._unsupported(e, candidates, args, kwargs) from e
        except _compat.recompile_limit_types() as e:
            guard = _compat.recompile_reason(e)
            changing = f"`{guard.split('==')[0].strip()}` (last failed guard: {guard})" if guard else "a guarded input"
            raise JaggCaptureError(
                f"Dynamo's recompile limit for {self.qualname} was hit: each new value of "
                f"{changing} compiled another graph of its code. "
                f"{RECOMPILE_FIX} Dynamo says: {first_lines(e, 3)}", path="dynamo") from e

    def _refuse_replayed_state_change(self, candidates, entry: dict) -> None:
        """A state change the refusers of ``dynamo.opaque_modules`` do not see (an attribute write,
        ``dit.training = False``; ``nn.Module.train(dit)`` called unbound) is a side effect Dynamo
        replays after its graph: every DiT call of the graph ran in the entry state, the eager loss
        runs the later ones in the new state. Refused as the methods are (issue 42), the module put
        back in its entry state first, so that the next path (``capture="auto"``) starts from it.
        (A change the loss undoes before it returns leaves no trace here.)"""
        changed = [m for m in candidates if module_state(m) != entry[id(m)]]
        if not changed:
            return
        m = changed[0]
        what = difference(entry[id(m)], module_state(m))
        restore_entry_states(changed, entry)
        raise JaggCaptureError(
            f"{self.qualname} changes the DiT's state ({what}) in a way Dynamo replays after its graph "
            f"(an attribute write such as `dit.training = ...`), so every DiT call in the graph ran in the state "
            f"the loss was entered in. The FX capture replays such changes (capture='fx'), the intercept path "
            f"records each call's state (capture='intercept')", path="dynamo")

    def _unsupported(self, e: BaseException, candidates, args, kwargs) -> Exception:
        """The error to raise for a loss Dynamo cannot take in one graph."""
        user_error = self._user_exception(e, candidates, args, kwargs)
        if user_error is not None:
            return user_error
        where = stack_location(_compat.dynamo_real_stack(e))
        if STATE_CHANGE_MARK in str(e):
            return JaggCaptureError(
                f"{self.qualname} changes the DiT's state (train/eval, "
                f"adapters, requires_grad or hooks); Dynamo would replay the change after its graph, so every "
                f"DiT call in the graph would run in the state the loss was entered in. The FX capture "
                f"replays such changes (capture='fx')", path="dynamo", where=where)
        return JaggCaptureError(
            f"Dynamo could not capture {self.qualname} in one graph "
            f"(a graph break would hide DiT calls from the rewrite). Move data-dependent Python "
            f"(`.item()`, `if` on a tensor, print) out of the loss or compute it with tensor ops "
            f"(torch.where), or pass options=jaggc.Options(on_unsupported='exact') to run it uncompiled. "
            f"Dynamo says: {first_lines(e)}", path="dynamo", where=where)

    def _user_exception(self, err: BaseException, candidates, args, kwargs) -> JaggInputError | None:
        """Dynamo reports an exception raised by the user's own code (a ZeroDivisionError when a
        loss divides by an empty trajectory's step count) as an 'Observed exception' graph break,
        which reads like a jaggc limitation. Run the loss eagerly (no grad, nothing accumulated)
        to surface the user's exception, counting DiT calls; None if it does not raise."""
        if "observed exception" not in str(err).lower():
            return None
        calls = [0]

        def count(*_):
            calls[0] += 1

        handles = [m.register_forward_pre_hook(count) for m in candidates]
        try:
            with torch.no_grad():
                self.session.fn(*args, **kwargs)
        except Exception as raised:  # noqa: BLE001 - the user's own error, re-raised with context
            empty = (" It made no DiT call: an empty trajectory (no trained step) has nothing to train; "
                     "check the step count of the batch." if calls[0] == 0 else "")
            return JaggInputError(f"{self.qualname} itself raises {type(raised).__name__}: {raised} "
                                  f"(run uncompiled on these inputs).{empty}")
        finally:
            for h in handles:
                h.remove()
        return None

    # --- what the shared backend calls (dynamo_backend.SharedBackend) ---------------------------
    def graph_for(self, pristine: fx.GraphModule, own: fx.GraphModule | None = None):
        """This loss's rewrite of a graph Dynamo captured and cached, possibly for another compiled
        loss of the same function: made once per captured graph, from ``own`` (the capture itself,
        when this loss compiled it) or a copy of ``pristine``."""
        known = self._graphs.get(id(pristine))
        if known is None:
            gm = own if own is not None else copy_graph_module(pristine)
            known = self._graphs[id(pristine)] = (pristine, self._graph_runner(gm))
        return known[1]

    def _graph_runner(self, gm: fx.GraphModule):
        # the effects analysis assumed the example inputs' storage sharing (aliasing.py)
        traced = traced_aliasing(gm, [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"])
        # Dynamo guards the autocast state: a cached graph only runs in the state it was captured in
        gm, report = self.session.rewrite(Captured(gm, entry_autocast=self._entry_autocast), self.name)
        forward = gm.forward

        def run_graph(*args):
            if not aliasing_holds(traced, args):
                raise JaggCaptureError(
                    f"{self.qualname} writes in place into its inputs, and this call's inputs share storage "
                    f"differently from the call Dynamo traced; the graph's order of those writes would not hold. "
                    f"Pass the inputs as they were (or copies), or use capture='fx' (it traces each aliasing)",
                    path="dynamo")
            # Dynamo keeps one compiled graph per guard set; .report follows the one that runs
            self.session.show(report)
            self._graph_ran = True
            with modes_restored():
                return forward(*args)

        return run_graph


def first_lines(e: BaseException, n: int = 12) -> str:
    return "\n".join(str(e).strip().splitlines()[:n])


__all__ = ["DynamoFrontend", "RECOMPILE_FIX"]
