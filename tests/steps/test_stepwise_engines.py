"""The engine rows of runtime/engines.py that issue 55 added or fixed.

One process (no DeepSpeed needed):

* the ``zero_grad`` watchers of a ZeRO engine (``_compat.intercept_zero_grad``) survive
  ``copy.deepcopy`` and pickling of their owner: the copy's ``zero_grad()`` leaves the original's
  gradients alone and runs no watcher, ``torch.save(engine.module)`` pickles and loads, the
  original's watcher still refuses;
* a DeepSpeed engine that lacks an internal jaggc uses (``setup_buckets``, ``param_idx_in_group``,
  ``seq_data_parallel_group``) is refused at ``jaggc.stepwise`` with an error naming what is missing,
  the installed release and the releases tested.

Two gloo ranks, one shared run (DeepSpeed on the CPU):

* DeepSpeed stage 0 (a config without a ``zero_optimization`` section: gradients in ``.grad``, one
  all-reduce at the boundary's ``engine.backward``) has a row of its own: its W=4 loop in σ order and
  in a random order per rank gives the reduced ``.grad`` at the boundary equal to the ranks' average
  of a JAGG computed in the test independently of jaggc (1e-5, fp32); the ledger watches ``.grad``, so
  a ``clip_grad_norm_`` between two steps of a window is refused; the guard (``Guard(every=1)``)
  leaves the parameters after the step bit-identical to the unguarded loop's and gives both ranks the
  figures computed here from the ranks' average gradients;
* ``copy.deepcopy`` of a ZeRO-2 engine's module with a stepwise installed: the copy's ``zero_grad``
  leaves the original's gradients alone (``torch.save`` of it fails on DeepSpeed's own forward hook,
  a local function, whatever jaggc does: pickling is checked in one process).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import jaggc
from jaggc._compat import DEEPSPEED_TESTED, intercept_zero_grad
from jaggc.errors import JaggUnsupportedError

pytestmark = [pytest.mark.usefixtures("one_thread")]


# --------------------------------------------------------------------------- one process

class DeepSpeedEngine(nn.Module):
    """Stands in for ``deepspeed.DeepSpeedEngine`` (jaggc recognises the engine by its class name)."""

    def __init__(self, module: nn.Module, stage: int, optimizer, **internals):
        super().__init__()
        self.module, self.stage, self.optimizer = module, stage, optimizer
        for k, v in internals.items():
            setattr(self, k, v)

    def zero_optimization_stage(self) -> int:
        return self.stage

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _with_grads(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    return module


def test_zero_grad_watchers_survive_deepcopy_and_pickling():
    inner = _with_grads(nn.Linear(3, 2))
    engine = DeepSpeedEngine(inner, 2, torch.optim.SGD(inner.parameters(), lr=0.1))
    calls = []

    def before(call):
        calls.append(call)
        raise RuntimeError(f"refused {call}")

    remove = intercept_zero_grad(engine, before)
    copied = copy.deepcopy(inner)
    copied.zero_grad()          # the copy's own zero_grad: no watcher, the original's gradients untouched
    assert calls == []
    assert all(p.grad is None for p in copied.parameters())
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in inner.parameters())
    buffer = io.BytesIO()
    torch.save(inner, buffer)   # a closure in the instance dict would not pickle
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.zero_grad()
    assert calls == [] and all(p.grad is None for p in loaded.parameters())
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in inner.parameters())
    with pytest.raises(RuntimeError, match="refused engine.module.zero_grad"):
        inner.zero_grad()       # the original is still watched
    remove()
    assert "zero_grad" not in inner.__dict__ and "zero_grad" not in engine.__dict__
    inner.zero_grad()
    assert all(p.grad is None for p in inner.parameters())


def test_deepspeed_internals_are_checked_at_install():
    from jaggc import models

    dit = models.sd3("tiny")
    engine = DeepSpeedEngine(dit, 2, torch.optim.SGD(dit.parameters(), lr=0.1), seq_data_parallel_group=None)
    with pytest.raises(JaggUnsupportedError) as refused:
        jaggc.stepwise(engine, window=4)
    message = str(refused.value)
    assert "setup_buckets" in message and "param_idx_in_group" in message, message
    assert all(v in message for v in DEEPSPEED_TESTED), message
    assert "forward" not in dit.__dict__          # nothing installed
    stage0 = DeepSpeedEngine(dit, 0, torch.optim.SGD(dit.parameters(), lr=0.1))
    with pytest.raises(JaggUnsupportedError, match="seq_data_parallel_group"):
        jaggc.stepwise(stage0, window=4)


# --------------------------------------------------------------------------- two ranks, DeepSpeed

WORLD = 2
TIMEOUT_S = 120


def _stage0_engine(base, gas: int, clip: float = 1.0):
    import deepspeed

    dit = copy.deepcopy(base)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
              "steps_per_print": 10**9}       # no zero_optimization section: DeepSpeed's stage 0
    engine, *_ = deepspeed.initialize(model=dit, optimizer=torch.optim.SGD(dit.parameters(), lr=1e-2), config=config)
    return engine


def stage0_loop(base, rank: int, order: str, window: int | None, *, guard: bool = False,
                clip_inside: bool = False) -> dict:
    """The per-step loop (engine(...), engine.backward, engine.step every step; the boundary at the
    trajectory's last step) on a stage-0 engine: the reduced .grad at the boundary, the parameters after it."""
    from test_stepwise_deepspeed import T, _inputs, _loss, _order

    engine = _stage0_engine(base, T)
    assert jaggc.runtime.engines.engine_of(engine).name == "DeepSpeed stage 0"
    cond, [(ts, zs, gs)] = _inputs(base, rank, 1)
    probes = []
    if window is not None:
        jaggc.stepwise(engine, window=window, weights="t",
                       guard=jaggc.Guard(every=1, on_probe=probes.append) if guard else None)
    order_k = _order(rank, order, 0)
    steps = order_k if window is None else jaggc.stepwise(engine).steps(order_k, ts[:, order_k])
    grad, error = None, None
    try:
        for n, j in enumerate(steps):
            out = engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
            engine.backward(_loss(out, gs[j]))
            if clip_inside and n == 1:
                torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1e-3)
            if n == len(order_k) - 1:
                grad = {name: p.grad.detach().clone() for name, p in engine.module.named_parameters()}
            engine.step()
    except JaggUnsupportedError as e:
        error = str(e)
    result = dict(grad=grad, error=error, params={n: p.detach().clone() for n, p in engine.module.named_parameters()},
                  figures=[(r.cosine, r.rel_error) for r in probes])
    if window is not None:
        result["counts"] = vars(jaggc.stepwise(engine).counts).copy()
        jaggc.stepwise(engine).close()
    return result


def zero2_copies(base, rank: int) -> dict:
    """copy.deepcopy and torch.save of a ZeRO-2 engine's module while a stepwise is installed."""
    from test_stepwise_deepspeed import _engine

    engine = _engine(copy.deepcopy(base), 2, 1, 1.0)
    sw = jaggc.stepwise(engine, window=4, weights="t")
    module = _with_grads(engine.module)
    copied = copy.deepcopy(module)
    copied.zero_grad()
    untouched = all(p.grad is not None and bool((p.grad == 1).all()) for p in module.parameters())
    copy_zeroed = all(p.grad is None for p in copied.parameters())
    # (torch.save(engine.module) itself fails on DeepSpeed's own forward hook, a local function: the
    # watchers' pickling is tested in one process above)
    watched = type(module.__dict__.get("zero_grad")).__name__
    try:
        module.zero_grad()      # the original's watcher: nothing held back, so it runs
    finally:
        sw.close()
    return dict(untouched=untouched, copy_zeroed=copy_zeroed, watched=watched,
                original_zeroed=all(p.grad is None for p in module.parameters()))


def rank_body(rank: int, world: int) -> dict:
    import deepspeed
    from jaggc import models
    from test_stepwise_deepspeed import exact_reference, reference

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    base = models.sd3("tiny")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["ref"] = {order: reference(base, rank, 1, 4, order=order) for order in ("sigma", "random")}
        out["exact"] = exact_reference(base, rank)
        for order in ("sigma", "random"):
            out[("w4", order)] = stage0_loop(base, rank, order, 4)
        out["guard"] = stage0_loop(base, rank, "sigma", 4, guard=True)
        out["clip"] = stage0_loop(base, rank, "sigma", 4, clip_inside=True)
        out["copies"] = zero2_copies(base, rank)
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    from ranks import run_ranks

    return run_ranks(rank_body, WORLD, tmp_path_factory, name="stepwise_engines", timeout_s=TIMEOUT_S)


def _rel(a: dict, b: dict) -> float:
    fa = torch.cat([a[k].double().reshape(-1) for k in sorted(b)])
    fb = torch.cat([b[k].double().reshape(-1) for k in sorted(b)])
    return float((fa - fb).norm() / fb.norm())


@pytest.mark.parametrize("order", ["sigma", "random"])
def test_stage0_reduced_gradient_is_the_ranks_average_jagg(rank_results, order):
    for res in rank_results:
        run = res[("w4", order)]
        assert run["error"] is None, run["error"]
        assert run["counts"]["jagg_windows"] >= 1 and run["counts"]["fallbacks"] == 0, run["counts"]
        assert _rel(run["grad"], res["ref"][order]) < 1e-5, _rel(run["grad"], res["ref"][order])
    a, b = (res[("w4", order)]["params"] for res in rank_results)
    assert all(torch.equal(a[n], b[n]) for n in a)      # the ranks stepped on the same reduced gradient


def test_stage0_clip_inside_a_window_is_refused(rank_results):
    """Stage 0 keeps the gradient in .grad: the ledger watches it, a clip between two steps of a window is seen."""
    for res in rank_results:
        error = res["clip"]["error"]
        assert error is not None and "clip_grad_norm_" in error and "step 2" in error, error


def test_stage0_guard(rank_results):
    from test_stepwise_deepspeed import _figures

    figures = []
    for res in rank_results:
        guarded, unguarded = res["guard"], res[("w4", "sigma")]
        assert guarded["error"] is None, guarded["error"]
        for name, p in unguarded["params"].items():
            assert torch.equal(guarded["params"][name], p), name
        cos_ref, rel_ref = _figures(res["ref"]["sigma"], res["exact"])
        (cos, rel), = guarded["figures"]
        assert abs(cos - cos_ref) <= 1e-6 and abs(rel - rel_ref) <= 1e-6 * max(1.0, rel_ref), (cos, cos_ref, rel, rel_ref)
        figures.append(guarded["figures"])
    assert figures[0] == figures[1]


def test_zero2_module_copies_leave_the_original_alone(rank_results):
    for res in rank_results:
        assert res["copies"] == dict(untouched=True, copy_zeroed=True, watched="_WatchedZeroGrad",
                                     original_zeroed=True), res["copies"]
