"""Where errors point (jaggc/source.py): the user's line, jaggc's and torch's own frames skipped by
module, so a project in a folder named ``jaggc`` keeps its locations (issue 30)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import jaggc
import jaggc.grpo
import jaggc.passes.pipeline
from jaggc import source


def test_internal_files_are_jaggcs_machinery_and_torch_not_a_path_piece(tmp_path):
    assert source.is_internal_file(jaggc.api.__file__)
    assert source.is_internal_file(jaggc.frontends.fx.__file__)
    assert source.is_internal_file(torch.nn.modules.module.__file__)
    assert source.is_internal_file(jaggc.passes.pipeline.__file__)
    # user code, wherever it lives
    user = tmp_path / "jaggc" / "frontends" / "train.py"
    user.parent.mkdir(parents=True)
    user.write_text("x = 1\n")
    assert not source.is_internal_file(str(user))
    assert not source.is_internal_file(__file__)
    # the helpers users call inside their losses keep their lines
    assert not source.is_internal_file(jaggc.grpo.__file__)


def test_traceback_and_stack_locations_skip_internal_frames():
    try:
        jaggc.jagg_compile(lambda dit: dit, window=1)
    except jaggc.JaggError as e:
        where = source.traceback_location(e)
    assert where.startswith(__file__ + ":"), where

    class Frame:
        def __init__(self, filename, lineno):
            self.filename, self.lineno = filename, lineno

    stack = [Frame(__file__, 10), Frame(jaggc.api.__file__, 5), Frame(jaggc.grpo.__file__, 7)]
    assert source.stack_location(stack) == f"{__file__}:10 (in {jaggc.grpo.__file__}:7)"
    assert source.stack_location(stack[:2]) == f"{__file__}:10"
    assert source.stack_location([Frame(jaggc.api.__file__, 5)]) == ""


def test_user_frame_is_the_callers_frame():
    frame = source.user_frame()
    assert frame is sys._getframe()   # a live frame: its location is the line it runs now
    assert source.frame_location(frame) == f"{__file__}:{sys._getframe().f_lineno}"
    assert "test_user_frame_is_the_callers_frame" in source.frame_traceback_line(frame)


def test_a_loss_in_a_folder_named_jaggc_keeps_its_line_on_every_path(tmp_path):
    """The fresh-clone bug: user code under .../jaggc/ lost its file:line in Dynamo-path errors."""
    folder = tmp_path / "jaggc"
    folder.mkdir()
    (folder / "my_loss.py").write_text(textwrap.dedent("""\
        import torch, jaggc
        from jaggc.verify.fields import AffineJacobianField

        def loss(dit, zs, ts):
            total = 0.0
            for k in range(zs.shape[0]):
                v = dit(zs[k], ts[k])
                if v.sum() > 0:          # data-dependent: Dynamo breaks the graph here
                    total = total + v.sum()
            return total

        model = AffineJacobianField(3, seed=0)
        zs, ts = torch.randn(4, 2, 3, dtype=torch.float64), torch.rand(4, 2, dtype=torch.float64)
        for capture in ("dynamo", "fx"):
            try:
                jaggc.jagg_compile(loss, window=2, capture=capture)(model, zs, ts)
            except jaggc.JaggError as e:
                print(capture, str(e).splitlines()[0][:200])
        """))
    out = subprocess.run([sys.executable, "my_loss.py"], cwd=folder, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert set(lines) == {"dynamo", "fx"}, out.stdout
    for capture, message in lines.items():
        assert f"{folder / 'my_loss.py'}:8" in message, (capture, message)
