"""The one table of what each backward mode supports (jaggc/backward_modes.py ``SUPPORT``), checked
against what jagg_compile and jaggc.stepwise do in each mode: every column of every row is run, so a
row that claims too much or too little fails here. And the table is the only place that lists the
modes: no string comparison of a mode anywhere else in the compiler."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

import jaggc
from jaggc import jagg_compile
from jaggc.backward_modes import BACKWARD_MODES, SUPPORT, BackwardMode, ModeSupport, backward_mode
from jaggc.errors import JaggError, JaggInputError
from jaggc.runtime.counters import count_dit_passes
from jaggc.runtime.window import WindowOptions
from jaggc.steps import STEPWISE_MODES
from jaggc.verify.fields import AffineJacobianField

ROOT = Path(__file__).resolve().parents[2]
T = 8          # two windows of 4: a window's backward can run before the loss's


def _inputs():
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(1.0, 0.1, T, dtype=torch.float64)
    return (torch.randn(T, 2, 3, generator=g, dtype=torch.float64), torch.stack([t, 0.9 * t], 1),
            torch.randn(T, 2, 3, generator=g, dtype=torch.float64))


def sum_loss(dit, zs, ts, gs):
    total = 0
    for k in range(T):
        total = total + (dit(zs[k], ts[k]) * gs[k]).sum()
    return total


def product_loss(dit, zs, ts, gs):
    """Not a sum of per-step terms."""
    return torch.stack([(dit(zs[k], ts[k]) * gs[k]).sum() for k in range(T)]).prod()


def parameter_term_loss(dit, zs, ts, gs, w):
    """Each term also depends on ``w``, a trainable input outside the DiT."""
    total = 0
    for k in range(T):
        total = total + (dit(zs[k], ts[k]) * gs[k] + w).sum()
    return total


def _runs(compiled, *args) -> bool:
    """Whether the compiled loss runs forward and backward (False: refused with a jaggc error)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(*args).backward()
    except JaggError:
        return False
    return True


def test_the_table_has_one_row_per_mode_and_strings_still_work():
    assert set(SUPPORT) == set(BackwardMode) and BACKWARD_MODES == tuple(BackwardMode)
    assert all(isinstance(row, ModeSupport) for row in SUPPORT.values())
    assert backward_mode("joint") is BackwardMode.JOINT and BackwardMode.LOWMEM == "lowmem"
    assert SUPPORT["per_window"] is SUPPORT[BackwardMode.PER_WINDOW]      # a mode and its string: one key
    assert WindowOptions(backward="lowmem").backward is BackwardMode.LOWMEM
    assert jagg_compile(sum_loss, backward="per_window").config.options.backward is BackwardMode.PER_WINDOW
    with pytest.raises(JaggInputError, match=r"backward='sideways': use one of \('joint', 'per_window', 'lowmem'\)"):
        WindowOptions(backward="sideways")


@pytest.mark.parametrize("mode", list(BackwardMode))
def test_capture_paths(mode):
    for path in ("fx", "intercept"):
        compiled = jagg_compile(sum_loss, window=4, backward=mode, capture=path)
        assert _runs(compiled, AffineJacobianField(3, seed=1), *_inputs()) == (path in mode.support.captures), path


@pytest.mark.parametrize("mode", list(BackwardMode))
def test_routing(mode):
    try:
        jagg_compile(sum_loss, window=4, backward=mode, routing=jaggc.Routing(jagg_frac=0.5))
        accepted = True
    except jaggc.JaggUnsupportedError:
        accepted = False
    assert accepted == mode.support.routing


@pytest.mark.parametrize("mode", list(BackwardMode))
def test_losses_that_are_not_sums_and_parameter_terms(mode):
    model, args = AffineJacobianField(3, seed=1), _inputs()
    assert _runs(jagg_compile(product_loss, window=4, backward=mode), model, *args) == mode.support.any_loss
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ran = _runs(jagg_compile(parameter_term_loss, window=4, backward=mode), model, *args, w)
    assert ran == mode.support.parameter_terms
    assert not ran or w.grad is not None


@pytest.mark.parametrize("mode", list(BackwardMode))
def test_autograd_grad_on_the_loss(mode):
    model = AffineJacobianField(3, seed=1)
    loss = jagg_compile(sum_loss, window=4, backward=mode)(model, *_inputs())
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert all(g is not None for g in grads) == mode.support.autograd_grad
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", list(BackwardMode))
def test_where_the_knot_work_runs(mode):
    model = AffineJacobianField(3, seed=1)
    compiled = jagg_compile(sum_loss, window=4, backward=mode)
    with count_dit_passes(model) as counts:
        loss = compiled(model, *_inputs())
        in_forward = (counts.grad_forwards, counts.backwards)
        loss.backward()
    assert (in_forward[0] == 0) == mode.support.knots_in_backward
    assert (in_forward[1] > 0) == mode.support.backward_in_forward


@pytest.mark.parametrize("mode", list(BackwardMode))
def test_stepwise_forms(mode):
    model = AffineJacobianField(3, seed=1)
    try:
        jaggc.stepwise(model, window=2, backward=mode.value)
        accepted = True
    except JaggInputError:
        accepted = False
    assert accepted == mode.support.stepwise
    assert set(STEPWISE_MODES) == {m for m in BackwardMode if m.support.stepwise}


# ---------------------------------------------------------------------------------------------
# the table is the only place the modes are listed

MODE_NAMES = {m.value for m in BackwardMode}
TABLE = ROOT / "jaggc" / "backward_modes.py"


def mode_string_uses(path: Path) -> list[str]:
    """``file:line`` for each comparison with a mode's string and each literal collection of two or
    more of them (a second list of the modes) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in MODE_NAMES for o in operands):
                found.append(f"{path.name}:{node.lineno}: compares a mode with its string")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in MODE_NAMES]
            if len(names) >= 2:
                found.append(f"{path.name}:{node.lineno}: lists the modes {names}")
    return found


def compiler_files() -> list[Path]:
    return [p for folder in ("jaggc", "passes") for p in sorted((ROOT / folder).rglob("*.py")) if p != TABLE]


def test_no_mode_is_compared_or_listed_outside_the_table():
    found = [use for path in compiler_files() for use in mode_string_uses(path)]
    assert not found, "use BackwardMode and backward_modes.SUPPORT instead:\n" + "\n".join(found)


def test_the_mode_check_sees_a_string_comparison_and_a_second_list(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('if options.backward == "lowmem":\n    pass\nMODES = ("joint", "per_window")\nok = "joint"\n')
    assert [u.split(":")[1] for u in mode_string_uses(bad)] == ["1", "3"]
