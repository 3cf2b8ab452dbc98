"""jaggc: JAGG (Jacobian-Aggregated Group Gradient) for GRPO on flow-matching DiTs."""

from .errors import (JaggCaptureError, JaggError, JaggGraphError, JaggInputError, JaggInternalError, JaggTypeError,
                     JaggUnsupportedError)
from .backward_modes import BackwardMode
from .runtime.guard import Guard
from .runtime import (Basis, DitCall, RolloutCache, WindowOptions, atomic_step, count_dit_passes, jagg_calls,
                      run_exact, run_window)

__version__ = "0.1.0"

__all__ = [
    "BackwardMode", "Basis", "Guard", "DitCall", "JaggCaptureError", "JaggError", "JaggGraphError", "JaggInputError", "JaggInternalError",
    "JaggTypeError",
    "JaggUnsupportedError", "RolloutCache", "WindowOptions", "atomic_step", "count_dit_passes", "jagg_calls", "run_exact", "run_window",
]
from .api import JaggCompiled, explain, jagg_compile
from .options import Options
from .report import Report
from .runtime.routing import Routing
from .steps import Stepwise, stepwise
from .steps.stepwise_settings import FirstOrder

__all__ += ["FirstOrder", "JaggCompiled", "Options", "Report", "Routing", "Stepwise", "explain", "jagg_compile", "stepwise"]


def calibrate(loss_fn, dit, batch, target_cosine=0.95, candidates=None, **kwargs):
    """Measure JAGG settings' gradient fidelity and backward cost on ``batch``; recommend the
    cheapest meeting ``target_cosine`` (jaggc.fidelity.calibrate; imported lazily)."""
    from .fidelity.calibrate import calibrate as _calibrate

    return _calibrate(loss_fn, dit, batch, target_cosine=target_cosine, candidates=candidates, **kwargs)


__all__ += ["calibrate"]
