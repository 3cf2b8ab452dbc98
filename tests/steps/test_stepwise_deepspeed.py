"""``jaggc.stepwise`` on a DeepSpeed engine (``deepspeed.initialize``), 2 gloo ranks on the CPU.

The loop is the per-step GRPO shape DeepSpeed users write (Flow-Factory's default config is ZeRO-2
through accelerate): every step ``out = engine(...)``, ``engine.backward(loss)``, ``engine.step()``,
with ``gradient_accumulation_steps`` = the steps of one or two trajectories, so the optimizer moves
at the last step of each accumulation boundary. Each rank its own samples; steps in σ order and in
a random order per rank (the deferred schedule: every window inside the last step's backward).

* W=2 (every window exact): the parameters after the optimizer step equal the unchanged loop's
  (fp32, 1e-6: the same per-step backward passes in the same order, the same bucketed reduction),
  ``gradient_clipping`` 1.0 and 0;
* W=4 ``weights="t"``: the reduced gradient ZeRO holds at the boundary (``safe_get_full_grad``,
  before the step) equals the ranks' average of a JAGG computed in the test, independently of
  jaggc (``reference_jagg`` on an unwrapped copy), to 1e-5 in fp32 (two fp32 summation orders: the
  joint backward's against the reference's, and ZeRO's bucketed all-reduce against the test's);
  and the parameters after the step are SGD's step on the clipped reference gradient (1e-5);
* ``rollout_cache=True`` on ZeRO-2, both orders: forwards served, the same gradient; on ZeRO-1/2 with an
  engine step after the first of two recorded trajectories: the second is not served by the plain cache
  (ZeRO's step bumps no version counter: its steps are counted), and ``"first_order"`` serves it (cosine
  > 0.9999 to the forwards'); a cache of ``engine.module`` without its engine is refused;
* bf16 on ZeRO-2 at W=2: ZeRO's reduced gradient is the unchanged loop's;
* ``backward="lowmem"`` and ``"per_window"`` on ZeRO-2 in both orders: the same gradient;
* collectives per trajectory counted beside the unchanged loop's;
* an engine step while a window holds a gradient back (the boundary inside a window) is refused
  before any parameter moves, raw and through accelerate, and so is a loop left early (``break``)
  while one is held back (raw and accelerate); so is ``engine.zero_grad()`` / the ZeRO optimizer's /
  ``engine.module``'s ``zero_grad()`` while one
  is held back (ZeRO keeps the gradient off ``.grad``: the call is watched), and the next trajectory
  starts clean; a zero_grad while nothing is held back and accelerate's clip inside a window run;
* ZeRO-3 is refused at install, naming why (the path under development: test_stepwise_deepspeed_zero3.py);
* the guard (``Guard(every=1)``, W=4) on ZeRO-1 and ZeRO-2, both orders: the parameters after the step
  are bit-identical to the unguarded W=4 loop's (the probe hands ZeRO nothing), and the probe's cosine
  and relative error are equal on both ranks and equal to those computed here from the ranks' average
  reference JAGG and the ranks' average exact gradient (1e-6: fp32 gradients, the guard's float64
  statistics; the two sides differ by fp32 summation orders, ~1e-7 relative, well inside);
* accelerate with its DeepSpeed plugin on CPU (Flow-GRPO's shape: ``accumulate``,
  ``accelerator.backward``, clip at the sync), ZeRO-1/2: W=4 the reduced gradient as above, W=2 the
  unchanged loop's parameters;
* a guarded ``jagg_compile`` loss on ZeRO-2 is refused at its first call (its probe reads ``.grad``);
* DanceGRPO's shape: each rank its own random subset of 4 of the 6 steps: the ranks' average JAGG,
  and the guard's figures the same on both ranks and those of the average gradients;
* the whole-loss path: one ``engine.backward`` of a ``jagg_compile``-d loss gives the ranks' average
  reference JAGG in ZeRO-1's and ZeRO-2's buffers (1e-5, as above); ZeRO-3 refused at the first call
  (the capture's fake-tensor run cannot pass ZeRO-3's gathering hooks: runtime/engines.py, ``refuse_zero3``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist

deepspeed = pytest.importorskip("deepspeed")

import jaggc  # noqa: E402
from jaggc import models  # noqa: E402
from jaggc.errors import JaggUnsupportedError  # noqa: E402
from helpers import reference_jagg  # noqa: E402
from ranks import run_ranks  # noqa: E402
from jaggc_studies.bench.deepspeed_zero import counting_collectives  # noqa: E402

WORLD = 2
TIMEOUT_S = 600
B, T = 2, 6
SUBSET = 4          # DanceGRPO's shape: each rank trains its own random 4 of the 6 steps
LR = 1e-2

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _inputs(dit, rank: int, trajectories: int):
    """Each rank's own stored states and upstream signals, per trajectory; per-sample timesteps."""
    cond = models.sd3_conditioning(dit, B, seed=1).kwargs
    shape = models.sd3_latent_shape(dit, B)
    g = torch.Generator().manual_seed(100 + rank)
    sigmas = torch.linspace(1.0, 0.55, T)
    out = []
    for _ in range(trajectories):
        ts = 1000 * (sigmas[None, :] - 0.02 * torch.rand(B, 1, generator=g))      # (batch, steps)
        zs = [torch.randn(shape, generator=g) for _ in range(T)]
        gs = [torch.randn(shape, generator=g) for _ in range(T)]
        out.append((ts, zs, gs))
    return cond, out


def _loss(out, g):
    return (out * g).sum() / out.shape[0]


def _engine(dit, stage: int, trajectories: int, clip: float, gas: int | None = None, bf16: bool = False,
            bucket: int | None = None):
    zero = {"stage": stage}
    if bucket is not None:      # elements per bucket: several reductions per backward on the tiny model
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    config = {"bf16": {"enabled": bf16}, "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas or T * trajectories,
              "zero_optimization": zero, "gradient_clipping": clip,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=dit, optimizer=torch.optim.SGD(dit.parameters(), lr=LR), config=config)
    return engine


def _order(rank: int, order: str, k: int) -> list[int]:
    """The steps a rank trains in trajectory ``k``: all in σ order, all in a random order, or (DanceGRPO's
    shape) a random subset of SUBSET steps in a random order, another on each rank."""
    if order == "sigma":
        return list(range(T))
    if order == "subset":
        return torch.randperm(T, generator=torch.Generator().manual_seed(11 * rank + k + 1))[:SUBSET].tolist()
    return torch.randperm(T, generator=torch.Generator().manual_seed(7 * rank + k)).tolist()


def _steps_per_trajectory(order: str) -> int:
    return SUBSET if order == "subset" else T


def run_loop(base, stage: int, order: str, trajectories: int, clip: float, rank: int, window: int | None,
             backward: str = "joint", bf16: bool = False, rollout_cache: bool = False,
             zero_grad_after: int | None = None, guard: bool = False, bucket: int | None = None) -> dict:
    """The per-step loop on a fresh engine from ``base``'s weights (``window=None``: unchanged):
    the reduced gradient just before the boundary's step, the parameters after it, the collectives
    of the backward passes (the optimizer step's not counted: the same in both loops)."""
    from deepspeed.utils import safe_get_full_grad

    engine = _engine(copy.deepcopy(base), stage, trajectories, clip, gas=_steps_per_trajectory(order) * trajectories,
                     bf16=bf16, bucket=bucket)
    cond, trajs = _inputs(base, rank, trajectories)
    if bf16:    # ZeRO's bf16 mode casts the module, not its inputs
        cond = {k: v.bfloat16() for k, v in cond.items()}
        trajs = [(ts, [z.bfloat16() for z in zs], gs) for ts, zs, gs in trajs]
    probes = []
    if window is not None:
        jaggc.stepwise(engine, window=window, weights="t", backward=backward, rollout_cache=rollout_cache,
                       guard=jaggc.Guard(every=1, on_probe=probes.append) if guard else None)
    if rollout_cache:   # the rollout: the sampler's no-grad calls of the engine on the states it visits
        with torch.no_grad():
            for ts, zs, _ in trajs:
                for j in range(T):
                    engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)
    grad = None
    collectives = 0
    for k, (ts, zs, gs) in enumerate(trajs):
        order_k = _order(rank, order, k)
        steps = order_k if window is None else jaggc.stepwise(engine).steps(order_k, ts[:, order_k])
        for n, j in enumerate(steps):
            with counting_collectives() as counts:
                out = engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
                if k == 0 and n == 0:
                    # a window is open (this step ran its forward) but holds nothing back: allowed
                    engine.zero_grad()
                    engine.optimizer.zero_grad()
                engine.backward(_loss(out.float(), gs[j]))
            collectives += sum(counts.values())
            if k == trajectories - 1 and n == len(order_k) - 1:
                grad = {name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()}
            engine.step()
            if n == zero_grad_after:
                engine.zero_grad()
    result = dict(grad=grad, params={n: p.detach().clone() for n, p in engine.module.named_parameters()},
                  collectives=collectives / trajectories)
    if guard:
        result["figures"] = [(r.cosine, r.rel_error) for r in probes]
    if window is not None:
        result["counts"] = vars(jaggc.stepwise(engine).counts).copy()
        jaggc.stepwise(engine).close()
    return result


def reference(base, rank: int, trajectories: int, window: int, order: str = "sigma") -> dict:
    """The ranks' average of each rank's plain JAGG of its summed loss over the steps it trains
    (windows cut in σ order, as jaggc cuts them), over ``gradient_accumulation_steps``: what ZeRO's
    reduced gradient must be."""
    model = copy.deepcopy(base)
    cond, trajs = _inputs(base, rank, trajectories)
    total = None
    for k, (ts, zs, gs) in enumerate(trajs):
        steps = sorted(_order(rank, order, k))

        def loss(m):
            return sum(_loss(m(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0], gs[j])
                       for j in steps)
        _, flat = reference_jagg(loss, (model,), model, window)
        total = flat if total is None else total + flat
    total = total.double() / (_steps_per_trajectory(order) * trajectories)
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    sizes = [p.numel() for p in model.parameters()]
    return {n: g.view_as(p) for (n, p), g in zip(model.named_parameters(), total.split(sizes))}


def exact_reference(base, rank: int, order: str = "sigma") -> dict:
    """The ranks' average of each rank's exact gradient of its summed loss (one trajectory)."""
    model = copy.deepcopy(base)
    cond, ((ts, zs, gs),) = _inputs(base, rank, 1)
    loss = sum(_loss(model(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0], gs[j])
               for j in _order(rank, order, 0))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    total = torch.cat([g.reshape(-1) for g in grads]).double() / _steps_per_trajectory(order)
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return {n: g.view_as(p) for (n, p), g in zip(model.named_parameters(), total.split([p.numel() for p in grads]))}


def accelerate_loop(base, stage: int, order: str, trajectories: int, rank: int, window: int | None,
                    gas: int | None = None, break_after: int | None = None) -> dict:
    """Flow-GRPO's shape under accelerate with its DeepSpeed plugin: ``accumulate`` over the
    trajectories' steps, ``accelerator.backward`` (the engine's backward, and its step at the sync),
    a clip at the sync (the engine's ``gradient_clipping``), ``optimizer.step``/``zero_grad`` every step
    (no-ops under DeepSpeed: its optimizer wrapper's ``zero_grad`` never reaches ZeRO). In random order
    the loop clips at every step, inside the window: under DeepSpeed ``accelerator.clip_grad_norm_`` only
    reads the engine's last norm (the engine clips at its step), so it is harmless. ``gas`` below the
    trajectory's steps puts the engine's boundary step (inside ``accelerator.backward``) into a window:
    refused before any parameter moves (returned as ``error``). ``break_after``: the loop left by ``break``
    after that step, window 0 holding its steps back: refused at ``close()`` (returned as ``error``). accelerate enables the plugin only off ``cpu=True`` with
    ``LOCAL_RANK`` set (ranks.py sets it) and deepspeed importable: on CPU it then takes the ranks'
    gloo group."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.utils import safe_get_full_grad

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    gas = gas or T * trajectories
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=gas, gradient_clipping=1.0)
    plugin.deepspeed_config.update({"zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
                                    "train_micro_batch_size_per_gpu": B,
                                    "train_batch_size": B * gas * dist.get_world_size()})
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=gas)
    assert accelerator.distributed_type.name == "DEEPSPEED", accelerator.distributed_type
    dit = copy.deepcopy(base)
    transformer, optimizer = accelerator.prepare(dit, torch.optim.SGD(dit.parameters(), lr=LR))
    cond, trajs = _inputs(base, rank, trajectories)
    if window is not None:
        jaggc.stepwise(transformer, window=window, weights="t")
    grads = []
    engine_step = transformer.step

    def step(*args, **kwargs):      # the reduced gradient when accelerator.backward steps the engine
        grads.append({name: safe_get_full_grad(p).detach().clone() for name, p in transformer.module.named_parameters()})
        return engine_step(*args, **kwargs)

    transformer.step = step
    before = {n: p.detach().clone() for n, p in transformer.module.named_parameters()}
    try:
        for k, (ts, zs, gs) in enumerate(trajs):
            order_k = _order(rank, order, k)
            steps = order_k if window is None else jaggc.stepwise(transformer).steps(order_k, ts[:, order_k])
            for n, j in enumerate(steps):
                with accelerator.accumulate(transformer):
                    out = transformer(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
                    accelerator.backward(_loss(out, gs[j]))
                    if accelerator.sync_gradients or order == "random":
                        accelerator.clip_grad_norm_(transformer.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
                if n == break_after:
                    break
        if break_after is not None:
            jaggc.stepwise(transformer).close()
    except JaggUnsupportedError as e:
        moved = any(not torch.equal(p, before[n]) for n, p in transformer.module.named_parameters())
        jaggc.stepwise(transformer).close()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return dict(error=str(e), moved=moved)
    assert len(grads) == 1, len(grads)      # one sync: the trajectories' last step
    result = dict(grad=grads[0], params={n: p.detach().clone() for n, p in transformer.module.named_parameters()})
    if window is not None:
        result["counts"] = vars(jaggc.stepwise(transformer).counts).copy()
        jaggc.stepwise(transformer).close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return result


def step_inside_a_window(base, stage: int, rank: int) -> dict:
    """``gradient_accumulation_steps`` = 2 with windows of 4: the engine's boundary step comes while
    window 0 holds steps 0 and 1 back. ZeRO steps its own torch optimizer on fp32 partitions; jaggc's
    pre-hook knows it and refuses before any parameter moves."""
    engine = _engine(copy.deepcopy(base), stage, 1, 1.0, gas=2)
    cond, [(ts, zs, gs)] = _inputs(base, rank, 1)
    jaggc.stepwise(engine, window=4, weights="t")
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    error = None
    try:
        for j in jaggc.stepwise(engine).steps(list(range(T)), ts):
            out = engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
            engine.backward(_loss(out, gs[j]))
            engine.step()
    except JaggUnsupportedError as e:
        error = str(e)
    moved = any(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    jaggc.stepwise(engine).close()
    return dict(error=error, moved=moved)


def zero_grad_inside_a_window(base, stage: int, rank: int, call: str) -> dict:
    """A hand-written ``engine.zero_grad()`` (or the ZeRO optimizer's) after step 1, while window 0
    holds steps 0 and 1 back: ZeRO-1's zero_grad would drop them in the unchanged loop, ZeRO-2's keeps
    what it reduced, and neither leaves a trace on ``.grad`` (ZeRO's): refused before it runs. The next
    trajectory on the same engine then runs its JAGG window as planned."""
    engine = _engine(copy.deepcopy(base), stage, 2, 1.0)
    cond, trajs = _inputs(base, rank, 2)
    sw = jaggc.stepwise(engine, window=4, weights="t")
    error = None
    ts, zs, gs = trajs[0]
    try:
        for n, j in enumerate(sw.steps(list(range(T)), ts)):
            out = engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
            engine.backward(_loss(out, gs[j]))
            engine.step()
            if n == 1:
                {"engine": engine, "optimizer": engine.optimizer, "module": engine.module}[call].zero_grad()
    except JaggUnsupportedError as e:
        error = str(e)
    windows = sw.counts.jagg_windows
    ts, zs, gs = trajs[1]           # the next trajectory (no engine.step: the boundary is not reached)
    for j in sw.steps(list(range(T)), ts):
        out = engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
        engine.backward(_loss(out, gs[j]))
    counts = vars(sw.counts).copy()
    sw.close()
    return dict(error=error, windows_before=windows, counts=counts)


def early_end(base, stage: int, rank: int) -> dict:
    """The loop left by ``break`` after steps 0 and 1 ran their backward (window 0 holds them back):
    outside ``engine.backward`` ZeRO takes no gradient, so jaggc cannot run the window exactly; the
    refusal is warned when Python closes the loop and raised at the next optimizer step or close()."""
    engine = _engine(copy.deepcopy(base), stage, 1, 1.0)
    cond, [(ts, zs, gs)] = _inputs(base, rank, 1)
    jaggc.stepwise(engine, window=4, weights="t")
    for n, j in enumerate(jaggc.stepwise(engine).steps(list(range(T)), ts)):
        out = engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
        engine.backward(_loss(out, gs[j]))
        engine.step()
        if n == 1:
            break
    try:
        jaggc.stepwise(engine).close()
        error = None
    except JaggUnsupportedError as e:
        error = str(e)
    return dict(error=error)


def whole_loss(base, stage: int, rank: int) -> dict:
    """The whole-loss path: one ``engine.backward`` of the compiled loss (gradient_accumulation_steps
    1): the reduced gradient ZeRO holds after it."""
    from deepspeed.utils import safe_get_full_grad

    engine = _engine(copy.deepcopy(base), stage, 1, 0.0, gas=1)
    cond, [(ts, zs, gs)] = _inputs(base, rank, 1)

    @jaggc.jagg_compile(window=4, weights="t")
    def loss_fn(dit, zs, ts):
        return sum(_loss(dit(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0], gs[j])
                   for j in range(T))

    try:
        loss = loss_fn(engine, zs, ts)
    except JaggUnsupportedError as e:
        return dict(refused=str(e))
    with torch.no_grad():       # the loss's value as written, on the module's own weights
        value = sum(_loss(base(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0], gs[j])
                    for j in range(T))
    engine.backward(loss)
    grad = {name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()}
    return dict(grad=grad, trained=loss_fn.report.trained_calls, path=loss_fn.report.path,
                value=float(loss.detach()), value_ref=float(value))


def whole_loss_guard(base, rank: int) -> str | None:
    """A guarded ``jagg_compile`` loss on a ZeRO-2 engine: refused at its first call (its probe reads ``.grad``)."""
    engine = _engine(copy.deepcopy(base), 2, 1, 0.0, gas=1)
    cond, [(ts, zs, gs)] = _inputs(base, rank, 1)

    @jaggc.jagg_compile(window=4, weights="t", guard=jaggc.Guard(every=1))
    def loss_fn(dit, zs, ts):
        return sum(_loss(dit(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0], gs[j])
                   for j in range(T))

    try:
        loss_fn(engine, zs, ts)
    except JaggUnsupportedError as e:
        return str(e)
    return None


W4_CASES = [(stage, order, trajectories, clip) for stage in (1, 2) for order in ("sigma", "random")
            for trajectories, clip in ((1, 1.0), (2, 0.0))]
ACC_CASES = [(stage, order, 1) for stage in (1, 2) for order in ("sigma", "random")]
MODE_CASES = [(2, order, 1, 1.0, mode) for mode in ("lowmem", "per_window") for order in ("sigma", "random")]
GUARD_CASES = [(stage, order) for stage in (1, 2) for order in ("sigma", "random")]
ZERO_GRAD_CALLS = ("engine", "optimizer", "module")
#: ZeRO-2 bucket size (elements) that cuts the tiny model's gradient into several reductions per backward
SMALL_BUCKET = 5000
W2_CASES = [(stage, order, trajectories, clip) for stage in (1, 2) for order, trajectories, clip in
            (("sigma", 1, 1.0), ("random", 2, 0.0))]


def off_policy_loop(base, stage: int, rank: int, rollout_cache) -> dict:
    """Two trajectories recorded by one rollout, then trained with an engine step after each (the boundary is
    one trajectory's steps): the second is off-policy. ZeRO writes its step into the parameters without
    bumping their version counters (runtime/engines.py ``steps_through_copies``). The reduced gradient at
    each boundary, the counts, the parameters after."""
    from deepspeed.utils import safe_get_full_grad

    engine = _engine(copy.deepcopy(base), stage, 2, 1.0, gas=T)
    cond, trajs = _inputs(base, rank, 2)
    jaggc.stepwise(engine, window=4, weights="t", rollout_cache=rollout_cache)
    with torch.no_grad():
        for ts, zs, _ in trajs:
            for j in range(T):
                engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)
    grads = []
    for ts, zs, gs in trajs:
        for n, j in enumerate(jaggc.stepwise(engine).steps(list(range(T)), ts)):
            out = engine(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
            engine.backward(_loss(out.float(), gs[j]))
            if n == T - 1:
                grads.append({name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()})
            engine.step()
    counts = vars(jaggc.stepwise(engine).counts).copy()
    jaggc.stepwise(engine).close()
    return dict(grads=grads, counts=counts, params={n: p.detach().clone() for n, p in engine.module.named_parameters()})


def bare_module_cache(base) -> str | None:
    """A rollout cache of ``engine.module`` without its ZeRO engine: refused (its steps would go unseen)."""
    from jaggc.runtime.rollout_cache import RolloutCache

    engine = _engine(copy.deepcopy(base), 2, 1, 1.0)
    RolloutCache(engine.module, first_order=True, engine=engine)       # with the engine: accepted
    try:
        RolloutCache(engine.module, first_order=True)
    except JaggUnsupportedError as e:
        return str(e)
    return None


def rank_body(rank: int, world: int) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    base = models.sd3("tiny")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in W2_CASES:
            out[("w2",) + case] = (run_loop(base, *case, rank, None), run_loop(base, *case, rank, 2))
        refs = {n: reference(base, rank, n, 4) for n in (1, 2)}
        for case in W4_CASES:
            out[("w4",) + case] = (run_loop(base, *case, rank, 4), refs[case[2]])
        for order in ("sigma", "random"):
            out[("small_buckets", order)] = (run_loop(base, 2, order, 1, 1.0, rank, None, bucket=SMALL_BUCKET),
                                             run_loop(base, 2, order, 1, 1.0, rank, 4, bucket=SMALL_BUCKET), refs[1])
        for case in MODE_CASES:
            out[("mode",) + case] = (run_loop(base, *case[:4], rank, 4, backward=case[4]), refs[case[2]])
        for order in ("sigma", "random"):
            out[("cache", order)] = run_loop(base, 2, order, 1, 1.0, rank, 4, rollout_cache=True)
        for stage in (1, 2):
            for cache in (True, "first_order"):
                out[("off_policy", stage, cache)] = off_policy_loop(base, stage, rank, cache)
        out["bare_module_cache"] = bare_module_cache(base)
        out["bf16"] = (run_loop(base, 2, "sigma", 1, 1.0, rank, None, bf16=True),
                       run_loop(base, 2, "sigma", 1, 1.0, rank, 2, bf16=True))
        for stage in (1, 2):
            out[("unchanged", stage)] = run_loop(base, stage, "sigma", 1, 1.0, rank, None)
            out[("unchanged_zero_grad", stage)] = run_loop(base, stage, "sigma", 1, 1.0, rank, None, zero_grad_after=1)
        out["exact"] = exact_reference(base, rank)
        for case in GUARD_CASES:
            out[("guard",) + case] = run_loop(base, case[0], case[1], 1, 1.0, rank, 4, guard=True)
        out["subset_refs"] = (reference(base, rank, 1, 4, order="subset"), exact_reference(base, rank, order="subset"))
        for stage in (1, 2):
            out[("subset", stage)] = (run_loop(base, stage, "subset", 1, 1.0, rank, 4),
                                      run_loop(base, stage, "subset", 1, 1.0, rank, 4, guard=True))
        try:
            jaggc.stepwise(_engine(copy.deepcopy(base), 2, 1, 1.0).module, window=4)
            out["bare"] = None
        except JaggUnsupportedError as e:
            out["bare"] = str(e)
        out["base"] = {n: p.detach().clone() for n, p in base.named_parameters()}
        for case in ACC_CASES:
            out[("acc",) + case] = accelerate_loop(base, *case, rank, 4)
        for stage in (1, 2):
            out[("acc_w2", stage)] = (accelerate_loop(base, stage, "sigma", 1, rank, None),
                                      accelerate_loop(base, stage, "sigma", 1, rank, 2))
        for stage in (1, 2):
            out[("acc_early_step", stage)] = accelerate_loop(base, stage, "sigma", 1, rank, 4, gas=2)
            out[("acc_early_end", stage)] = accelerate_loop(base, stage, "sigma", 1, rank, 4, break_after=1)
            for call in ZERO_GRAD_CALLS:
                out[("zero_grad", stage, call)] = zero_grad_inside_a_window(base, stage, rank, call)
        for stage in (1, 2):
            out[("early_step", stage)] = step_inside_a_window(base, stage, rank)
            out[("early_end", stage)] = early_end(base, stage, rank)
        for stage in (1, 2, 3):
            out[("whole", stage)] = whole_loss(base, stage, rank)
        out["whole_guard"] = whole_loss_guard(base, rank)
        out["whole_ref"] = {n: g * T for n, g in refs[1].items()}   # the summed loss, one backward
        try:     # ZeRO-3 is refused (runtime/engines.py ZERO3_STEPWISE; test_stepwise_deepspeed_zero3.py tests the path)
            jaggc.stepwise(_engine(copy.deepcopy(base), 3, 1, 1.0), window=4).close()
            out["zero3"] = None
        except JaggUnsupportedError as e:
            out["zero3"] = str(e)
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return run_ranks(rank_body, WORLD, tmp_path_factory, name="stepwise_deepspeed", timeout_s=TIMEOUT_S)


def _rel(a: dict, b: dict) -> float:
    fa = torch.cat([a[k].double().reshape(-1) for k in sorted(b)])
    fb = torch.cat([b[k].double().reshape(-1) for k in sorted(b)])
    return float((fa - fb).norm() / fb.norm())


@pytest.mark.parametrize("case", W2_CASES, ids=lambda c: f"zero{c[0]}-{c[1]}-traj{c[2]}-clip{c[3]}")
def test_w2_parameters_are_the_unchanged_loops(rank_results, case):
    for res in rank_results:
        unchanged, stepwise = res[("w2",) + case]
        assert _rel(unchanged["params"], res["base"]) > 1e-6          # the step moved them
        for n, p in unchanged["params"].items():
            torch.testing.assert_close(stepwise["params"][n], p, rtol=1e-6, atol=1e-6 * float(p.abs().max()), msg=n)
        assert stepwise["counts"]["jagg_windows"] == 0 and stepwise["counts"]["fallbacks"] == 0


@pytest.mark.parametrize("order", ["sigma", "random"])
def test_zero2_with_small_buckets(rank_results, order):
    """ZeRO-2 reducing each backward in several buckets (SMALL_BUCKET elements): the unchanged loop
    makes more all-reduces per step than with one bucket, and W=4's reduced gradient is still the
    ranks' average JAGG (1e-5), with fewer all-reduces than the unchanged loop."""
    for res in rank_results:
        unchanged, run, ref = res[("small_buckets", order)]
        one_bucket = res[("unchanged", 2)]
        assert unchanged["collectives"] > one_bucket["collectives"], (unchanged["collectives"], one_bucket["collectives"])
        assert run["counts"]["jagg_windows"] == 1 and run["counts"]["fallbacks"] == 0, run["counts"]
        assert _rel(run["grad"], ref) < 1e-5, _rel(run["grad"], ref)
        assert run["collectives"] < unchanged["collectives"], (run["collectives"], unchanged["collectives"])


@pytest.mark.parametrize("case", W4_CASES, ids=lambda c: f"zero{c[0]}-{c[1]}-traj{c[2]}-clip{c[3]}")
def test_w4_reduced_gradient_is_the_ranks_average_jagg(rank_results, case):
    for res in rank_results:
        run, ref = res[("w4",) + case]
        assert run["counts"]["jagg_windows"] == case[2] and run["counts"]["fallbacks"] == 0, run["counts"]
        assert _rel(run["grad"], ref) < 1e-5, _rel(run["grad"], ref)
        # SGD's step on the clipped reference gradient (DeepSpeed clips by max_norm / (norm + 1e-6))
        norm = float(torch.cat([g.reshape(-1) for g in ref.values()]).norm())
        clip = case[3]
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        want = {n: res["base"][n].double() - LR * coef * ref[n] for n in ref}
        step = {n: want[n] - res["base"][n].double() for n in ref}
        got = {n: run["params"][n].double() - res["base"][n].double() for n in ref}
        assert _rel(got, step) < 1e-4, _rel(got, step)      # a difference of fp32 parameters: 1e-2 * |g| steps
    a, b = (res[("w4",) + case][0]["grad"] for res in rank_results)
    assert _rel(a, b) < 1e-7        # the ranks hold the same reduced gradient


def test_zero3_is_refused_at_install(rank_results):
    """ZeRO-3 is refused at install while the two-rank fuzzer's ZeRO-3 cases fail (runtime/engines.py)."""
    for res in rank_results:
        assert res["zero3"] is not None and "ZeRO-3" in res["zero3"] and "stage 2" in res["zero3"], res["zero3"]


@pytest.mark.parametrize("stage", [1, 2])
def test_whole_loss_gradient_in_zeros_buffers(rank_results, stage):
    for res in rank_results:
        run = res[("whole", stage)]
        assert "refused" not in run, run
        assert run["trained"] == T and run["path"] == "fx", (run["trained"], run["path"])
        # the value: the same calls, batched knots rounding fp32 in another order (a few ulp)
        assert abs(run["value"] - run["value_ref"]) <= 1e-5 * abs(run["value_ref"]) + 1e-7, run
        assert _rel(run["grad"], res["whole_ref"]) < 1e-5, _rel(run["grad"], res["whole_ref"])


def test_whole_loss_zero3_is_refused_at_the_first_call(rank_results):
    for res in rank_results:
        refused = res[("whole", 3)].get("refused")
        assert refused is not None and "jagg_compile" in refused and "ZeRO-3" in refused and "stage 2" in refused


@pytest.mark.parametrize("case", MODE_CASES, ids=lambda c: f"zero{c[0]}-{c[1]}-{c[4]}")
def test_backward_modes(rank_results, case):
    """lowmem and per_window: the same gradient (their re-runs recompute the knots in fp32: 1e-5)."""
    for res in rank_results:
        run, ref = res[("mode",) + case]
        assert run["counts"]["jagg_windows"] == 1 and run["counts"]["fallbacks"] == 0, run["counts"]
        assert _rel(run["grad"], ref) < 1e-5, _rel(run["grad"], ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_collectives_per_trajectory(rank_results, stage):
    """σ order, W=4, T=6 (one JAGG window of 4, an exact one of 2): ZeRO-2 reduces in every backward that
    reaches a parameter (the tiny model's gradient fits one bucket: one all-reduce each), so stepwise
    reduces 3 times (the window's joint backward, the exact window's 2 steps) where the unchanged loop
    reduces 6; ZeRO-1 reduces once, at the boundary, in both. Counted over the steps' forward and
    backward; jaggc's three small plan all-reduces per declaration come on top."""
    for res in rank_results:
        unchanged = res[("unchanged", stage)]["collectives"]
        stepwise = res[("w4", stage, "sigma", 1, 1.0)][0]["collectives"]
        res.setdefault("table", []).append((stage, unchanged, stepwise))
        if stage == 2:
            assert stepwise < unchanged, (stepwise, unchanged)
        else:
            assert stepwise <= unchanged + 3, (stepwise, unchanged)
    print(f"ZeRO-{stage} collectives per trajectory: unchanged {unchanged}, stepwise W=4 {stepwise}")


def _figures(j: dict, x: dict) -> tuple[float, float]:
    fj = torch.cat([j[k].double().reshape(-1) for k in sorted(x)])
    fx = torch.cat([x[k].double().reshape(-1) for k in sorted(x)])
    return float(fj @ fx / (fj.norm() * fx.norm())), float((fj - fx).norm() / fx.norm())


def test_whole_loss_guard_is_refused_on_zero(rank_results):
    for res in rank_results:
        refused = res["whole_guard"]
        assert refused is not None and "guard" in refused and "ZeRO" in refused and "jaggc.stepwise" in refused


@pytest.mark.parametrize("case", GUARD_CASES, ids=lambda c: f"zero{c[0]}-{c[1]}")
def test_guard_figures_and_untouched_parameters(rank_results, case):
    stage, order = case
    figures = []
    for res in rank_results:
        guarded, unguarded = res[("guard",) + case], res[("w4", stage, order, 1, 1.0)][0]
        # the probe hands ZeRO nothing: the optimizer stepped on exactly the unguarded loop's gradient
        for name, p in unguarded["params"].items():
            assert torch.equal(guarded["params"][name], p), name
        assert guarded["counts"]["probe_backwards"] > 0
        cos_ref, rel_ref = _figures(res[("w4", stage, order, 1, 1.0)][1], res["exact"])
        (cos, rel), = guarded["figures"]
        # fp32 gradients against the float64 reference: summation-order roundoff ~1e-7 relative
        assert abs(cos - cos_ref) <= 1e-6 and abs(rel - rel_ref) <= 1e-6 * max(1.0, rel_ref), (cos, cos_ref, rel, rel_ref)
        assert rel_ref > 1e-4
        figures.append(guarded["figures"])
    assert figures[0] == figures[1]     # every rank the same figures


@pytest.mark.parametrize("stage", [1, 2])
def test_ranks_training_different_steps(rank_results, stage):
    """DanceGRPO's shape on ZeRO: each rank its own random subset of the steps in its own order (one
    W=4 window per rank, of different steps): ZeRO's reduced gradient is the ranks' average of their
    JAGGs (1e-5, as for W=4 above); guarded, the parameters are the unguarded run's bit for bit and
    the probe's figures are the same on both ranks and those of the ranks' average gradients (1e-6)."""
    assert set(_order(0, "subset", 0)) != set(_order(1, "subset", 0))       # the premise: other steps
    figures = []
    for res in rank_results:
        run, guarded = res[("subset", stage)]
        ref, exact = res["subset_refs"]
        assert run["counts"]["jagg_windows"] == 1 and run["counts"]["fallbacks"] == 0, run["counts"]
        assert _rel(run["grad"], ref) < 1e-5, _rel(run["grad"], ref)
        for name, p in run["params"].items():
            assert torch.equal(guarded["params"][name], p), name
        cos_ref, rel_ref = _figures(ref, exact)
        (cos, rel), = guarded["figures"]
        assert abs(cos - cos_ref) <= 1e-6 and abs(rel - rel_ref) <= 1e-6 * max(1.0, rel_ref), (cos, cos_ref, rel, rel_ref)
        figures.append(guarded["figures"])
    a, b = (res[("subset", stage)][0]["grad"] for res in rank_results)
    assert _rel(a, b) < 1e-7
    assert figures[0] == figures[1]


def test_the_engines_bare_module_is_refused(rank_results):
    """jaggc.stepwise(engine.module): ZeRO's hooks without the engine that takes their gradients;
    refused, naming the fix (the engine)."""
    for res in rank_results:
        assert res["bare"] is not None and "DeepSpeed ZeRO optimizer manages" in res["bare"] and "jaggc.stepwise(engine)" in res["bare"]


@pytest.mark.parametrize("case", ACC_CASES, ids=lambda c: f"zero{c[0]}-{c[1]}")
def test_accelerate_w4_reduced_gradient(rank_results, case):
    """accelerate's DeepSpeed plugin (``accumulate``, ``accelerator.backward``, clip at the sync): the
    gradient ZeRO reduced when accelerator.backward steps the engine = the ranks' average JAGG."""
    for res in rank_results:
        run = res[("acc",) + case]
        assert run["counts"]["jagg_windows"] == 1 and run["counts"]["fallbacks"] == 0, run["counts"]
        ref = res[("w4", case[0], case[1], 1, 1.0)][1]
        assert _rel(run["grad"], ref) < 1e-5, _rel(run["grad"], ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_accelerate_w2_parameters_are_the_unchanged_loops(rank_results, stage):
    for res in rank_results:
        unchanged, stepwise = res[("acc_w2", stage)]
        assert _rel(unchanged["params"], res["base"]) > 1e-6
        for n, p in unchanged["params"].items():
            torch.testing.assert_close(stepwise["params"][n], p, rtol=1e-6, atol=1e-6 * float(p.abs().max()), msg=n)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_optimizer_step_inside_a_window_is_refused(rank_results, stage):
    for res in rank_results:
        r = res[("early_step", stage)]
        assert r["error"] is not None and "optimizer.step()" in r["error"], r
        assert not r["moved"]


@pytest.mark.parametrize("stage", [1, 2])
def test_an_engine_step_inside_a_window_through_accelerate_is_refused(rank_results, stage):
    """accelerate's ``gradient_accumulation_steps`` 2 under W=4: ``accelerator.backward`` steps the engine at
    its boundary while window 0 holds steps 0 and 1 back; the same pre-hook refuses it."""
    for res in rank_results:
        r = res[("acc_early_step", stage)]
        assert "error" in r and "optimizer.step()" in r["error"], r
        assert not r["moved"]


@pytest.mark.parametrize("call", ZERO_GRAD_CALLS)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_inside_a_window_is_refused(rank_results, stage, call):
    """ZeRO's zero_grad while a step's gradient is held back: refused, naming the call, the held-back
    steps and the fix; the next trajectory starts clean (its window runs JAGG, no fallback). A zero_grad
    while nothing is held back (every ``run_loop``'s, after its first forward) stays allowed: the W=4
    gradients above are the reference's."""
    for res in rank_results:
        r = res[("zero_grad", stage, call)]
        name = {"engine": "engine.zero_grad()", "optimizer": "engine.optimizer.zero_grad()",
                "module": "engine.module.zero_grad()"}[call]
        assert r["error"] is not None and name in r["error"] and "[0, 1]" in r["error"], r
        assert f"ZeRO-{stage}" in r["error"] and "accumulation boundary" in r["error"], r["error"]
        assert r["windows_before"] == 0
        assert r["counts"]["jagg_windows"] == 1 and r["counts"]["fallbacks"] == 0, r["counts"]


def test_what_zeros_zero_grad_drops_in_the_unchanged_loop(rank_results):
    """Why jaggc refuses ZeRO's zero_grad inside a window rather than drop the held-back steps as it does
    on ``.grad``: in the unchanged loop (``engine.zero_grad()`` after step 1's step, mid-accumulation)
    ZeRO-1 drops steps 0 and 1, ZeRO-2 keeps them (already reduced into its partitions). If DeepSpeed
    changes this, the docs' statement (distributed.md, Limits) must change with it."""
    for res in rank_results:
        kept = {stage: _rel(res[("unchanged_zero_grad", stage)]["grad"], res[("unchanged", stage)]["grad"])
                for stage in (1, 2)}
        assert kept[1] > 1e-3 and kept[2] < 1e-7, kept


@pytest.mark.parametrize("stage", [1, 2])
def test_an_early_end_with_a_gradient_held_back_is_refused(rank_results, stage):
    """Raw engine and accelerate (``accumulate``, ``accelerator.backward``) alike."""
    for res in rank_results:
        for error in (res[("early_end", stage)]["error"], res[("acc_early_end", stage)].get("error")):
            assert error is not None and "engine.backward" in error and f"ZeRO-{stage}" in error, error
        assert not res[("acc_early_end", stage)]["moved"]


def test_bf16_w2_reduced_gradient_is_the_unchanged_loops(rank_results):
    """ZeRO-2 with ``"bf16": {"enabled": true}`` (bf16 module, fp32 partitions): W=2 runs every step's
    own backward as the unchanged loop does, so ZeRO's reduced gradient is the same (2^-8 relative:
    one bf16 rounding apart at most; measured equal)."""
    for res in rank_results:
        unchanged, stepwise = res["bf16"]
        assert _rel(stepwise["grad"], unchanged["grad"]) < 2 ** -8, _rel(stepwise["grad"], unchanged["grad"])
        print(f"bf16 ZeRO-2 W=2 reduced gradient vs unchanged: {_rel(stepwise['grad'], unchanged['grad']):.3g}")


@pytest.mark.parametrize("stage", [1, 2])
def test_an_engine_step_ends_on_policy_serving(rank_results, stage):
    """ZeRO's step writes the parameters through fp32 copies, bumping no version counter: the cache counts the
    engine optimizer's steps instead, so after the first boundary's step the plain cache serves nothing
    (every rank runs the second trajectory's interior forwards; before this, 4 calls were served: the
    second trajectory's from the rollout's outputs of parameters the step had moved)."""
    for res in rank_results:
        c = res[("off_policy", stage, True)]["counts"]
        assert c["cached_forwards"] == 2 and c["nograd_forwards"] == 2, c


@pytest.mark.parametrize("stage", [1, 2])
def test_first_order_serving_on_zero(rank_results, stage):
    """``rollout_cache="first_order"`` on ZeRO-1/2: the engine optimizer's step is the optimizer step serving
    accounts for (its end is the ZeRO step's, after the copies are written back), so the second trajectory's
    2 interior steps are served on both ranks, its knots one forward; its gradient has cosine > 0.9999 to the
    forwards' and the first (on-policy) trajectory's is theirs (fp32, one summation order); the ranks'
    parameters stay equal."""
    for res in rank_results:
        served, forwarded = res[("off_policy", stage, "first_order")], res[("off_policy", stage, True)]
        c = served["counts"]
        assert (c["cached_forwards"], c["first_order_served"], c["nograd_forwards"]) == (2, 2, 0), c
        assert c["batched_knot_forwards"] == 1 and c["first_order_missed"] == 0, c
        assert _rel(served["grads"][0], forwarded["grads"][0]) <= 1e-6
        a, b = (torch.cat([g[k].double().reshape(-1) for k in sorted(g)]) for g in (served["grads"][1], forwarded["grads"][1]))
        assert torch.nn.functional.cosine_similarity(a, b, 0) > 0.9999 and _rel(served["grads"][1], forwarded["grads"][1]) > 0
    a, b = (rank_results[r][("off_policy", stage, "first_order")]["params"] for r in (0, 1))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_cache_of_the_engines_module_without_the_engine_is_refused(rank_results):
    for res in rank_results:
        assert res["bare_module_cache"] is not None and "engine=engine" in res["bare_module_cache"]


@pytest.mark.parametrize("order", ["sigma", "random"])
def test_rollout_cache_on_zero2(rank_results, order):
    """``rollout_cache=True``: the rollout's no-grad calls through the engine are recorded and serve the
    steps' no-grad forwards (the ranks agree on every hit); the gradient is the reference's (1e-5)."""
    for res in rank_results:
        run = res[("cache", order)]
        ref = res[("w4", 2, order, 1, 1.0)][1]
        assert run["counts"]["cached_forwards"] >= 2 and run["counts"]["fallbacks"] == 0, run["counts"]
        assert _rel(run["grad"], ref) < 1e-5, _rel(run["grad"], ref)
