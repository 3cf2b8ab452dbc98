"""The vocabulary the frontends, passes and runtime share lives below the frontends (issue 35):
``CompileConfig`` (jaggc/config.py), ``CallSite``/``Window`` (jaggc/call_site.py), ``input_writes``
(jaggc/alias_roots.py) and the backward modes (jaggc/backward_modes.py). So the frontend contract and
the node facts name real types, api.py imports the pass pipeline like any module, and no frontend is
handed a pass function; the old import paths still work."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import jaggc
import jaggc.node_meta as node_meta
from jaggc.alias_roots import input_writes
from jaggc.backward_modes import BackwardMode
from jaggc.call_site import CallSite, Window
from jaggc.config import CompileConfig
from jaggc.frontends.contract import Session
from jaggc.frontends.dynamo_runner import DynamoFrontend
from jaggc.frontends.fx_runner import FxFrontend
from jaggc.frontends.intercept_runner import InterceptFrontend
from jaggc.runtime.autocast import AutocastState
from jaggc.runtime.window import WindowOptions

ROOT = Path(__file__).resolve().parents[2]


def test_the_contract_and_the_node_facts_carry_real_types():
    assert typing.get_type_hints(Session)["config"] is CompileConfig
    hints = typing.get_type_hints(node_meta)
    assert hints["CALL"] == node_meta.Fact[CallSite] and hints["AUTOCAST"] == node_meta.Fact[AutocastState]
    assert WindowOptions.__dataclass_fields__["backward"].type == "BackwardMode"     # (its module: TYPE_CHECKING names)
    assert isinstance(WindowOptions().backward, BackwardMode)
    assert typing.get_type_hints(jaggc.passes.PassContext)["windows"] == list[Window]


def test_the_session_imports_the_pass_pipeline_at_module_level():
    # the compile session (session.py, what the frontends share) runs the passes; api.py holds the
    # user's object only
    tree = ast.parse((ROOT / "jaggc" / "session.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert any(n.module == "passes" and n.level == 1 and {"run_passes", "PassContext"} <= {a.name for a in n.names}
               for n in top)
    lazy = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and n not in tree.body]
    assert not [n for n in lazy if "passes" in (getattr(n, "module", None) or "") or
                any("passes" in a.name for a in n.names)], "a lazy import of the passes is left in session.py"


def test_no_frontend_constructor_carries_a_pass_function():
    for frontend in (FxFrontend, DynamoFrontend, InterceptFrontend):
        assert list(inspect.signature(frontend.__init__).parameters) == ["self", "session", "qualname"], frontend


def test_the_old_import_paths_still_work():
    from jaggc.passes import CallSite as site, CompileConfig as config, Window as window, input_writes as writes
    from jaggc.passes.context import CompileConfig as context_config

    assert (site, config, window, writes, context_config) == (CallSite, CompileConfig, Window, input_writes,
                                                               CompileConfig)
