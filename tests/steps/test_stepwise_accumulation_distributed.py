"""DanceGRPO's loop accumulating gradients across trajectories, on 2 gloo ranks (issue 42).

DanceGRPO's ``gradient_accumulation_steps`` steps the optimizer every k samples, with no
``zero_grad`` between them: the second sample's trajectory starts with ``.grad`` from the first.
Each rank its own random order of a random 60% of the steps. On FSDP1 with ``use_orig_params=True``
FSDP hands the original parameters new views of its flat gradient in every forward; jaggc took that
for a write into ``.grad`` inside an open window and refused. Checked on FSDP1 (both
``use_orig_params``), FSDP2 and DDP: at W=2 the gathered gradient at each optimizer step equals the
unchanged loop's (the ranks' average of each rank's exact gradient of its samples) to fp32 roundoff;
at W=4 the ranks' average of each rank's JAGG of its samples; and the first sample of each cycle,
which starts from None gradients, marks them (steps/ledger.py) without changing what FSDP reduces.
"""

from __future__ import annotations

import warnings

import pytest

import jaggc
from jaggc_studies.loops import dance_grpo as dg
from ranks import run_ranks
from test_stepwise_distributed import _avg, _rel, _wrap, full_params, reference_grad
from test_sharded import full_grads

WORLD = 2
SAMPLES, ACCUMULATION = 4, 2
WRAPPERS = ("fsdp1_orig", "fsdp1", "fsdp2", "ddp")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def accumulation_case(rank: int, world: int, wrapper: str, window: int) -> list[float]:
    kwargs = dict(num_steps=10, samples=SAMPLES, shard=(rank, world), gradient_accumulation_steps=ACCUMULATION)
    run = dg.setup(**kwargs, wrap=_wrap(wrapper), stepwise=dict(window=window, weights="t"))
    plain = dg.setup(**kwargs)
    kind = "fsdp1" if wrapper.startswith("fsdp1") else wrapper
    errors = []

    def check(opt, args, kwargs_):
        first = len(errors) * ACCUMULATION
        got, params = full_grads(run.transformer, kind), full_params(run.transformer, kind)

        def loss(m):
            def sample_loss(i):
                if window == 2:                 # the unchanged loop's gradient
                    return dg.reference_loss(plain, i, m)
                return jaggc.jagg_compile(lambda dit, r: dg.reference_loss(r, i, dit), dit=m, window=4, weights="t",
                                          options=jaggc.Options(batch_knots=False))(m, plain)
            return sum(sample_loss(i) for i in range(first, first + ACCUMULATION))
        errors.append(_rel(got, _avg(reference_grad(plain.transformer, params, loss))))

    run.optimizer.register_step_pre_hook(check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dg.train_jaggc(run)
    assert jaggc.stepwise(run.transformer).counts.fallbacks == 0
    jaggc.stepwise(run.transformer).close()
    return errors


def rank_body(rank: int, world: int) -> dict:
    return {(wrapper, window): accumulation_case(rank, world, wrapper, window)
            for wrapper in WRAPPERS for window in (2, 4)}


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    dg.setup(num_steps=4, samples=1)      # warm the lazy imports before forking
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="accumulation", timeout_s=600)


@pytest.mark.parametrize("window", [2, 4])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_dance_grpo_accumulating_across_trajectories(rank_results, wrapper, window):
    for res in rank_results:
        errors = res[(wrapper, window)]
        assert len(errors) == SAMPLES // ACCUMULATION
        assert max(errors) <= 1e-6, errors
