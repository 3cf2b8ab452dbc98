"""The condensed view of a report (jaggc/report_view.py): its data model on real compiled examples,
the matplotlib pictures, the text fallback without matplotlib, and ``jaggc inspect --view``."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest

import jaggc
from jaggc import report_drawing
from jaggc.cli import main
from jaggc_studies.example_losses import build_example
from jaggc.graph_ops import is_runtime_target
from jaggc.node_meta import CALL, WINDOW
from jaggc.passes.modes import is_grad_switch
from jaggc.report_drawing import render_images
from jaggc.report_view import ROLE_LETTER, condensed_view, to_condensed_dot, to_text

pytestmark = pytest.mark.usefixtures("one_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def reports():
    """Reports of the built-in examples (8 steps, batch 2), built once: {(name, window): report}."""
    cache = {}

    def get(name: str, window: int = 4, **options):
        key = (name, window, tuple(sorted(options.items())))
        if key not in cache:
            ex = build_example(name, num_steps=8, batch=2, seed=0)
            options.setdefault("weights", "t")     # the CLI's default: plain JAGG
            cache[key] = jaggc.explain(ex.loss_fn, ex.model, ex.batch, window=window, **options)
        return cache[key]

    return get


def _user_ops(report) -> int:
    """The ops of the graph that are neither DiT calls, jaggc's runtime nodes nor grad-mode switches
    (no data flows through those: they belong to no step)."""
    return sum(1 for n in report.graph_module.graph.nodes
               if n.op in ("call_function", "call_method", "call_module") and not CALL.on(n)
               and not WINDOW.on(n) and not is_runtime_target(n) and not is_grad_switch(n))


# --------------------------------------------------------------------------- the data model
def test_window_4_columns_roles_timesteps_and_backward_counts(reports):
    report = reports("flow_grpo_sd3")
    view = condensed_view(report, name="flow_grpo_sd3")
    assert [c.step for c in view.steps] == list(range(8))
    assert (view.backward_before, view.backward_after) == (8, 2) == (report.backward_before, report.backward_after)
    assert [w.window for w in view.windows] == [0, 1]
    for row, box in zip(report.windows, view.windows):
        assert box.steps == row.steps and box.mode == "jagg" and box.basis == "linear/t"
        assert box.knot_steps == [row.steps[0], row.steps[-1]]
        assert len(box.timesteps) == 4 and box.timesteps == row.timesteps
        cols = [c for c in view.steps if c.window == row.window]
        # the same K/i string the window table prints
        assert " ".join(ROLE_LETTER[c.role] for c in cols) == row.roles() == "K i i K"
        assert [c.timestep for c in cols] == row.timesteps
    assert view.steps[0].timestep == pytest.approx(1000.0)
    # every interior step's weights: over its window's two knots, a convex pair
    for c in view.steps:
        if c.role == "interior":
            box = view.windows[c.window]
            assert sorted(c.weights) == box.knot_steps
            assert sum(c.weights.values()) == pytest.approx(1.0) and all(0 < v < 1 for v in c.weights.values())
        else:
            assert c.weights == {}
    # t falls from 1000 towards 834 across window 0: step 1 leans on its left knot, step 2 on its right
    assert view.steps[1].weights[0] > 0.5 > view.steps[2].weights[0]
    assert view.strip() == ("step 0 K | step 1 i | step 2 i | step 3 K || "
                            "step 4 K | step 5 i | step 6 i | step 7 K")


def test_every_op_goes_to_one_step_the_reduction_or_the_shared_inputs(reports):
    report = reports("flow_grpo_sd3")
    view = condensed_view(report)
    glue = [c.glue_ops for c in view.steps]
    assert sum(glue) + view.reduction_ops + view.shared_ops == _user_ops(report)
    # the same per-step math in every step (step 0 also owns the running sum's first add, 0.0 + term)
    assert len(set(glue[1:])) == 1 and glue[1] > 20 and glue[0] == glue[1] + 1
    # 7 adds of the running sum and the division by the step count
    assert view.reduction_ops == 8 and view.shared_ops == 0
    assert view.reference_calls == 0 and all(c.reference_calls == 0 for c in view.steps)


def test_window_2_is_all_exact(reports):
    report = reports("flow_grpo_sd3", window=2)
    view = condensed_view(report)
    assert len(view.steps) == 8 and len(view.windows) == 4
    assert {c.role for c in view.steps} == {"exact"}
    assert all(w.mode == "exact" and w.knot_steps == [] for w in view.windows)
    assert all(c.weights == {} for c in view.steps)
    assert (view.backward_before, view.backward_after) == (8, 8)
    assert view.strip().count("||") == 3 and "step 7 E" in view.strip()


def test_reference_calls_are_counted_per_step(reports):
    report = reports("kl_reference_sd3")
    view = condensed_view(report)
    assert report.reference_calls == view.reference_calls == 8
    assert [c.reference_calls for c in view.steps] == [1] * 8 and view.unattributed_references == 0
    assert " ".join(ROLE_LETTER[c.role] for c in view.steps) == "K i i K K i i K"
    # the reference's own log-prob math counts as its step's glue, so the steps' glue grows
    plain = condensed_view(reports("flow_grpo_sd3"))
    assert view.steps[3].glue_ops > plain.steps[3].glue_ops
    assert sum(c.glue_ops for c in view.steps) + view.reduction_ops + view.shared_ops == _user_ops(report)
    assert "step 0 K+1r | step 1 i+1r" in view.strip()


def test_intercept_report_has_columns_but_no_op_counts(reports):
    report = reports("flow_grpo_sd3", capture="intercept")
    assert report.graph_module is None
    view = condensed_view(report)
    assert " ".join(ROLE_LETTER[c.role] for c in view.steps) == "K i i K K i i K"
    assert all(c.glue_ops is None for c in view.steps) and view.reduction_ops is None


# --------------------------------------------------------------------------- the pictures
def _check_svg(path, *texts):
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    body = open(path).read()
    for t in texts:
        assert t in body, f"{t!r} not in {path}"


def test_render_writes_png_and_svg(reports, tmp_path):
    view = condensed_view(reports("kl_reference_sd3"), name="kl_reference_sd3")
    paths = render_images(view, str(tmp_path / "kl"))
    assert paths == [str(tmp_path / "kl.png"), str(tmp_path / "kl.svg")]
    png = (tmp_path / "kl.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    # text stays text in the SVG: the title, the window labels, the columns
    _check_svg(tmp_path / "kl.svg", "DiT backward passes 8 → 2", "window 0 · jagg", "window 1 · jagg",
               "step 7", "no grad", "reduction to the loss")


def test_render_exact_windows_and_report_method(reports, tmp_path):
    paths = reports("flow_grpo_sd3", window=2).render_condensed(str(tmp_path / "exact"), name="w2")
    assert [p.rsplit(".", 1)[1] for p in paths] == ["png", "svg"]
    assert (tmp_path / "exact.png").read_bytes().startswith(PNG_MAGIC)
    _check_svg(tmp_path / "exact.svg", "w2: DiT backward passes 8 → 8", "exact")


def test_text_fallback_without_matplotlib(reports, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` now raises ImportError
    assert report_drawing.matplotlib_missing() is not None
    with pytest.raises(ImportError):
        render_images(condensed_view(reports("flow_grpo_sd3")), str(tmp_path / "x"))
    paths = reports("flow_grpo_sd3").render_condensed(str(tmp_path / "flow"), name="flow")
    assert paths == [str(tmp_path / "flow.txt")]
    assert not (tmp_path / "flow.png").exists() and not (tmp_path / "flow.svg").exists()
    text = (tmp_path / "flow.txt").read_text()
    assert text.startswith("flow: DiT backward passes 8 -> 2")
    assert reports("flow_grpo_sd3").table() in text
    assert "step 0 K | step 1 i | step 2 i | step 3 K || step 4 K" in text


def test_text_and_dot(reports):
    view = condensed_view(reports("kl_reference_sd3"), name="kl")
    text = to_text(view)
    assert "glue ops per step: " in text and "reduction to the loss: 15 ops" in text
    dot = to_condensed_dot(view)
    assert dot.startswith("digraph jagg_condensed {") and dot.rstrip().endswith("}")
    assert dot.count("subgraph cluster_w") == 2 and dot.count('[label="step ') == 8
    assert dot.count("no-grad DiT x1") == 8 and dot.count("-> loss;") == 8


# --------------------------------------------------------------------------- the CLI
def test_cli_inspect_writes_condensed_and_full(tmp_path, capsys):
    out = tmp_path / "inspect"
    assert main(["inspect", "flow_grpo_sd3", "--steps", "4", "--view", "both", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    png, svg = out / "flow_grpo_sd3.png", out / "flow_grpo_sd3.svg"
    assert png.read_bytes().startswith(PNG_MAGIC)
    _check_svg(svg, "flow_grpo_sd3: DiT backward passes 4 → 1", "window 0 · jagg")
    full = [p for p in out.iterdir() if p.name.startswith("flow_grpo_sd3.full.")]
    assert [p.suffix for p in full] in ([".dot"], [".svg"])
    assert (out / "flow_grpo_sd3.diff").read_text().startswith("--- capture")
    for p in (png, svg, full[0], out / "flow_grpo_sd3.diff"):
        assert str(p) in printed


def test_cli_inspect_default_view_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "inspect"
    assert main(["inspect", "flow_grpo_sd3", "--steps", "3", "--window", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "matplotlib is not importable" in printed
    assert sorted(p.name for p in out.iterdir()) == ["flow_grpo_sd3.diff", "flow_grpo_sd3.txt"]
    assert "step 0 K | step 1 i | step 2 K" in (out / "flow_grpo_sd3.txt").read_text()
