"""The three recipes of docs/layout.md ("where a new pass, a new frontend and a new backward mode go"),
each checked: a test here fails if its recipe stops being true."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import jaggc
from jaggc import backward_modes, options
from jaggc.backward_modes import ModeSupport
from jaggc.errors import JaggInternalError
from jaggc.frontends import registry
from jaggc.passes import infra, pipeline
from jaggc.passes.infra import Fact, graph_pass
from jaggc.verify.fields import AffineJacobianField

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = (ROOT / "docs" / "layout.md").read_text()

from test_backward_modes import compiler_files, mode_string_uses   # noqa: E402  (the scan of the mode check)


def _loss(dit, zs, ts, gs):
    return sum((dit(zs[k], ts[k]) * gs[k]).sum() for k in range(zs.shape[0]))


def _inputs(T=6):
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    return (torch.randn(T, 2, 3, generator=g, dtype=torch.float64), torch.stack([t, 0.9 * t], 1),
            torch.randn(T, 2, 3, generator=g, dtype=torch.float64))


def test_each_recipe_names_its_test():
    for name in ("test_a_new_pass_goes_in_the_pipeline_with_its_requires_checked",
                 "test_every_frontend_is_a_contract_frontend_in_the_table",
                 "test_the_mode_table_is_the_only_list_of_modes_and_every_column_is_read"):
        assert f"tests/repository/test_layout_recipes.py::{name}" in LAYOUT and name in globals(), name


# --------------------------------------------------------------------------------------------- a new pass

seen_windows: list[int] = []


@graph_pass(requires={Fact.WINDOWS}, provides={Fact.WINDOWS})   # a transform (an analysis whose facts hold is skipped)
def count_windows(gm, ctx):
    """Record how many windows the loss has (a toy analysis, registered as the recipe says)."""
    seen_windows.append(len(ctx.windows))


def test_a_new_pass_goes_in_the_pipeline_with_its_requires_checked(monkeypatch):
    order = list(pipeline.DEFAULT_PASSES)
    after = order.index(jaggc.passes.assign_windows) + 1
    monkeypatch.setattr(pipeline, "DEFAULT_PASSES", tuple(order[:after] + [count_windows] + order[after:]))
    seen_windows.clear()
    compiled = jaggc.jagg_compile(_loss, window=3)
    compiled(AffineJacobianField(3, seed=1), *_inputs()).backward()
    assert seen_windows == [2] and "count_windows" in [s.name for s in compiled.report.stages]
    # put before the facts it needs, the same pass is refused before any pass runs
    early = tuple([count_windows] + order)
    monkeypatch.setattr(pipeline, "DEFAULT_PASSES", early)
    with pytest.raises(JaggInternalError, match=r"pass count_windows requires \['windows'\]"):
        jaggc.jagg_compile(_loss, window=3, capture="fx")(AffineJacobianField(3, seed=1), *_inputs())
    with pytest.raises(ValueError):      # facts are symbols: a misspelt one fails where it is declared
        graph_pass(requires={"window"}, provides={Fact.WINDOWS})(count_windows.fn)
    assert all(p.__doc__ for p in pipeline.DEFAULT_PASSES)
    assert infra.RUNNABLE   # the facts a last pass must leave


# ----------------------------------------------------------------------------------------- a new frontend

def test_every_frontend_is_a_contract_frontend_in_the_table():
    frontends = jaggc.jagg_compile(_loss)._session.frontends    # one per registry line
    assert tuple(frontends) == registry.auto_order() and set(frontends) == set(options.CAPTURES) - {"auto"}
    for name, frontend in frontends.items():
        cls = type(frontend)
        assert frontend.name == name and callable(frontend.run) and callable(frontend.reset), name
        assert list(inspect.signature(cls.__init__).parameters) == ["self", "session", "qualname"], name
        module = Path(inspect.getfile(cls))
        assert module.parent == ROOT / "jaggc" / "frontends", module
        imports = [n for n in ast.walk(ast.parse(module.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not [n for n in imports if "passes" in (getattr(n, "module", None) or "")], module


# ------------------------------------------------------------------------------------ a new backward mode

def test_the_mode_table_is_the_only_list_of_modes_and_every_column_is_read():
    found = [use for path in compiler_files() for use in mode_string_uses(path)]
    assert not found, found
    columns = [f.name for f in ModeSupport.__dataclass_fields__.values()]
    source = "\n".join(p.read_text() for p in compiler_files())
    behaviour = (ROOT / "tests" / "compiler" / "test_backward_modes.py").read_text()
    # every column is read by the code that refuses or branches (the stepwise column: by STEPWISE_MODES)
    unread = [c for c in columns if not re.search(rf"support\.{c}\b|modes_where\(\"{c}\"\)|'{c}'", source)
              and c not in backward_modes.DOCUMENTED_ONLY]
    assert not unread, f"SUPPORT columns no refusal or branch reads: {unread}"
    unchecked = [c for c in columns if f"support.{c}" not in behaviour]
    assert not unchecked, f"SUPPORT columns tests/compiler/test_backward_modes.py does not check: {unchecked}"
    assert set(backward_modes.SUPPORT) == set(backward_modes.BackwardMode)
    assert set(backward_modes.DOCUMENTED_ONLY) <= set(columns)
