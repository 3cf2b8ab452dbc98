"""The stack users train on, for the first lent GPU: NCCL, CUDA tensors, CUDA bf16 (``pytest -m gpu``).

Skipped without CUDA (CI stays on the CPU); ``JAGGC_GPU_TESTS_ON_CPU=1`` runs the same checks on the
CPU with gloo (how they are kept working between GPU sessions). One process, world size 1: every
collective jaggc makes then runs through a real NCCL group, which refuses a CPU tensor.

* the engines on NCCL: DDP, FSDP2 and DeepSpeed ZeRO-2 (when installed) under ``jaggc.stepwise``
  (W=4, the guard probing every trajectory, the rollout cache serving interior steps), each against
  the same loop on the bare module (fp32: the same kernels, a world of one: equal to fp32 roundoff);
* the whole-loss (``@jagg_compile``) and stepwise paths on a CUDA bf16 DiT, against each other
  (cosine; nothing is exact in bf16), and ``jaggc.calibrate`` on it;
* host syncs per DiT call on the stepwise path, counted on real CUDA tensors (``HostSyncs``).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import socket
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import jaggc
from jaggc_studies import example_losses as el

ON_CPU = os.environ.get("JAGGC_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU),
                                 reason="needs CUDA (or JAGGC_GPU_TESTS_ON_CPU=1 for the CPU form)")]
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() and not ON_CPU else torch.device("cpu")
BACKEND = "nccl" if DEVICE.type == "cuda" else "gloo"
T = 8
COSINE = 0.999


# --- a stored Flow-GRPO trajectory on the device ---------------------------------------------------
def _problem(dtype=torch.float32):
    ex = el.build_example("flow_grpo_sd3", num_steps=T, batch=2, seed=0)
    model = ex.model.to(DEVICE, dtype)
    batch = {k: (v.to(DEVICE, dtype) if v.is_floating_point() else v.to(DEVICE)) if torch.is_tensor(v) else v
             for k, v in ex.batch.items()}
    return model, batch


def _step_loss(dit, batch, j):
    latents = batch["latents"][:, j]
    noise_pred = dit(hidden_states=latents, timestep=batch["timesteps"][:, j],
                     encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled_prompt_embeds"],
                     return_dict=False)[0]
    _, log_prob, _, _ = el.sde_step_with_logprob(noise_pred.float(), latents.float(), batch["sigmas"][:, j],
                                                 batch["sigmas_next"][:, j], batch["next_latents"][:, j].float(),
                                                 batch["sigma_max"])
    return el.ppo_clip(log_prob, batch["log_probs"][:, j].float(), batch["advantages"][:, j].float())


def _stepwise_loop(module, batch, jagg, *, rollout: bool, backward=None, step=None):
    """The rollout (no-grad calls the cache records) and one trajectory, a backward per step;
    ``step()`` after each step's backward but the last (DeepSpeed's ``engine.step`` counts micro-steps:
    the last one's is the boundary, whose reduced gradient the caller reads first)."""
    if rollout:
        with torch.no_grad():
            for j in range(T):
                _step_loss(module, batch, j)
    for n, j in enumerate(jagg.steps(range(T), batch["timesteps"])):
        loss = _step_loss(module, batch, j)
        (loss.backward() if backward is None else backward(loss))
        if step is not None and n < T - 1:
            step()


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), 0).item()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --- one process, a real NCCL group ----------------------------------------------------------------
@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    kwargs = dict(device_id=DEVICE) if DEVICE.type == "cuda" else {}
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), **kwargs)
    yield
    dist.destroy_process_group()


def _bare_reference(settings: dict) -> torch.Tensor:
    model, batch = _problem()
    jagg = jaggc.stepwise(model, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _stepwise_loop(model, batch, jagg, rollout=True)
    jagg.close()
    return _flat_grads(model)


SETTINGS = dict(window=4, weights="t", rollout_cache=True)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "zero2"])
def test_stepwise_on_each_engine_over_nccl(group, engine):
    settings = dict(SETTINGS, guard=jaggc.Guard(every=1))
    model, batch = _problem()
    backward = step = None
    if engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEVICE] if DEVICE.type == "cuda" else None)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer_blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    else:
        deepspeed = pytest.importorskip("deepspeed")
        deepspeed.init_distributed(dist_backend=BACKEND)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": T,
                  "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        wrapped, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                           config=config)
        backward, step = wrapped.backward, wrapped.step
    jagg = jaggc.stepwise(wrapped, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _stepwise_loop(wrapped, batch, jagg, rollout=True, backward=backward, step=step)
    counts = vars(jagg.counts).copy()
    assert counts["cached_forwards"] > 0 and settings["guard"].probed == 1
    if engine == "zero2":
        from deepspeed.utils import safe_get_full_grad

        # the boundary's reduced gradient, before its step; engine.backward divided each loss by the
        # accumulation steps
        grads = T * torch.cat([safe_get_full_grad(p).float().reshape(-1) for p in wrapped.module.parameters()])
    elif engine == "fsdp2":
        grads = torch.cat([p.grad.full_tensor().float().reshape(-1) for p in model.parameters() if p.grad is not None])
    else:
        grads = _flat_grads(model)
    jagg.close()
    assert _rel(grads, _bare_reference(SETTINGS)) < 1e-5


# --- the CUDA bf16 DiT ---------------------------------------------------------------------------
def test_whole_loss_and_stepwise_agree_in_bf16():
    model, batch = _problem(torch.bfloat16)

    def loss(dit, b):
        return sum(_step_loss(dit, b, j) for j in range(T))

    whole = copy.deepcopy(model)
    jaggc.jagg_compile(loss, window=4, weights="t")(whole, batch).backward()
    stepwise = copy.deepcopy(model)
    jagg = jaggc.stepwise(stepwise, window=4, weights="t")
    _stepwise_loop(stepwise, batch, jagg, rollout=False)
    jagg.close()
    assert _cosine(_flat_grads(stepwise), _flat_grads(whole)) > COSINE


def test_calibrate_on_the_device():
    model, batch = _problem()

    def loss(dit, b):
        return sum(_step_loss(dit, b, j) for j in range(T))

    result = jaggc.calibrate(loss, model, batch, target_cosine=0.9,
                             candidates=[dict(variant="jagg", window=4, weights="t", jagg_frac=1.0)])
    assert all(0.0 < row["cosine_mean"] <= 1.0 + 1e-9 for row in result["settings"])


# --- host syncs ------------------------------------------------------------------------------------
class HostSyncs(TorchDispatchMode):
    """Counts the ops whose result a device-to-host copy brings back (``.item()``, ``bool()``,
    ``.tolist()``, ``.cpu()``, ``nonzero``) on tensors of ``device_type``, made by a frame of jaggc."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.jaggc = str(Path(jaggc.__file__).resolve().parent)
        self.torch = str(Path(torch.__file__).resolve().parent)
        self.count = 0
        self.sites: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = any(isinstance(a, torch.Tensor) and a.device.type == self.device_type for a in args)
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
            and torch.device(kwargs["device"]).type == "cpu"
        if on_device and (func in self.READS or to_host):
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith(self.torch)
                                         or frame.f_code.co_filename == __file__):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(self.jaggc):
                self.count += 1
                site = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1
        return func(*args, **kwargs)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host syncs are a GPU's (on the CPU: tests/steps/test_stepwise_host_syncs.py)")
@pytest.mark.parametrize("rollout", [False, True], ids=["plain", "cache"])
def test_host_syncs_per_dit_call_on_the_stepwise_path(rollout):
    model, batch = _problem()
    jagg = jaggc.stepwise(model, window=4, weights="t", rollout_cache=rollout)
    _stepwise_loop(model, batch, jagg, rollout=rollout)          # the first trajectory learns
    model.zero_grad(set_to_none=True)
    mode = HostSyncs("cuda")
    with mode if not rollout else contextlib.nullcontext():
        if rollout:
            with torch.no_grad():
                for j in range(T):
                    _step_loss(model, batch, j)
            with mode:
                for j in jagg.steps(range(T), batch["timesteps"]):
                    _step_loss(model, batch, j).backward()
        else:
            _stepwise_loop(model, batch, jagg, rollout=False)
    jagg.close()
    assert mode.count <= T, mode.sites           # at most one per DiT call
