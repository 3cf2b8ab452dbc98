"""The rollout's passes (runtime/rollout_passes.py): the same sample at another timestep.

A sampler loop of two passes (two batches, each its own conditioning tensor, T decreasing timesteps)
is indexed; a training batch that regroups samples of both passes finds, for each of its rows, the row
of the same sample at a knot's timestep, and the knots' inputs as one call. Not linked (None): a
timestep the pass never visited, and a pass whose conditioning changed identity mid-way.
"""

from __future__ import annotations

import torch

from jaggc.runtime.calls import DitCall
from jaggc.runtime.rollout_passes import PassIndex

T, B, D = 5, 3, 4
TIMES = torch.linspace(1.0, 0.2, T, dtype=torch.float64)


def _rollout(index: PassIndex, conds: list[torch.Tensor], gen) -> dict:
    """Two sampler passes; returns {(pass, step, position): (row, state)}."""
    rows, where = 0, {}
    for p, cond in enumerate(conds):
        z = torch.randn(B, D, generator=gen)
        for j in range(T):
            call = DitCall((), dict(hidden_states=z, timestep=TIMES[j].expand(B), encoder_hidden_states=cond))
            index.add(call, rows, B)
            for i in range(B):
                where[(p, j, i)] = (rows + i, z[i])
            rows += B
            z = z - 0.1 * torch.randn(B, D, generator=gen)   # a new state tensor each step, as a sampler makes
    return where


def test_the_same_sample_at_a_knots_timestep_across_regrouped_passes():
    gen = torch.Generator().manual_seed(0)
    index = PassIndex(time_arg="timestep", state_arg="hidden_states")
    conds = [torch.randn(B, 700, generator=gen) for _ in range(2)]    # large: linked by identity
    where = _rollout(index, conds, gen)
    # a training batch: pass 1's sample 2, pass 0's sample 0, pass 1's sample 0, at step 2
    picks = [(1, 2), (0, 0), (1, 0)]
    rows = [where[(p, 2, i)][0] for p, i in picks]
    for knot in (0, 4):
        got = index.knot_rows(rows, [float(TIMES[knot])] * 3)
        assert got == [where[(p, knot, i)][0] for p, i in picks]
        call = index.call_of_rows(got, unbatched=())
        expected = torch.stack([where[(p, knot, i)][1] for p, i in picks])
        assert torch.equal(call.kwargs["hidden_states"], expected)
        assert torch.equal(call.kwargs["encoder_hidden_states"], torch.stack([conds[p][i] for p, i in picks]))
        assert torch.equal(call.kwargs["timestep"], TIMES[knot].expand(3))


def test_an_unvisited_timestep_is_not_linked():
    gen = torch.Generator().manual_seed(1)
    index = PassIndex(time_arg="timestep", state_arg="hidden_states")
    where = _rollout(index, [torch.randn(B, 7, generator=gen) for _ in range(2)], gen)
    assert index.knot_rows([where[(0, 1, 0)][0]], [0.123]) is None


def test_large_conditioning_is_linked_by_identity():
    gen = torch.Generator().manual_seed(2)
    index = PassIndex(time_arg="timestep", state_arg="hidden_states")
    big = torch.randn(B, 600, generator=gen)                           # > SMALL elements: by identity
    later = big.clone()                                                # the same values, another tensor
    z = torch.randn(B, D, generator=gen)
    rows = 0
    for j in range(T):
        cond = big if j < 2 else later                                 # from step 2 on
        index.add(DitCall((), dict(hidden_states=z, timestep=TIMES[j].expand(B), encoder_hidden_states=cond)), rows, B)
        rows += B
    # step 3's row 0 belongs to a pass that began at step 2: step 0 is not in it
    assert index.knot_rows([3 * B], [float(TIMES[0])]) is None
    assert index.knot_rows([3 * B], [float(TIMES[4])]) == [4 * B]


def test_interleaved_passes_of_one_conditioning_are_not_linked():
    gen = torch.Generator().manual_seed(3)
    index = PassIndex(time_arg="timestep", state_arg="hidden_states")
    cond = torch.randn(B, 700, generator=gen)
    rows = 0
    for j in range(T):
        for _ in range(2):              # batch A's step j, then batch B's, with the same conditioning tensor
            z = torch.randn(B, D, generator=gen)
            index.add(DitCall((), dict(hidden_states=z, timestep=TIMES[j].expand(B), encoder_hidden_states=cond)),
                      rows, B)
            rows += B
    assert index.knot_rows([2 * 2 * B], [float(TIMES[0])]) is None
