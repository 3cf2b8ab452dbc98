"""jaggc's graph passes (installed as ``jaggc.passes``). Each is ``fn(gm, ctx) -> gm`` with an
invariant stated in its module docstring; ``run_passes`` runs them with a lint and a snapshot
after each."""

from .check_frontend import check_frontend
from .cleanup import cleanup
from .context import CallSite, CompileConfig, PassContext, Window
from .effects import check_window_inputs, input_writes
from .find_dit_calls import find_dit_calls
from .modes import place_modes
from .independence import check_independence
from .lowmem_terms import place_lowmem_terms
from .pipeline import DEFAULT_PASSES, Stage, run_passes
from .rewrite import rewrite_windows
from .split_batch import split_cfg_batches
from .weights import compute_weights
from .windows import assign_windows

__all__ = [
    "CallSite", "CompileConfig", "DEFAULT_PASSES", "PassContext", "Stage", "Window", "assign_windows",
    "check_frontend", "check_independence", "check_window_inputs", "cleanup", "compute_weights", "find_dit_calls",
    "input_writes", "place_lowmem_terms", "place_modes", "rewrite_windows", "run_passes", "split_cfg_batches",
]
