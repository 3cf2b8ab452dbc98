"""Issue 36 A, B, D: every DiT call runs in the module state it ran in eagerly, whatever the loss
does to the module before, between or after its calls.

The DiT is an affine-Jacobian field (JAGG exact on the chord) whose output depends on
``self.training`` (eval mode scales it by 0.8, as switching dropout off changes a real DiT's
output): a call replayed in the wrong state is off by 20%, never by roundoff. float64, T=8 steps.

* A: a state change after the last call (``dit.eval()`` before ``return``; ``dit.eval()`` first and
  ``dit.train()`` last, "give the module back"), entered in either state: W=2 equals the eager loss
  (value and gradient) on every capture path and backward mode, the module is left as eager leaves it;
* B: ``dit.eval()`` in the middle of the loop: only intercept takes it (``auto`` lands there); the
  calls before the change run in train mode, and the second and third call of the compiled loss
  (entered in the state the first left, and reset) are as right;
* D: ``backward="per_window"`` re-runs each window's knot forward in the state its calls ran in,
  not the one of backward time: W=4, states on each window's chord, exact on FX and intercept.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import grads, reference_jagg, zero_grads
from jaggc import Guard, JaggCaptureError, JaggUnsupportedError, jagg_compile
from jaggc.runtime.module_state import module_state
from jaggc.verify.fields import AffineJacobianField

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

T, B, D = 8, 2, 3
PATHS = ("auto", "fx", "dynamo", "intercept")
MODES = ("joint", "per_window", "lowmem")
EVAL_SCALE = 0.8


class TrainingField(AffineJacobianField):
    """The affine field, scaled by 0.8 in eval mode (J stays affine in (z, t) in both states)."""

    def forward(self, x, timestep):
        return super().forward(x, timestep) * (1.0 if self.training else EVAL_SCALE)


def chord_inputs(seed: int = 0, window: int = 4, windows: list[list[int]] | None = None) -> tuple:
    """(states (T, B, D), times (T, B), upstream (T, B, D)); each window's states on its chord
    (z_k = (1 − α_k) z_a + α_k z_b, α by the per-sample time): JAGG is exact there. ``windows``:
    the windows, where they are not consecutive runs of ``window`` steps."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.2, T, dtype=torch.float64)
    ts = torch.stack([t, t * 0.9], 1)
    zs = torch.empty(T, B, D, dtype=torch.float64)
    for idx in windows or [list(range(lo, min(lo + window, T))) for lo in range(0, T, window)]:
        a, b = idx[0], idx[-1]
        za, zb = (torch.randn(B, D, generator=g, dtype=torch.float64) for _ in range(2))
        for k in idx:
            alpha = ((ts[k] - ts[a]) / (ts[b] - ts[a]))[:, None] if b != a else torch.zeros(B, 1, dtype=torch.float64)
            zs[k] = (1 - alpha) * za + alpha * zb
    gs = torch.randn(T, B, D, generator=g, dtype=torch.float64)
    return zs, ts, gs


def _steps(dit, zs, ts, gs):
    total = 0
    for k in range(zs.shape[0]):
        total = total + (dit(zs[k], ts[k]) * gs[k]).sum()
    return total


def ends_in_eval(dit, zs, ts, gs):
    total = _steps(dit, zs, ts, gs)
    dit.eval()
    return total


def gives_the_module_back(dit, zs, ts, gs):
    dit.eval()
    total = _steps(dit, zs, ts, gs)
    dit.train()
    return total


def eval_from_step_3(dit, zs, ts, gs):
    total = 0
    for k in range(zs.shape[0]):
        if k == 3:
            dit.eval()
        total = total + (dit(zs[k], ts[k]) * gs[k]).sum()
    return total


def set_training(dit, training: bool) -> None:
    dit.train(training)


def eager(loss, dit, args, entry: bool):
    """(value, gradient, the state the loss leaves) of the undecorated loss entered in ``entry``."""
    return compiled_run(loss, dit, args, entry)


def compiled_run(compiled, dit, args, entry: bool | None):
    """(value, gradient, the state it leaves) of ``compiled`` (or the undecorated loss), entered in
    ``entry`` (None: in whatever state the module is in)."""
    if entry is not None:
        set_training(dit, entry)
    zero_grads(dit)
    value = compiled(dit, *args)
    value.backward()
    out = grads(dit).clone()
    zero_grads(dit)
    return value.detach(), out, module_state(dit)


def assert_equal_to_eager(got, want, what):
    (value, grad, state), (ref_value, ref_grad, ref_state) = got, want
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=0, msg=f"{what}: value")
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14, msg=f"{what}: gradient")
    assert state == ref_state, f"{what}: the module is left in another state than the eager loss leaves it"


def _compile(loss, capture, backward, window):
    return jagg_compile(loss, window=window, weights="t", backward=backward, capture=capture)


def refusal_expected(capture: str, backward: str, e: Exception) -> None:
    """The refusals these losses may meet: Dynamo refuses module-state changes, intercept the
    lowmem mode (no graph to prove it); never auto or fx."""
    assert (capture == "dynamo" and isinstance(e, JaggCaptureError)
            or capture == "intercept" and backward == "lowmem" and isinstance(e, JaggUnsupportedError)), repr(e)


def _run_or_refused(compiled, dit, args, entry):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # fallbacks are announced; not what is tested here
        return compiled_run(compiled, dit, args, entry)


# ----------------------------------------------------------------------------- A


@pytest.mark.parametrize("entry", [True, False], ids=["entered_train", "entered_eval"])
@pytest.mark.parametrize("loss", [ends_in_eval, gives_the_module_back], ids=lambda f: f.__name__)
@pytest.mark.parametrize("backward", MODES)
@pytest.mark.parametrize("capture", PATHS)
def test_A_a_state_change_after_the_last_call_stays_after_it(loss, capture, backward, entry):
    dit = TrainingField(D, seed=1)
    args = chord_inputs(0, window=2)
    want = eager(loss, dit, args, entry)
    compiled = _compile(loss, capture, backward, window=2)
    try:
        for call in range(2):       # traced, then cached (FX: the same graph must be right again)
            got = _run_or_refused(compiled, dit, args, entry)
            assert_equal_to_eager(got, want, f"{capture}/{backward}, call {call}")
    except (JaggCaptureError, JaggUnsupportedError) as e:
        refusal_expected(capture, backward, e)


def ends_in_eval_untraceable(dit, zs, ts, gs):
    total = _steps(dit, zs, ts, gs)
    dit.eval()
    assert isinstance(total, torch.Tensor), "FX traces a Proxy here: refused after dit.eval() ran"
    return total


@pytest.mark.parametrize("backward", ["joint", "per_window"])
def test_A_a_path_refusing_after_a_state_change_hands_the_next_one_the_entry_state(backward):
    """FX refuses the loss mid-trace, after its ``dit.eval()`` ran on the real module; Dynamo
    refuses the state change; the intercept fallback must still start in train mode."""
    dit = TrainingField(D, seed=5)
    args = chord_inputs(4, window=2)
    want = eager(ends_in_eval_untraceable, dit, args, True)
    compiled = _compile(ends_in_eval_untraceable, "auto", backward, window=2)
    for call in range(2):
        got = _run_or_refused(compiled, dit, args, True)
        assert compiled.report.path == "intercept"
        assert_equal_to_eager(got, want, f"auto/{backward}, call {call}")


# ----------------------------------------------------------------------------- B


@pytest.mark.parametrize("window", [2, 4])
@pytest.mark.parametrize("backward", MODES)
@pytest.mark.parametrize("capture", PATHS)
def test_B_a_state_change_inside_the_loop(capture, backward, window):
    dit = TrainingField(D, seed=2)
    # at W=4 the windows are cut at the change (one module state per window): [0-2], [3-6], [7]
    windows = [[0, 1, 2], [3, 4, 5, 6], [7]] if window == 4 else None
    args = chord_inputs(1, window=window, windows=windows)
    compiled = _compile(eval_from_step_3, capture, backward, window)
    want_train = eager(eval_from_step_3, dit, args, True)
    want_eval = eager(eval_from_step_3, dit, args, False)
    try:
        got = _run_or_refused(compiled, dit, args, True)
    except (JaggCaptureError, JaggUnsupportedError) as e:
        # fx refuses trained calls in two module states; auto lands on intercept
        if capture == "fx":
            assert isinstance(e, JaggCaptureError) and "another module state" in str(e), e
        else:   # auto lands on intercept here
            refusal_expected("intercept" if capture == "auto" else capture, backward, e)
        return
    assert compiled.report.path == "intercept"
    assert_equal_to_eager(got, want_train, f"{capture}/{backward}")
    if window == 4:
        assert [w.steps for w in compiled.report.windows] == windows, compiled.report.windows
    # called again as the first call left the module (eval): every call in eval mode, as eagerly
    # (the windows [0-3], [4-7] then: compared in value only, the states are off their chord)
    again = _run_or_refused(compiled, dit, args, None)
    if window == 2:
        assert_equal_to_eager(again, want_eval, f"{capture}/{backward}, second call")
    else:
        torch.testing.assert_close(again[0], want_eval[0], rtol=1e-12, atol=0)
        assert again[2] == want_eval[2]
    # and reset to train mode: as the first
    third = _run_or_refused(compiled, dit, args, True)
    torch.testing.assert_close(third[0], got[0], rtol=0, atol=0)
    torch.testing.assert_close(third[1], got[1], rtol=0, atol=0)


def test_B_lowmem_refusal_on_the_intercept_path_says_why_the_graph_paths_were_left():
    """lowmem needs a graph; when FX and Dynamo both decline the mid-loop ``dit.eval()``, the
    refusal on the intercept path names their reasons (it said "see above" with nothing above)."""
    dit = TrainingField(D, seed=2)
    args = chord_inputs(1, window=2)
    for capture, says in (("auto", "fx: "), ("intercept", "capture='intercept'")):
        compiled = _compile(eval_from_step_3, capture, "lowmem", 2)
        with pytest.raises(JaggUnsupportedError) as raised:
            _run_or_refused(compiled, dit, args, True)
        text = str(raised.value)
        assert says in text and "see above" not in text and "backward='joint'" in text, text
        assert dit.training


# ----------------------------------------------------------------------------- D


@pytest.mark.parametrize("loss", [gives_the_module_back, ends_in_eval], ids=lambda f: f.__name__)
@pytest.mark.parametrize("backward", MODES)
@pytest.mark.parametrize("capture", PATHS)
def test_D_windows_run_in_their_calls_state_at_window_4(loss, capture, backward):
    """W=4 on the chord: JAGG is exact, so the compiled loss equals the eager one; entered in
    train mode, the calls of ``gives_the_module_back`` run in eval mode and the loss returns with
    the module in train mode, the state a per-window backward would re-run its knots in."""
    dit = TrainingField(D, seed=3)
    args = chord_inputs(2, window=4)
    want = eager(loss, dit, args, True)
    compiled = _compile(loss, capture, backward, window=4)
    try:
        for call in range(2):
            got = _run_or_refused(compiled, dit, args, True)
            assert_equal_to_eager(got, want, f"{capture}/{backward}, call {call}")
    except (JaggCaptureError, JaggUnsupportedError) as e:
        refusal_expected(capture, backward, e)


@pytest.mark.parametrize("backward", ["joint", "per_window"])
@pytest.mark.parametrize("capture", ["fx", "intercept"])
def test_D_the_guard_probes_in_the_calls_state(capture, backward):
    """The guard's probe (per-window mode: the window's forwards re-run with grad in its backward)
    measures the calls' own state, though the loss returned with the module in train mode: off the
    chord (JAGG not exact), its exact gradient is the eager loss's and the compiled gradient the
    reference JAGG's."""
    dit = TrainingField(D, seed=4)
    args = chord_inputs(3, windows=[[k] for k in range(T)])    # every state drawn on its own
    want = eager(gives_the_module_back, dit, args, True)
    dit.train()
    _, jagg = reference_jagg(gives_the_module_back, (dit, *args), dit, 4, time_arg=1)
    guard = Guard(every=1)
    compiled = jagg_compile(gives_the_module_back, window=4, weights="t", backward=backward, capture=capture,
                            guard=guard)
    value, grad, _ = _run_or_refused(compiled, dit, args, True)
    torch.testing.assert_close(value, want[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, jagg, rtol=1e-12, atol=1e-14)
    assert guard.probed == 1 and guard.last.rel_error > 1e-3     # so the probe can tell the states apart
    torch.testing.assert_close(guard.last.exact, want[1], rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- issue 42
# A state change inside a window, written so that it never reaches a recording proxy's methods: an
# attribute write, or ``nn.Module.train`` called unbound (it sets ``training`` on the object it is
# given). On intercept these once landed on the proxy (the real DiT stayed in its state, JAGG ran
# across the change: 0.88 off, no refusal), on Dynamo they were replayed after the graph.

def _set_attribute(dit, flag):
    dit.training = flag


def _unbound_train(dit, flag):
    torch.nn.Module.train(dit, flag)


def _method(dit, flag):
    dit.train(flag)


def _changes_at_step_3(how, flag):
    def loss(dit, zs, ts, gs):
        total = 0
        for k in range(zs.shape[0]):
            if k == 3:
                how(dit, flag)
            total = total + (dit(zs[k], ts[k]) * gs[k]).sum()
        return total
    return loss


@pytest.mark.parametrize("entry", [False, True], ids=["eval_then_train", "train_then_eval"])
@pytest.mark.parametrize("how", [_method, _set_attribute, _unbound_train], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("window", [2, 4])
@pytest.mark.parametrize("backward", MODES)
@pytest.mark.parametrize("capture", PATHS)
def test_issue42_a_state_change_inside_a_window_splits_it_or_is_refused(capture, backward, window, how, entry):
    """Entered in one state, the other from step 3 (inside the window [0-3] of W=4): intercept (and
    auto, which lands there) splits the window at the change ([0-2] | [3-6] | [7]: states on those
    chords, so JAGG is exact) and equals eager; FX and Dynamo refuse; never JAGG across two states."""
    loss = _changes_at_step_3(how, not entry)
    dit = TrainingField(D, seed=7)
    windows = [[0, 1, 2], [3, 4, 5, 6], [7]] if window == 4 else None
    args = chord_inputs(5, window=window, windows=windows)
    want = eager(loss, dit, args, entry)
    compiled = _compile(loss, capture, backward, window)
    try:
        got = _run_or_refused(compiled, dit, args, entry)
    except (JaggCaptureError, JaggUnsupportedError) as e:
        if capture in ("fx", "dynamo"):
            assert isinstance(e, JaggCaptureError), repr(e)
        else:
            refusal_expected("intercept", backward, e)
        assert dit.training == entry        # refused before anything ran as a window: entry state kept
        return
    assert capture in ("intercept", "auto") and compiled.report.path == "intercept", compiled.report.path
    assert_equal_to_eager(got, want, f"{capture}/{backward}")
    if window == 4:
        assert [w.steps for w in compiled.report.windows] == windows, compiled.report.windows


@pytest.mark.parametrize("how", [_method, _set_attribute], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("backward", ["joint", "per_window"])
def test_issue42_a_state_change_between_two_windows_costs_nothing(backward, how):
    """At a window boundary (step 4 at W=4) the change cuts nowhere new: [0-3] eval, [4-7] train,
    each on its chord, exact; no cut announced."""
    def loss(dit, zs, ts, gs):
        total = 0
        for k in range(zs.shape[0]):
            if k == 4:
                how(dit, True)
            total = total + (dit(zs[k], ts[k]) * gs[k]).sum()
        return total

    dit = TrainingField(D, seed=8)
    args = chord_inputs(6, window=4)
    want = eager(loss, dit, args, False)
    compiled = _compile(loss, "intercept", backward, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)     # no cut announcement
        got = compiled_run(compiled, dit, args, False)
    assert_equal_to_eager(got, want, backward)
    assert [w.steps for w in compiled.report.windows] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_issue42_a_state_change_that_changes_no_function_still_cuts_and_says_so():
    """A DiT whose output does not depend on train/eval (the plain affine field: no dropout, no batch
    norm, no ``self.training``): the window is still cut at the change (the module state decides, not
    function_state.py's reading of the source, which a helper method reading ``self.training`` would
    escape), and the cut is announced with its cost. Values and gradient are eager's."""
    def loss(dit, zs, ts, gs):
        total = 0
        for k in range(zs.shape[0]):
            if k == 3:
                dit.train()
            total = total + (dit(zs[k], ts[k]) * gs[k]).sum()
        return total

    windows = [[0, 1, 2], [3, 4, 5, 6], [7]]
    dit = AffineJacobianField(D, seed=9)
    args = chord_inputs(7, windows=windows)
    want = eager(loss, dit, args, False)
    compiled = _compile(loss, "intercept", "joint", 4)
    with pytest.warns(UserWarning, match="windows were cut between steps 2 and 3.*train/eval mode"):
        got = compiled_run(compiled, dit, args, False)
    assert_equal_to_eager(got, want, "intercept")
    assert [w.steps for w in compiled.report.windows] == windows


def test_issue42_a_window_of_two_states_is_refused_naming_the_step():
    """The runtime's own guarantee, whatever formed the windows: run_trajectory refuses a window whose
    calls were made in two states, naming the step, before any DiT call."""
    from jaggc import JaggError
    from jaggc.runtime.calls import DitCall
    from jaggc.runtime.module_state import CallState
    from jaggc.runtime.trajectory import run_trajectory

    dit = TrainingField(D, seed=1)
    zs, ts, _ = chord_inputs(0)
    calls = [DitCall((zs[k], ts[k]), {}) for k in range(4)]
    dit.eval()
    states = [CallState.of(dit)] * 2
    dit.train()
    states += [CallState.of(dit)] * 2
    with pytest.raises(JaggError, match=r"step 2.*train/eval"):
        run_trajectory(dit, calls, [[0, 1, 2, 3]], states=states)
