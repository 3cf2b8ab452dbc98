"""The window runtime computes the exact gradient exactly where the spec (§2.1) says it must.

Every test runs in float64 on velocity fields with a known Jacobian structure
(``jaggc.verify.fields``), with the linear loss L = Σ_k <v_k, g_k> so that the upstream gradient
g_k of every step is chosen by the test:
  * E1 (J affine in (z, t), states on the chord) and E2 (J free of z, affine in t): JAGG equals
    the per-step gradient to 1e-10 relative;
  * the counterexamples C1/C2 reproduce with the spec's exact numbers;
  * curved fields and off-chord states give a clearly nonzero error (so the exact tests can fail);
  * values are the per-step values, pass counts are what the cost model says, the JAGG gradient
    is linear in the upstream gradients, and the other bases keep their own exactness.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import jaggc
from helpers import grad_of, loss_and_grad, rel_err
from jaggc import Basis, DitCall, WindowOptions, count_dit_passes, jagg_calls, run_exact, run_window
from jaggc.runtime import partition
from jaggc.runtime.weights import control_matrix, hat_matrix, randomized_matrix
from jaggc.verify.fields import AffineJacobianField, CurvedField, LinearThetaZ, ThetaT, TimeAffineField

DT = torch.float64
EXACT_TOL = 1e-10
CLEARLY_WRONG = 1e-3


# ----------------------------------------------------------------------------- trajectories

def shift3_sigmas(num_steps: int) -> torch.Tensor:
    """SD3's shift-3 schedule σ' = 3σ/(1+2σ) of linspace(1, 0, num_steps + 1): non-uniform."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=DT)
    return 3 * s / (1 + 2 * s)


def window_times(gen: torch.Generator, window: int, batch: int, per_sample: bool) -> torch.Tensor:
    """(W, B) timesteps: a random W-step slice of a random-length shift-3 schedule; with
    ``per_sample`` every sample draws its own schedule length and slice."""
    def one() -> torch.Tensor:
        n = int(torch.randint(window - 1, 25, (), generator=gen))  # n + 1 >= W grid points
        start = int(torch.randint(0, n + 2 - window, (), generator=gen))
        return shift3_sigmas(n)[start:start + window]
    if per_sample:
        return torch.stack([one() for _ in range(batch)], 1)
    return one()[:, None].expand(window, batch).clone()


def chord_states(gen: torch.Generator, times: torch.Tensor, dim: int) -> torch.Tensor:
    """(W, B, D) states z_k = (1 − α_k) z_a + α_k z_b with α_k from each sample's own t."""
    window, batch = times.shape
    z_a = torch.randn(batch, dim, generator=gen, dtype=DT)
    z_b = torch.randn(batch, dim, generator=gen, dtype=DT)
    alpha = ((times - times[0]) / (times[-1] - times[0]))[..., None]
    return (1 - alpha) * z_a + alpha * z_b


def random_states(gen: torch.Generator, times: torch.Tensor, dim: int) -> torch.Tensor:
    window, batch = times.shape
    return torch.randn(window, batch, dim, generator=gen, dtype=DT)


def make_calls(states: torch.Tensor, times: torch.Tensor, *, keyword: bool = False,
               scalar_time: bool = False) -> list[DitCall]:
    """One DitCall per step. ``scalar_time`` passes a 0-d timestep (needs a shared grid)."""
    calls = []
    for z, t in zip(states, times):
        tt = t[0].clone() if scalar_time else t
        calls.append(DitCall((z,), {"timestep": tt}) if keyword else DitCall((z, tt)))
    return calls


def upstream(gen: torch.Generator, window: int, batch: int, dim: int) -> list[torch.Tensor]:
    return [torch.randn(batch, dim, generator=gen, dtype=DT) for _ in range(window)]


def exact_and_jagg(field: nn.Module, calls, gs, *, options: WindowOptions = WindowOptions()):
    exact = grad_of(field, lambda: run_exact(field, calls), gs)
    jagg = grad_of(field, lambda: run_window(field, calls, options=options), gs)
    return exact, jagg


class QuadraticPathField(nn.Module):
    """v = t·M(θ) z + t²·sinh(u) + c(θ) + φ(z, t): along a chord (z affine in t) J is quadratic in
    t, so the three-knot Lagrange basis is exact and the two-knot linear basis is not."""

    def __init__(self, dim: int, *, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(torch.randn(dim, dim, generator=g, dtype=DT) * 0.5)
        self.u = nn.Parameter(torch.randn(dim, generator=g, dtype=DT) * 0.5)
        self.c = nn.Parameter(torch.randn(dim, generator=g, dtype=DT) * 0.5)

    def forward(self, x, timestep):
        t = timestep.to(x.dtype).reshape(-1, 1)
        return t * (x @ torch.tanh(self.A).T) + t * t * torch.sinh(self.u) + torch.exp(0.1 * self.c) + torch.cos(x) * t


# ----------------------------------------------------------------------------- exactness: E1, E2

@given(window=st.integers(2, 8), batch=st.integers(1, 4), dim=st.integers(1, 4),
       per_sample=st.booleans(), keyword=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_e1_affine_jacobian_on_chord_is_exact(window, batch, dim, per_sample, keyword, seed):
    gen = torch.Generator().manual_seed(seed)
    field = AffineJacobianField(dim, seed=seed % 997)
    times = window_times(gen, window, batch, per_sample)
    calls = make_calls(chord_states(gen, times, dim), times, keyword=keyword,
                       scalar_time=not per_sample and seed % 2 == 0)
    gs = upstream(gen, window, batch, dim)
    exact, jagg = exact_and_jagg(field, calls, gs)
    assert exact.norm() > 0
    assert rel_err(jagg, exact) < EXACT_TOL


@given(window=st.integers(3, 8), batch=st.integers(1, 4), dim=st.integers(1, 4),
       per_sample=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_e2_time_affine_field_is_exact_for_arbitrary_states(window, batch, dim, per_sample, seed):
    gen = torch.Generator().manual_seed(seed)
    field = TimeAffineField(dim, seed=seed % 997)
    times = window_times(gen, window, batch, per_sample)
    calls = make_calls(random_states(gen, times, dim), times)
    gs = upstream(gen, window, batch, dim)
    exact, jagg = exact_and_jagg(field, calls, gs, options=WindowOptions(weights="t"))
    assert rel_err(jagg, exact) < EXACT_TOL


def test_e2_index_weights_break_on_a_non_uniform_grid():
    gen = torch.Generator().manual_seed(3)
    field = TimeAffineField(3, seed=1)
    times = shift3_sigmas(16)[8:13, None].expand(5, 2).clone()  # .75 .7 .643 .577 .5
    calls = make_calls(random_states(gen, times, 3), times)
    gs = upstream(gen, 5, 2, 3)
    exact, by_t = exact_and_jagg(field, calls, gs, options=WindowOptions(weights="t"))
    _, by_index = exact_and_jagg(field, calls, gs, options=WindowOptions(weights="index"))
    assert rel_err(by_t, exact) < EXACT_TOL
    assert rel_err(by_index, exact) > CLEARLY_WRONG


def test_index_weights_are_exact_on_a_uniform_grid():
    # the index weights j/(W−1) are the t weights when the grid is uniform
    gen = torch.Generator().manual_seed(4)
    field = TimeAffineField(2, seed=2)
    times = torch.linspace(1.0, 0.2, 5, dtype=DT)[:, None].expand(5, 3).clone()
    calls = make_calls(random_states(gen, times, 2), times)
    gs = upstream(gen, 5, 3, 2)
    exact, by_index = exact_and_jagg(field, calls, gs, options=WindowOptions(weights="index"))
    assert rel_err(by_index, exact) < EXACT_TOL


# ----------------------------------------------------------------------------- counterexamples

def test_c1_off_chord_states_break_jagg_exact_numbers():
    field = LinearThetaZ(1.0)
    t = torch.tensor([1.0, 0.5, 0.0], dtype=DT)
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], dtype=DT)
    calls = [DitCall((z[k:k + 1], t[k:k + 1])) for k in range(3)]
    gs = [torch.zeros(1, 2, dtype=DT), torch.tensor([[0.0, 1.0]], dtype=DT), torch.zeros(1, 2, dtype=DT)]
    exact, jagg = exact_and_jagg(field, calls, gs)
    assert exact.tolist() == [1.0]
    assert jagg.tolist() == [0.0]


def test_c2_index_weights_break_on_a_non_uniform_grid_exact_numbers():
    field = ThetaT(dim=1, theta=1.0)
    t = torch.tensor([1.0, 0.9, 0.0], dtype=DT)
    calls = [DitCall((torch.zeros(1, 1, dtype=DT), t[k:k + 1])) for k in range(3)]
    gs = [torch.zeros(1, 1, dtype=DT), torch.ones(1, 1, dtype=DT), torch.zeros(1, 1, dtype=DT)]
    exact, by_t = exact_and_jagg(field, calls, gs, options=WindowOptions(weights="t"))
    _, by_index = exact_and_jagg(field, calls, gs, options=WindowOptions(weights="index"))
    assert exact.tolist() == [0.9]
    assert by_t.item() == pytest.approx(0.9, abs=1e-15)
    assert by_index.tolist() == [0.5]


# ----------------------------------------------------------------------------- non-exactness is seen

def test_curved_field_is_not_exact():
    gen = torch.Generator().manual_seed(5)
    field = CurvedField(3, seed=0)
    times = shift3_sigmas(16)[4:10, None].expand(6, 2).clone()
    calls = make_calls(chord_states(gen, times, 3), times)
    gs = upstream(gen, 6, 2, 3)
    exact, jagg = exact_and_jagg(field, calls, gs)
    assert rel_err(jagg, exact) > CLEARLY_WRONG


def test_affine_field_with_off_chord_states_is_not_exact():
    gen = torch.Generator().manual_seed(6)
    field = AffineJacobianField(3, seed=0)
    times = shift3_sigmas(16)[4:10, None].expand(6, 2).clone()
    calls = make_calls(random_states(gen, times, 3), times)
    gs = upstream(gen, 6, 2, 3)
    exact, jagg = exact_and_jagg(field, calls, gs)
    assert rel_err(jagg, exact) > CLEARLY_WRONG


# ----------------------------------------------------------------------------- values

def _curved_window(window=6, batch=3, dim=3, seed=7):
    gen = torch.Generator().manual_seed(seed)
    field = CurvedField(dim, seed=seed)
    times = window_times(gen, window, batch, per_sample=True)
    return field, make_calls(random_states(gen, times, dim), times), gen


def test_values_equal_per_step_values_batched():
    field, calls, _ = _curved_window()
    exact = run_exact(field, calls)
    outs = run_window(field, calls)
    assert len(outs) == len(exact)
    for o, e in zip(outs, exact):
        assert o.shape == e.shape and o.dtype == e.dtype
        assert o.requires_grad
        torch.testing.assert_close(o, e, rtol=1e-13, atol=1e-13)


def test_values_bitwise_equal_per_step_values_unbatched():
    field, calls, _ = _curved_window()
    exact = run_exact(field, calls)
    outs = run_window(field, calls, options=WindowOptions(interior_chunk=1, batch_knots=False))
    for o, e in zip(outs, exact):
        assert torch.equal(o, e)


def test_no_grad_mode_runs_plain_calls():
    field, calls, _ = _curved_window()
    with torch.no_grad(), count_dit_passes(field) as c:
        outs = run_window(field, calls)
    assert c.grad_forwards == 0 and c.nograd_forwards == len(calls)
    for o, e in zip(outs, run_exact(field, calls)):
        assert torch.equal(o, e.detach())


# ----------------------------------------------------------------------------- pass counts

@pytest.mark.parametrize("window", [3, 5, 8])
@pytest.mark.parametrize("chunk", [None, 1, 2, 4])
def test_one_joint_backward_per_window(window, chunk):
    batch = 2
    field, calls, gen = _curved_window(window=window, batch=batch)
    gs = upstream(gen, window, batch, 3)
    with count_dit_passes(field) as c:
        outs = run_window(field, calls, options=WindowOptions(interior_chunk=chunk))
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    interior = window - 2
    assert c.grad_forwards == 1 and c.grad_forward_batches == [2 * batch]
    assert c.nograd_forwards == math.ceil(interior / (chunk or interior))
    assert sum(c.nograd_forward_batches) == interior * batch
    assert c.backwards == 1 and c.backward_batches == [2 * batch]


def test_window_of_two_is_two_plain_steps():
    batch = 2
    field, calls, gen = _curved_window(window=2, batch=batch)
    gs = upstream(gen, 2, batch, 3)
    with count_dit_passes(field) as c:
        outs = run_window(field, calls)
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    assert c.grad_forwards == 2 and c.grad_forward_batches == [batch, batch]
    assert c.nograd_forwards == 0
    assert c.backwards == 2 and c.backward_batches == [batch, batch]


# ----------------------------------------------------------------------------- linearity in g

def test_jagg_gradient_is_linear_in_upstream_gradients():
    field, calls, gen = _curved_window(window=7, batch=2)
    g = upstream(gen, 7, 2, 3)
    h = upstream(gen, 7, 2, 3)
    c = -1.7
    run = lambda: run_window(field, calls)  # noqa: E731
    combined = grad_of(field, run, [a + c * b for a, b in zip(g, h)])
    separate = grad_of(field, run, g) + c * grad_of(field, run, h)
    assert rel_err(combined, separate) < 1e-12
    # and the combination is not trivially exact (CurvedField is outside E1/E2)
    exact = grad_of(field, lambda: run_exact(field, calls), g)
    assert rel_err(grad_of(field, run, g), exact) > CLEARLY_WRONG


# ----------------------------------------------------------------------------- jagg_calls

def _trajectory(num_steps=10, batch=2, dim=3, seed=8):
    gen = torch.Generator().manual_seed(seed)
    field = CurvedField(dim, seed=seed)
    times = shift3_sigmas(num_steps)[:num_steps, None].expand(num_steps, batch).clone()
    calls = make_calls(random_states(gen, times, dim), times)
    return field, calls, upstream(gen, num_steps, batch, dim)


def test_partition_ten_steps_window_four():
    assert partition(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert partition(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_jagg_calls_windows_and_exact_windows():
    batch = 2
    field, calls, gs = _trajectory(batch=batch)
    with count_dit_passes(field) as c:
        outs = jagg_calls(field, calls, window=4)
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    # [0-3] and [4-7]: one joint forward/backward of 2B each; [8-9]: two plain steps
    # (backward_batches is in autograd's order, i.e. reversed: compare as multisets)
    assert c.grad_forward_batches == [2 * batch, 2 * batch, batch, batch]
    assert sorted(c.backward_batches) == sorted([2 * batch, 2 * batch, batch, batch])
    assert c.nograd_forward_batches == [2 * batch, 2 * batch]

    with count_dit_passes(field) as c:
        outs = jagg_calls(field, calls, window=4, exact_windows=(1,))
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    # window 1 now runs as 4 plain steps: 4 backwards of batch B
    assert c.grad_forward_batches == [2 * batch] + [batch] * 4 + [batch] * 2
    assert sorted(c.backward_batches) == sorted([2 * batch] + [batch] * 4 + [batch] * 2)
    assert c.nograd_forward_batches == [2 * batch]
    assert c.backwards == 1 + 4 + 2

    # window 1's contribution is exact; window 0's is not (CurvedField)
    only = lambda ws: [g if i in ws else None for i, g in enumerate(gs)]  # noqa: E731
    w1 = only(range(4, 8))
    exact_w1 = grad_of(field, lambda: run_exact(field, calls), w1)
    assert rel_err(grad_of(field, lambda: jagg_calls(field, calls, window=4, exact_windows=(1,)), w1),
                   exact_w1) < 1e-13
    assert rel_err(grad_of(field, lambda: jagg_calls(field, calls, window=4), w1), exact_w1) > CLEARLY_WRONG
    # all windows exact == run_exact; default == the sum of the per-window run_window gradients
    exact = grad_of(field, lambda: run_exact(field, calls), gs)
    all_exact = grad_of(field, lambda: jagg_calls(field, calls, window=4, exact_windows=(0, 1, 2)), gs)
    assert rel_err(all_exact, exact) < 1e-13
    per_window = sum(
        grad_of(field, lambda idx=idx: run_window(field, [calls[i] for i in idx], steps=idx), [gs[i] for i in idx])
        for idx in partition(10, 4))
    assert rel_err(grad_of(field, lambda: jagg_calls(field, calls, window=4), gs), per_window) < 1e-13


def test_jagg_calls_values_are_per_step_values():
    field, calls, _ = _trajectory()
    for o, e in zip(jagg_calls(field, calls, window=4), run_exact(field, calls)):
        torch.testing.assert_close(o, e, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------------- other bases

@pytest.mark.parametrize("window", [5, 7])
def test_lagrange_basis_is_exact_for_a_quadratic_jacobian(window):
    gen = torch.Generator().manual_seed(window)
    field = QuadraticPathField(3, seed=window)
    times = window_times(gen, window, 2, per_sample=True)
    calls = make_calls(chord_states(gen, times, 3), times)
    gs = upstream(gen, window, 2, 3)
    exact, lagrange = exact_and_jagg(field, calls, gs, options=WindowOptions(weights=Basis("lagrange", "t")))
    _, linear = exact_and_jagg(field, calls, gs, options=WindowOptions(weights=Basis("linear", "t")))
    assert rel_err(lagrange, exact) < EXACT_TOL
    assert rel_err(linear, exact) > CLEARLY_WRONG

    with count_dit_passes(field) as c:
        outs = run_window(field, calls, options=WindowOptions(weights=Basis("lagrange", "t")))
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    assert c.grad_forward_batches == [3 * 2] and c.backward_batches == [3 * 2]


def test_constant_basis_uses_the_left_knot_only():
    window, batch, dim = 5, 2, 3
    gen = torch.Generator().manual_seed(9)
    times = window_times(gen, window, batch, per_sample=False)
    calls = make_calls(random_states(gen, times, dim), times)
    gs = upstream(gen, window, batch, dim)
    options = WindowOptions(weights=Basis("constant", "t"))

    field = CurvedField(dim, seed=9)
    with count_dit_passes(field) as c:
        outs = run_window(field, calls, options=options)
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    assert c.grad_forwards == 1 and c.grad_forward_batches == [batch]
    assert c.backwards == 1 and c.backward_batches == [batch]
    assert c.nograd_forward_batches == [(window - 1) * batch]
    for o, e in zip(outs, run_exact(field, calls)):
        torch.testing.assert_close(o, e, rtol=1e-13, atol=1e-13)

    # J independent of (z, t) (v = θ-only term + φ(z, t)): the left knot's J is every step's J
    class ConstJ(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(dim, generator=torch.Generator().manual_seed(1), dtype=DT))

        def forward(self, x, timestep):
            return torch.sinh(self.w) + torch.tanh(x) * timestep.reshape(-1, 1)

    const = ConstJ()
    exact, left = exact_and_jagg(const, calls, gs, options=options)
    assert rel_err(left, exact) < EXACT_TOL
    # ... and a J that moves with t is not reproduced
    exact, left = exact_and_jagg(ThetaT(dim), calls, gs, options=options)
    assert rel_err(left, exact) > CLEARLY_WRONG


# ----------------------------------------------------------------------------- unused outputs

@pytest.mark.parametrize("unused", [(1,), (0,), (4,), (0, 4), (1, 2, 3), (0, 1, 2, 3)])
def test_unused_outputs(unused):
    window, batch, dim = 5, 2, 3
    gen = torch.Generator().manual_seed(10)
    field = AffineJacobianField(dim, seed=10)
    times = window_times(gen, window, batch, per_sample=True)
    calls = make_calls(chord_states(gen, times, dim), times)
    gs = [None if k in unused else g for k, g in enumerate(upstream(gen, window, batch, dim))]
    exact, jagg = exact_and_jagg(field, calls, gs)
    assert exact.norm() > 0
    assert rel_err(jagg, exact) < EXACT_TOL


@given(window=st.integers(3, 8), batch=st.integers(1, 3), dim=st.integers(1, 4), per_sample=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_extrapolation_basis_is_exact_for_an_affine_jacobian_on_the_chord(window, batch, dim, per_sample, seed):
    """Causal linear extrapolation from the window's first two steps reproduces a Jacobian affine
    along the chord (E1) exactly, like interpolation does; on a curved field it is a real
    approximation (and a worse one than interpolation)."""
    gen = torch.Generator().manual_seed(seed)
    times = window_times(gen, window, batch, per_sample)
    calls = make_calls(chord_states(gen, times, dim), times)
    gs = upstream(gen, window, batch, dim)
    options = WindowOptions(weights=Basis("extrapolate", "t"))
    exact, extrapolated = exact_and_jagg(AffineJacobianField(dim, seed=seed % 997), calls, gs, options=options)
    assert rel_err(extrapolated, exact) < EXACT_TOL


def test_extrapolation_matrix_rows():
    x = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.1], dtype=torch.float64)[:, None]
    phi = Basis("extrapolate", "t", knots=(0, 2, 4)).matrix(x)[..., 0]
    expected = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 1]], dtype=torch.float64)
    # step 3 extrapolates the line through knots 0 and 2 (x = 1.0, 0.5) to x = 0.3: β = (0.3-0.5)/(0.5-1.0)
    beta = (0.3 - 0.5) / (0.5 - 1.0)
    expected[3] = torch.tensor([-beta, 1 + beta, 0], dtype=torch.float64)
    torch.testing.assert_close(phi, expected, rtol=0, atol=1e-15)
    assert torch.allclose(phi.sum(1), torch.ones(5, dtype=torch.float64))


def test_randomized_basis_is_unbiased_for_any_jacobians():
    """E over the drawn interior knot of Σ_j J_{knot j}ᵀ Γ_j is Σ_s J_sᵀ g_s for arbitrary,
    unrelated per-step Jacobians (no affine assumption), and each draw is a different estimate."""
    gen = torch.Generator().manual_seed(0)
    num_steps, dim = 6, 4
    jac = torch.randn(num_steps, dim, dim, generator=gen, dtype=torch.float64)
    g = torch.randn(num_steps, dim, generator=gen, dtype=torch.float64)
    x = torch.linspace(1.0, 0.2, num_steps, dtype=torch.float64)[:, None] ** 2
    exact = sum(jac[s].T @ g[s] for s in range(num_steps))
    draws = []
    for pos in range(1, num_steps - 1):
        phi = randomized_matrix(x, pos)[..., 0]                  # (S, 3)
        knots = (0, pos, num_steps - 1)
        assert torch.allclose(phi.sum(1), torch.ones(num_steps, dtype=torch.float64))
        draws.append(sum(jac[k].T @ (phi[:, j, None] * g).sum(0) for j, k in enumerate(knots)))
    assert rel_err(torch.stack(draws).mean(0), exact) < 1e-13
    assert min(rel_err(d, exact) for d in draws) > CLEARLY_WRONG


@pytest.mark.parametrize("per", ["window", "step"])
def test_control_basis_is_unbiased_for_any_jacobians(per):
    """E over the correction draws (enumerated with their probabilities) of the control-variate
    window gradient is the exact one for arbitrary per-step Jacobians; p = 1 is exact on every draw."""
    import itertools

    gen = torch.Generator().manual_seed(1)
    num_steps, dim, p = 6, 4, 0.3
    jac = torch.randn(num_steps, dim, dim, generator=gen, dtype=torch.float64)
    g = torch.randn(num_steps, dim, generator=gen, dtype=torch.float64)
    x = torch.linspace(1.0, 0.2, num_steps, dtype=torch.float64)[:, None] ** 2
    exact = sum(jac[s].T @ g[s] for s in range(num_steps))
    interior = range(1, num_steps - 1)
    if per == "window":
        draws = [((), 1 - p), (tuple(interior), p)]
    else:
        draws = [(tuple(i for i, on in zip(interior, mask) if on), p ** sum(mask) * (1 - p) ** (len(mask) - sum(mask)))
                 for mask in itertools.product((0, 1), repeat=num_steps - 2)]
    mean = 0
    for corrected, prob in draws:
        knots = (0,) + corrected + (num_steps - 1,)
        phi = (control_matrix(x, p, corrected) if corrected else hat_matrix(x, (0, num_steps - 1)))[..., 0]
        assert torch.allclose(phi.sum(1), torch.ones(num_steps, dtype=torch.float64))
        mean = mean + prob * sum(jac[k].T @ (phi[:, j, None] * g).sum(0) for j, k in enumerate(knots))
    assert abs(sum(prob for _, prob in draws) - 1) < 1e-15
    assert rel_err(mean, exact) < 1e-13
    every = tuple(interior)
    phi = control_matrix(x, 1.0, every)[..., 0]
    assert rel_err(sum(jac[k].T @ (phi[:, k, None] * g).sum(0) for k in range(num_steps)), exact) < 1e-14


def test_control_basis_draws_and_costs():
    times = torch.linspace(1.0, 0.1, 6, dtype=torch.float64)[:, None].expand(6, 2)
    for per in ("window", "step"):
        basis = Basis("control", p=0.5, seed=4, per=per)
        knots = [basis.sample(times)[0] for _ in range(400)]
        interior = sum(len(k) - 2 for k in knots) / len(knots)
        assert abs(interior - 0.5 * 4) < 0.3, (per, interior)     # 2 + p (W - 2) knots on average
        sizes = {len(k) for k in knots}
        assert sizes == ({2, 6} if per == "window" else {2, 3, 4, 5, 6}), (per, sizes)
    with pytest.raises(jaggc.JaggInputError, match="per='window' or per='step'"):
        Basis("control", per="sample")


def test_control_basis_at_p_one_is_exact_through_jagg_compile():
    """Basis("control", p=1, per="step") corrects every interior step: the exact gradient (float64)."""
    field = AffineJacobianField(3, seed=5)
    curved = CurvedField(3, seed=5)
    gen = torch.Generator().manual_seed(2)
    T, B = 8, 2
    zs = torch.randn(T, B, 3, generator=gen, dtype=torch.float64)
    ts = torch.linspace(0.95, 0.1, T, dtype=torch.float64)[:, None].expand(T, B).contiguous()
    gs = torch.randn(T, B, 3, generator=gen, dtype=torch.float64)

    def loss(dit, zs, ts, gs):
        return sum((dit(zs[k], ts[k]) * gs[k]).sum() for k in range(zs.shape[0]))

    for model in (field, curved):
        args = (model, zs, ts, gs)
        _, exact = loss_and_grad(loss, args, model)
        _, got = loss_and_grad(jaggc.jagg_compile(loss, window=4, weights=Basis("control", p=1.0, per="step")),
                               args, model)
        assert rel_err(got, exact) < 1e-12
        _, plain = loss_and_grad(jaggc.jagg_compile(loss, window=4), args, model)
        if model is curved:
            assert rel_err(plain, exact) > 1e-4          # plain JAGG is not exact here: the check can fail


def test_randomized_basis_draws_from_its_own_seeded_stream():
    times = torch.linspace(1.0, 0.1, 8, dtype=torch.float64)[:, None].expand(8, 2)
    state = torch.get_rng_state()
    a = [Basis("randomized", seed=3).sample(times)[0], Basis("randomized", seed=3).sample(times)[0]]
    basis = Basis("randomized", seed=3)
    seq = [basis.sample(times)[0] for _ in range(6)]
    assert torch.equal(torch.get_rng_state(), state), "the user's RNG stream was consumed"
    assert a[0] == a[1] == seq[0] and len({k[1] for k in seq}) > 1
    assert all(k[0] == 0 and k[2] == 7 and 1 <= k[1] <= 6 for k in seq)


def test_noise_levels_follow_the_timestep_convention():
    from jaggc.runtime.weights import noise_levels

    t1000 = torch.tensor([[900.0], [450.0]], dtype=torch.float64)
    t1 = t1000 / 1000
    torch.testing.assert_close(noise_levels(t1000), t1)
    torch.testing.assert_close(noise_levels(t1), t1)
    basis = Basis(exact_below=0.5)
    assert basis.runs_exact(t1000) and basis.runs_exact(t1)
    assert not basis.runs_exact(t1000[:1]) and not Basis().runs_exact(t1000)
    knots, phi = basis.sample(t1000.expand(2, 3))
    assert knots == (0, 1) and torch.equal(phi, torch.eye(2, dtype=torch.float64)[:, :, None].expand(2, 2, 3))
    assert basis.label() == "linear/t/σ<0.5"
    with pytest.raises(jaggc.JaggInputError, match="noise level"):
        Basis(exact_below=500)


@pytest.mark.parametrize("backward", ["joint", "per_window", "lowmem"])
@pytest.mark.parametrize("scale", [1000.0, 1.0])
def test_sigma_aware_basis_runs_low_noise_windows_exactly(backward, scale):
    """Basis(exact_below=0.5) on a curved field, 8 steps from σ 0.95 to 0.1, windows of 4: the
    second window reaches σ < 0.5 and runs exactly (its gradient is the exact one), the first is
    plain JAGG; in every backward mode and either timestep convention."""
    field = CurvedField(3, seed=6)
    gen = torch.Generator().manual_seed(3)
    T, B = 8, 2
    zs = torch.randn(T, B, 3, generator=gen, dtype=torch.float64)
    ts = (scale * torch.linspace(0.95, 0.1, T, dtype=torch.float64))[:, None].expand(T, B).contiguous()
    gs = torch.randn(T, B, 3, generator=gen, dtype=torch.float64)

    def loss(dit, zs, ts, gs, steps):
        return sum((dit(zs[k], ts[k]) * gs[k]).sum() for k in steps)

    first, second = range(4), range(4, 8)
    args = (field, zs, ts, gs)
    grad = lambda fn, steps: loss_and_grad(fn, args + (steps,), field)[1]
    exact_second = grad(loss, second)
    plain_first = grad(jaggc.jagg_compile(loss, window=4, weights="t"), first)
    compiled = jaggc.jagg_compile(loss, window=4, weights=Basis(exact_below=0.5), backward=backward)
    assert rel_err(grad(compiled, range(8)), plain_first + exact_second) < 1e-12
    assert rel_err(plain_first, grad(loss, first)) > 1e-4        # the first window is JAGG, not exact
    rows = compiled.report.windows
    assert [w.basis for w in rows] == ["linear/t/σ<0.5"] * 2
    assert [(w.mode, w.roles()) for w in rows] == [("jagg", "K i i K"), ("jagg:σ-exact", "K K K K")]
