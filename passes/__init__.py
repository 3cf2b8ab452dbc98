"""jaggc's graph passes (installed as ``jaggc.passes``). Each is a ``GraphPass`` (infra.py): a
function ``fn(gm, ctx) -> gm`` with the facts it requires and provides and its invariant as an
executable ``ensures``; ``run_passes`` runs them in ``DEFAULT_PASSES`` order with a lint and a
snapshot after each (and the ensures, when checks are requested)."""

from jaggc.alias_roots import input_writes   # the frontends' check lives below the passes; this path kept

from .check_frontend import check_frontend
from .cleanup import cleanup
from .context import CallSite, CompileConfig, PassContext, Window
from .effects import check_window_inputs
from .find_dit_calls import find_dit_calls
from .infra import GraphPass, check_order, graph_pass
from .modes import place_modes, tag_modes
from .independence import check_independence
from .lowmem_terms import place_lowmem_terms
from .pipeline import DEFAULT_PASSES, Stage, passes_for, run_passes
from .rewrite import rewrite_windows
from .split_batch import split_cfg_batches
from .weights import compute_weights
from .windows import assign_windows

__all__ = [
    "CallSite", "CompileConfig", "DEFAULT_PASSES", "GraphPass", "PassContext", "Stage", "Window", "assign_windows",
    "check_frontend", "check_independence", "check_order", "check_window_inputs", "cleanup", "compute_weights",
    "find_dit_calls", "graph_pass", "input_writes", "passes_for", "place_lowmem_terms", "place_modes",
    "rewrite_windows", "run_passes", "split_cfg_batches", "tag_modes",
]
