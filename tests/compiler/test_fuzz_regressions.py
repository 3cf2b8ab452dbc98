"""Issue 28's reproducers and the differential fuzzer's findings, one regression test each, on every
capture path they reached (float64, a 3-dim affine-Jacobian field, T=4, unless said otherwise).

* A: a parameter term outside the DiT (weight decay, ``next(dit.parameters())``, ``dit.A``) is a
  graph value, not a trace-time constant: right before and after an optimizer step;
* B: a detached DiT output written in place into the next stored state: right at window 2; at
  window 3 the graph paths refuse naming both steps and the line, the intercept path is right;
* C: the same write with the grad-carrying output: refused naming both steps on every path;
* D: in-place writes into the loss's inputs run once on the intercept path (right values,
  gradients and inputs afterwards), and on the graph paths in their traced order;
* E: a state recomputed from the previous detached output: refused naming steps (not a cycle) on
  the graph paths at window 3, right on the intercept path and everywhere at window 2;
* F: many ``jagg_compile``'s of one function stay on Dynamo, each with its own windows;
* a Python-number timestep: the slower windows are announced;
* fuzzer findings: a DiT output written in place (``v.mul_``) on every path (the window's outputs
  were autograd views; intercept's recorded outputs leaves); intercept refused a deterministic loss
  whose state is computed from a float32 DiT's output (batched knots round differently); a read
  of a state before an in-place write that the next step reads after is refused naming the read;
  a graph that writes into its inputs called with inputs that share storage otherwise.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers import grads, reference_jagg, rel_err, zero_grads
from jaggc import JaggCaptureError, JaggGraphError, jagg_compile
from jaggc.verify.fields import AffineJacobianField

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

T, B, D = 4, 2, 3
PATHS = ("fx", "dynamo", "intercept")


def inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.25, T, dtype=torch.float64)
    return dict(lat=torch.randn(B, T + 1, D, generator=g, dtype=torch.float64),
                ts=torch.stack([t, t * 0.95]).contiguous(),
                g=torch.randn(T, B, D, generator=g, dtype=torch.float64),
                out=torch.zeros(T, B, D, dtype=torch.float64))


def copy(batch: dict) -> dict:
    return {k: v.clone() for k, v in batch.items()}


def eager(loss, dit, batch):
    zero_grads(dit)
    value = loss(dit, batch)
    value.backward()
    out = grads(dit).clone()
    zero_grads(dit)
    return value.detach(), out


def compiled_run(compiled, dit, batch):
    zero_grads(dit)
    value = compiled(dit, batch)
    value.backward()
    out = grads(dit).clone()
    zero_grads(dit)
    return value.detach(), out


def jagg_reference(loss, dit, batch: dict, window: int, exact: torch.Tensor, time_arg=1):
    """Plain JAGG of ``loss`` by hand (``reference_jagg``: through the DiT outputs), plus the gradient
    the loss has outside the DiT (a parameter term): the exact gradient minus its part through the
    DiT outputs (``reference_jagg`` at window 1: every call its own knot)."""
    _, through_dit = reference_jagg(loss, (dit, copy(batch)), dit, 1, time_arg=time_arg)
    _, jagg = reference_jagg(loss, (dit, copy(batch)), dit, window, time_arg=time_arg)
    return jagg + (exact - through_dit)


def check_right(loss, capture: str, window: int, *, steps: int = 2, dit=None, tol: float = 1e-10):
    """Value, gradient (exact at window 2, reference JAGG above) and the writes into the inputs
    equal the undecorated loss's, on ``steps`` calls with a parameter step between them."""
    dit = dit or AffineJacobianField(D, seed=1)
    compiled = jagg_compile(loss, window=window, weights="t", capture=capture)
    for call in range(steps):
        if call:
            with torch.no_grad():
                for p in dit.parameters():
                    p.mul_(0.9).add_(0.05)
        batch = inputs(call)
        eager_batch, batch_c = copy(batch), copy(batch)
        value, exact = eager(loss, dit, eager_batch)
        reference = jagg_reference(loss, dit, batch, window, exact)
        got_value, got = compiled_run(compiled, dit, batch_c)
        assert rel_err(got_value, value) < tol, (capture, window, call)
        assert rel_err(got, exact if window == 2 else reference) < 1e-8, (capture, window, call)
        for k in batch:
            assert torch.allclose(batch_c[k], eager_batch[k], rtol=1e-12, atol=1e-12), (capture, k)
    return compiled


# ----------------------------------------------------------------------------- A


def decay_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        total = total + (dit(batch["lat"][:, j], batch["ts"][:, j]) * batch["g"][j]).sum()
    return total + 1e-3 * sum((p ** 2).sum() for p in dit.parameters())


def first_parameter_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        total = total + (dit(batch["lat"][:, j], batch["ts"][:, j]) * batch["g"][j]).sum()
    return total + next(dit.parameters()).pow(2).sum() + (dit.A ** 2).sum()


@pytest.mark.parametrize("loss", [decay_loss, first_parameter_loss])
@pytest.mark.parametrize("capture", PATHS)
@pytest.mark.parametrize("window", [2, 3])
def test_A_parameter_terms_follow_the_parameters(loss, capture, window):
    compiled = check_right(loss, capture, window)
    if capture == "fx":
        code = compiled.report.stages[-1].code
        assert "_tensor_constant" not in code and "live_tensor" in code


# ----------------------------------------------------------------------------- B, C, E


def detached_write_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        v = dit(batch["lat"][:, j].clone(), batch["ts"][:, j])
        batch["lat"][:, j + 1].add_(0.1 * v.detach())
        total = total + (v * batch["g"][j]).sum()
    return total


def grad_write_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        v = dit(batch["lat"][:, j].clone(), batch["ts"][:, j])
        batch["lat"][:, j + 1].add_(0.1 * v)
        total = total + (v * batch["g"][j]).sum()
    return total


def recomputed_state_loss(dit, batch):
    total, previous = 0, None
    for j in range(batch["ts"].shape[1]):
        z = batch["lat"][:, j] if previous is None else batch["lat"][:, j] + 0.1 * previous.detach()
        v = dit(z, batch["ts"][:, j])
        previous = v
        total = total + (v * batch["g"][j]).sum()
    return total


@pytest.mark.parametrize("loss", [detached_write_loss, recomputed_state_loss])
@pytest.mark.parametrize("capture", PATHS + ("auto",))
def test_B_E_states_from_earlier_outputs_are_right_at_window_2(loss, capture):
    check_right(loss, capture, 2)


@pytest.mark.parametrize("loss", [detached_write_loss, recomputed_state_loss])
@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_B_E_graph_paths_refuse_a_window_whose_calls_wait_for_each_other(loss, capture):
    dit = AffineJacobianField(D, seed=1)
    batch = inputs()
    with pytest.raises(JaggCaptureError) as info:
        jagg_compile(loss, window=3, weights="t", capture=capture)(dit, batch)
    text = str(info.value)
    assert re.search(r"step 1 \(.*test_fuzz_regressions.py:\d+\) and step 0", text), text
    assert "cycle" not in text and "intercept" in text
    if loss is detached_write_loss:
        assert re.search(r"in-place write at .*test_fuzz_regressions.py:\d+ \(add_\)", text), text
    assert all(p.grad is None for p in dit.parameters())
    assert torch.equal(batch["lat"], inputs()["lat"])          # refused before anything ran


@pytest.mark.parametrize("loss", [detached_write_loss, recomputed_state_loss])
def test_B_E_intercept_takes_the_window(loss):
    check_right(loss, "intercept", 3)
    with pytest.warns(UserWarning, match="runs through capture path 'intercept'"):
        check_right(loss, "auto", 3, steps=1)


@pytest.mark.parametrize("capture", PATHS + ("auto",))
@pytest.mark.parametrize("window", [2, 3])
def test_C_a_grad_carrying_write_into_a_later_state_is_refused_naming_both_steps(capture, window):
    dit = AffineJacobianField(D, seed=1)
    batch = inputs()
    with pytest.raises(JaggGraphError, match=r"step 1\b.*step 0|step 1: DiT input") as info:
        jagg_compile(grad_write_loss, window=window, capture=capture)(dit, batch)
    if capture != "intercept":
        assert re.search(r"in-place write add_ at .*test_fuzz_regressions.py:\d+", str(info.value))
    assert all(p.grad is None for p in dit.parameters())
    assert torch.equal(batch["lat"], inputs()["lat"])          # intercept undid its recording's write


# ----------------------------------------------------------------------------- D


def scaled_inputs_loss(dit, batch):
    batch["lat"].mul_(0.9)               # before any DiT call: the calls read views of the written storage
    total = 0
    for j in range(batch["ts"].shape[1]):
        v = dit(batch["lat"][:, j], batch["ts"][:, j])
        batch["out"][j] = v.detach()     # an output buffer among the inputs
        total = total + (v * batch["g"][j]).sum()
    return total + batch["out"].sum()


def scaled_state_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        z = batch["lat"][:, j]
        z.mul_(0.9)
        v = dit(z.clone(), batch["ts"][:, j])
        total = total + (v * batch["g"][j]).sum()
    return total


@pytest.mark.parametrize("loss", [scaled_inputs_loss, scaled_state_loss])
@pytest.mark.parametrize("capture", PATHS)
@pytest.mark.parametrize("window", [2, 3])
def test_D_in_place_writes_into_inputs_run_once(loss, capture, window):
    check_right(loss, capture, window)


def test_D_intercept_restores_argument_containers():
    def records_into_its_batch(dit, batch):
        total = 0
        for j in range(batch["ts"].shape[1]):
            total = total + (dit(batch["lat"][:, j], batch["ts"][:, j]) * batch["g"][j]).sum()
        batch.setdefault("calls", []).append(float(total))
        return total

    dit = AffineJacobianField(D, seed=1)
    batch = inputs()
    jagg_compile(records_into_its_batch, window=3, capture="intercept")(dit, batch)
    assert len(batch["calls"]) == 1          # the recording run's append was undone


def test_D_intercept_refuses_a_write_into_the_dit_parameters_naming_the_step():
    def decays_in_the_loss(dit, batch):
        total = 0
        for j in range(batch["ts"].shape[1]):
            total = total + (dit(batch["lat"][:, j], batch["ts"][:, j]) * batch["g"][j]).sum()
            with torch.no_grad():
                dit.A.mul_(0.999)
        return total

    dit = AffineJacobianField(D, seed=1)
    before = dit.A.detach().clone()
    with pytest.raises(JaggCaptureError, match=r"step 1: the loss writes in place .* into 'A' of the DiT"):
        jagg_compile(decays_in_the_loss, window=3, capture="intercept")(dit, inputs())
    assert torch.equal(dit.A, before)               # refused before the write ran


# ----------------------------------------------------------------------------- F and slow


def plain_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        total = total + (dit(batch["lat"][:, j], batch["ts"][:, j]) * batch["g"][j]).sum()
    return total


def test_F_many_compiled_losses_of_one_function_stay_on_dynamo():
    dit = AffineJacobianField(D, seed=1)
    batch = inputs()
    exact = eager(plain_loss, dit, copy(batch))[1]
    for i in range(12):            # Dynamo's recompile limit is 8
        window = 2 + i % 3
        compiled = jagg_compile(plain_loss, window=window, weights="t", capture="dynamo")
        got = compiled_run(compiled, dit, copy(batch))[1]
        assert compiled.report.path == "dynamo"
        _, reference = reference_jagg(plain_loss, (dit, copy(batch)), dit, window, time_arg=1)
        assert rel_err(got, exact if window == 2 else reference) < 1e-10, i


def test_F_compiled_losses_sharing_a_dynamo_graph_keep_their_own_windows():
    dit = AffineJacobianField(D, seed=1)
    three = jagg_compile(plain_loss, window=3, capture="dynamo")
    four = jagg_compile(plain_loss, window=4, capture="dynamo")
    for compiled, windows in ((three, [[0, 1, 2], [3]]), (four, [[0, 1, 2, 3]]), (three, [[0, 1, 2], [3]])):
        compiled(dit, inputs())
        assert [w.steps for w in compiled.report.windows] == windows


class FloatTimeField(AffineJacobianField):
    def forward(self, x, timestep):
        t = torch.as_tensor(timestep, dtype=x.dtype).reshape(-1).expand(x.shape[0])
        return super().forward(x, t)


def float_time_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        total = total + (dit(batch["lat"][:, j], float(batch["ts"][0, j])) * batch["g"][j]).sum()
    return total


@pytest.mark.parametrize("capture", ["fx", "intercept"])
def test_python_number_timesteps_are_announced_as_slower_windows(capture):
    dit = FloatTimeField(D, seed=1)
    with pytest.warns(UserWarning, match=r"windows were cut between steps 0 and 1 .* args\[1\] \(a Python float"):
        compiled = jagg_compile(float_time_loss, window=4, capture=capture)
        compiled(dit, inputs()).backward()
    assert any("Python float" in note for note in compiled.report.notes)


# ----------------------------------------------------------------------------- fuzzer findings


def output_written_loss(dit, batch):
    total = 0
    for j in range(batch["ts"].shape[1]):
        v = dit(batch["lat"][:, j], batch["ts"][:, j])
        v.mul_(0.5)
        v[:, 0] = 0.0
        total = total + (v * batch["g"][j]).sum()
    return total


@pytest.mark.parametrize("capture", PATHS)
@pytest.mark.parametrize("window", [2, 3])
def test_a_dit_output_written_in_place(capture, window):
    check_right(output_written_loss, capture, window)


def test_intercept_takes_a_state_computed_from_a_float32_dit_output():
    # a real SD3: the window's batched knot forward rounds otherwise than the recording's calls
    from jaggc import models

    dit = models.sd3("tiny", seed=0)
    cond = models.sd3_conditioning(dit, B).kwargs
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(B, 4, 4, 8, 8, generator=g)
    ts = torch.tensor([900.0, 700.0, 400.0])

    def loss(transformer, lat):
        total = 0
        for j in range(3):
            v = transformer(hidden_states=lat[:, j].clone(), timestep=ts[j].expand(B), return_dict=False, **cond)[0]
            lat[:, j + 1].add_(0.1 * v.detach())
            total = total + v.square().mean()
        return total

    zero_grads(dit)
    value = loss(dit, lat.clone())
    value.backward()
    zero_grads(dit)
    _, reference = reference_jagg(loss, (dit, lat.clone()), dit, 3, time_arg="timestep")
    got_lat = lat.clone()
    got = jagg_compile(loss, window=3, weights="t", capture="intercept")(dit, got_lat)
    got.backward()
    assert rel_err(got.detach(), value.detach()) < 1e-6
    assert rel_err(grads(dit), reference) < 1e-4
    expected_lat = lat.clone()
    with torch.no_grad():
        loss(dit, expected_lat)
    assert torch.allclose(got_lat, expected_lat, atol=1e-6)


def test_a_read_before_a_write_the_next_step_reads_after_is_refused_naming_the_read():
    def scales_each_state_before_its_step(dit, batch):
        total = 0
        for j in range(len(batch["lat"]) - 1):
            z = batch["lat"][j]
            z.mul_(0.9)                                        # step j+1's write ...
            v = dit(z, batch["ts"][j])
            total = total + ((batch["lat"][j + 1] - v) ** 2).sum()   # ... after step j read it here
        return total

    batch = {"lat": [torch.randn(B, D, dtype=torch.float64) for _ in range(T + 1)],
             "ts": [torch.full((B,), 1.0 - 0.2 * j, dtype=torch.float64) for j in range(T)]}
    dit = AffineJacobianField(D, seed=1)
    with pytest.raises(JaggCaptureError, match=r"the loss reads a tensor at .*py:\d+ .* before the in-place write at"):
        jagg_compile(scales_each_state_before_its_step, window=3, capture="fx")(dit, batch)
    compiled = jagg_compile(scales_each_state_before_its_step, window=3, weights="t")
    eager_batch = {k: [x.clone() for x in v] for k, v in batch.items()}
    value, exact = eager(scales_each_state_before_its_step, dit, eager_batch)
    with pytest.warns(UserWarning, match="intercept"):
        got = compiled(dit, batch)
    assert compiled.report.path == "intercept" and rel_err(got.detach(), value) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(batch["lat"], eager_batch["lat"]))


def aliased_write_loss(dit, states, buffer):
    total = 0
    for j in range(states.shape[0] - 1):
        v = dit(states[j].clone(), torch.full((states.shape[1],), 1.0 - 0.2 * j, dtype=states.dtype))
        buffer[j + 1].copy_(v.detach())                       # aliases the states only if the caller says so
        total = total + (v ** 2).sum()
    return total


@pytest.mark.parametrize("capture", ["fx", "dynamo", "auto"])
def test_a_graph_that_writes_into_its_inputs_is_reused_only_for_the_traced_aliasing(capture):
    dit = AffineJacobianField(D, seed=1)
    compiled = jagg_compile(aliased_write_loss, window=3, weights="t", capture=capture)
    states = torch.randn(T + 1, B, D, dtype=torch.float64)
    compiled(dit, states.clone(), torch.zeros_like(states))          # traced: separate storages
    aliased, eager_states = states.clone(), states.clone()
    # the buffer is now a view of the states (another object: no Dynamo guard sees it), so step j+1
    # reads step j's write
    value = aliased_write_loss(dit, eager_states, eager_states[:])
    if capture != "auto":
        match = "same JAGG window" if capture == "fx" else "share storage differently"
        with pytest.raises(JaggCaptureError, match=match):           # fx traced again, and refused
            compiled(dit, aliased, aliased[:])
        return
    with pytest.warns(UserWarning, match="intercept"):
        got = compiled(dit, aliased, aliased[:])
    assert rel_err(got.detach(), value.detach()) < 1e-12
    assert torch.equal(aliased, eager_states)
