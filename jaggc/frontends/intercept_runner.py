"""The intercept fallback as a frontend: no graph, the loss runs twice around a recording proxy
(``intercept.py``); it takes any loss the DiT is an argument of, at one more DiT forward per
trained step. The passes do not run (there is no graph), so the low-memory mode, which a pass
proves applicable, is refused here."""

from __future__ import annotations

from typing import Any

from ..backward_modes import BACKWARD_MODES, mode_names
from ..errors import JaggCaptureError, JaggUnsupportedError
from .contract import Session, bind_loss
from .epilogue import check_ran
from .intercept import InterceptedLoss


class InterceptFrontend:
    name = "intercept"

    def __init__(self, session: Session, qualname: str):
        self.session = session
        self.qualname = qualname

    def reset(self) -> None:
        pass   # nothing is kept between calls

    def run(self, args: tuple, kwargs: dict) -> Any:
        cfg = self.session.config
        if self.name not in cfg.options.backward.support.captures:     # backward_modes.SUPPORT
            reasons = "; ".join(self.session.failed_now or self.session.capture_failures)
            why = (f"no capture path took {self.qualname}: {reasons}" if reasons else
                   f"{self.qualname} runs on the intercept path (capture='intercept'), which makes no graph")
            raise JaggUnsupportedError(
                f"backward='{cfg.options.backward}' needs a captured graph (it proves the loss is a sum of per-step "
                f"terms), but {why}. Use {mode_names(m for m in BACKWARD_MODES if self.name in m.support.captures)}")
        bound = bind_loss(self.session.fn, args, kwargs)
        candidates = self.session.candidates(args, kwargs)
        dit = self.session.dit if self.session.dit is not None else candidates[0] if len(candidates) == 1 else None
        names = [k for k, v in bound.arguments.items() if dit is not None and v is dit]
        if not names:
            raise JaggCaptureError(
                f"the intercept fallback swaps the DiT argument of {self.qualname} for a recording proxy, "
                f"so the DiT must be exactly one argument of the loss (pass it as an argument; with several "
                f"module arguments also pass jagg_compile(dit=model))")
        loss = InterceptedLoss(self.session.fn, names[0], cfg.window, cfg.options,
                               exact=cfg.routing.jagg_frac == 0.0 and not cfg.routing.active, routing=cfg.routing)
        out = loss(dit, bound)
        self.session.show(self.session.intercept_report(loss))     # a recording counts as a trace
        # no graph ran: nothing switched modes, and no new graph's gradients to check
        return check_ran(out, candidates, self.qualname, new_graph=False)


__all__ = ["InterceptFrontend"]
