"""``jaggc.verify``: the sympy proofs, the hypothesis property checks, check_model, the CLI.

The properties run with a handful of examples here (the full search is ``jaggc verify
--profile thorough``); what is checked is that the exact properties hold to roundoff, that the
counterexample properties find and shrink a counterexample, that the runner itself reports a
violation, and that the CLI's exit code and JSON follow the documented format.
"""

from __future__ import annotations

import json

import pytest

from jaggc.verify import model_check, properties, serving_properties, symbolic
from jaggc.verify.cli import main_verify

EXAMPLES = 5


# ----------------------------------------------------------------------------- symbolic

@pytest.fixture(scope="module")
def proof_lines():
    return symbolic.prove_all()


def test_symbolic_proofs_all_hold(proof_lines):
    assert proof_lines and all(line.ok for line in proof_lines), symbolic.transcript(proof_lines)
    text = symbolic.transcript(proof_lines)
    assert f"{len(proof_lines)}/{len(proof_lines)} hold" in text


def test_symbolic_covers_every_claim(proof_lines):
    claims = [line.claim for line in proof_lines]
    for w in range(2, 9):
        assert any(c.startswith(f"(a) W={w}:") for c in claims)
    assert any("for every W" in c for c in claims)
    for tag in ("(b)", "(c)", "(d)", "(e)"):
        assert any(c.startswith(tag) for c in claims), tag
    # identities simplify to 0; the two "nonzero" results carry the spec's numbers
    a_lines = [line for line in proof_lines if line.claim.startswith("(a) W=")]
    assert all(line.result.strip("Matrix([]) ,0") == "" for line in a_lines)
    c1 = next(line for line in proof_lines if "C1" in line.claim)
    assert "residual=1" in c1.result and "JAGG=0" in c1.result
    grid = next(line for line in proof_lines if "shift-3 grid" in line.claim)
    assert "1/20" in grid.result


# ----------------------------------------------------------------------------- properties

EXACT = [name for name, fn in properties.PROPERTIES.items()
         if name not in ("off_chord_affine", "curved_field", "index_weights_grid")]
NEGATIVE = ["off_chord_affine", "curved_field", "index_weights_grid"]


@pytest.mark.parametrize("name", EXACT)
def test_exact_property_holds(name):
    r = properties.PROPERTIES[name](EXAMPLES, 0)
    assert r.kind == "exact" and r.name == name
    assert r.passed, r.counterexample
    assert r.examples == EXAMPLES
    assert r.max_rel_err < 1e-12


@pytest.mark.parametrize("name", NEGATIVE)
def test_counterexample_property_finds_and_shrinks(name):
    r = properties.PROPERTIES[name](EXAMPLES, 0)
    assert r.kind == "counterexample" and r.passed, r.detail
    assert r.counterexample is not None and r.max_rel_err > properties.TOL
    # shrunk to the smallest window
    assert r.counterexample.startswith("W=3, ")
    if name == "index_weights_grid":
        assert "shift=1," not in r.counterexample  # a uniform grid cannot be a counterexample


def test_exact_runner_reports_a_shrunk_violation():
    # a curved field checked as if it were exact must fail, with a counterexample
    def check(case, seed):
        return properties._check_curved(case, seed)
    r = properties.run_exact_property("curved_as_exact", properties._curved_case(), check, EXAMPLES, 0)
    assert not r.passed and r.counterexample.startswith("W=3, D=1") and "rel_err=" in r.counterexample


def test_counterexample_runner_reports_none_found():
    r = properties.run_counterexample_property(
        "e1_as_counterexample", properties._window_case(3, 4), properties._check_e1_run_window, 3, 0)
    assert not r.passed and r.counterexample is None and r.max_rel_err < 1e-12


def test_adjoint_check_detects_a_wrong_backward(monkeypatch):
    # a backward that is not the adjoint (composites scaled by 2) must be caught
    from jaggc.runtime.aggregate import KnotAggregate

    original = KnotAggregate.backward

    def wrong(ctx, *grads):
        out = original(ctx, *grads)
        return (out[0], 2 * out[1]) + out[2:]
    monkeypatch.setattr(KnotAggregate, "backward", staticmethod(wrong))
    r = properties.aggregate_adjoint(3, 0)
    assert not r.passed


# ----------------------------------------------------------------------------- real model

def test_check_model_tiny_sd3_window2_is_exact():
    from jaggc import models

    dit = models.sd3("tiny")
    result = model_check.check_model(dit, model_check.sd3_trajectory_factory(dit, num_steps=4),
                                    windows=(2, 4), trajectories=1)
    assert set(result) == {2, 4}
    assert result[2]["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert result[2]["rel_err"] < 1e-5
    for w in (4,):
        assert 0.5 < result[w]["cosine"] <= 1.0 + 1e-9
    table = str(result)
    assert "cosine" in table and table.count("\n") == 3


# ----------------------------------------------------------------------------- CLI

def test_cli_json_and_exit_code(tmp_path, capsys):
    path = tmp_path / "verify.json"
    rc = main_verify(["--examples", "5", "--suite", "runtime", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "all checks passed" in out and "counterexamples found and shrunk: 4/4" in out
    entries = json.loads(path.read_text())
    assert isinstance(entries, list)
    names = [e["name"] for e in entries]
    assert names == ["symbolic"] + list(properties.PROPERTIES) + list(serving_properties.PROPERTIES)
    for e in entries:
        assert {"name", "kind", "passed", "examples", "max_rel_err"} <= set(e)
        assert e["kind"] in ("symbolic", "exact", "counterexample") and e["passed"] is True
        assert isinstance(e["examples"], int) and isinstance(e["max_rel_err"], float)


def test_cli_exit_code_on_a_violated_property(monkeypatch, capsys):
    def broken(examples, seed):
        return properties.PropertyResult("broken", "exact", False, examples, 1.0, "W=3 -> rel_err=1")
    monkeypatch.setattr(properties, "PROPERTIES", {"broken": broken})
    assert main_verify(["--examples", "2", "--suite", "runtime", "--no-symbolic"]) == 1
    assert "FAILED" in capsys.readouterr().out
