"""Sharded training with JAGG: what each backward mode costs under DDP, FSDP1 and FSDP2, measured.

    torchrun --nproc-per-node 2 -m jaggc_studies.bench.sharded                 # tiny Flux, 2 gloo ranks
    torchrun --nproc-per-node 2 -m jaggc_studies.bench.sharded --size 10m --steps 16 --out table.md

Every rank trains its share of one global batch of a DanceGRPO-style loss (``dance_grpo_loss``:
DanceGRPO's ``flux_step`` log-probability and its PPO clip, clip range 1e-4) on a diffusers Flux
transformer, wrapped as the trainers wrap it: DDP; FSDP1 with one unit per transformer block,
FULL_SHARD, ``use_orig_params`` False (what DanceGRPO passes) or True; FSDP2 ``fully_shard`` per
block, then the root. Each with and without activation checkpointing (``apply_activation_checkpointing``
with non-reentrant checkpoint wrappers on the blocks; after the FSDP1 wrap as DanceGRPO does, before
``fully_shard`` for FSDP2 as torchtitan does). Per backward mode of ``@jagg_compile`` and the
trainers' own per-step loop (one ``backward()`` per step), one loss evaluation and its backward:

  * works, or the first line of the error;
  * collectives per loss, counted by wrapping the ``torch.distributed`` functions FSDP calls
    (``reduce_scatter_single``, ``all_gather_single``, ``all_gather_into_tensor``, ``all_gather``) and with a
    counting comm hook for DDP's all-reduces (one per gradient bucket);
  * peak activations per rank: the peak live bytes of the storages autograd saved for backward
    (``runtime/memory.py``; FSDP1's views of its unsharded parameters are not counted);
  * the low-memory mode's gradient buffer per rank (storage bytes of its tensors), and the largest
    gradient storage the wrapper itself held at any DiT forward after the first (FSDP's flat or
    sharded ``.grad``, unsharded inside no_sync; DDP's ``.grad``): what a mode keeps between windows.

Nothing is timed: on 2 CPU processes time says little about a GPU cluster; the cost model
(README, docs/benchmarks.md) gives the forward/backward counts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from jaggc_studies import example_losses as el
from jaggc._compat import apply_activation_checkpointing, fsdp_gradient_slots, fsdp_version
from jaggc.runtime.memory import storage_bytes, track_saved_tensors
from jaggc_studies.bench.problems import build_problem

WRAPPERS = ("ddp", "fsdp1", "fsdp1_orig", "fsdp2")
MODES = ("joint", "per_window", "lowmem", "per_step")
DANCE_CLIP_RANGE = 1e-4       # DanceGRPO's clip_range
# what FSDP2 and FSDP1 call in torch 2.13 (FSDP1 all-gathers a CPU flat parameter with all_gather)
COLLECTIVES = ("reduce_scatter_single", "all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce")


def dance_grpo_loss(transformer, batch):
    """DanceGRPO's per-step loss (train_grpo_flux.py's grpo_one_step): flux_step log-prob, PPO clip
    with its clip range, each step divided by the number of trained steps; summed over the steps."""
    num_steps = batch["timesteps"].shape[1]
    total = 0.0
    for j in range(num_steps):
        latents = batch["latents"][:, j]
        pred = transformer(hidden_states=latents, encoder_hidden_states=batch["encoder_hidden_states"],
                           timestep=batch["timesteps"][:, j] / 1000, pooled_projections=batch["pooled_prompt_embeds"],
                           txt_ids=batch["text_ids"], img_ids=batch["image_ids"], joint_attention_kwargs=None,
                           return_dict=False)[0]
        log_prob = el.flux_step(pred, latents.to(torch.float32), el.ETA, batch["sigmas"][:, j],
                                batch["sigmas_next"][:, j], batch["next_latents"][:, j].to(torch.float32))
        loss = el.ppo_clip(log_prob, batch["log_probs"][:, j], batch["advantages"][:, j], DANCE_CLIP_RANGE)
        total = total + loss / num_steps
    return total


# the stored rollout's keys (jaggc_studies.bench.problems' Flux problem): per sample and step, per sample,
# and shared (position ids, the schedule's sigma_max)
STEP_KEYS = ("latents", "next_latents", "timesteps", "sigmas", "sigmas_next", "log_probs", "advantages")
SAMPLE_KEYS = STEP_KEYS + ("encoder_hidden_states", "pooled_prompt_embeds")


def rank_share(batch: dict, rank: int, world: int) -> dict:
    """The rank's contiguous share of a global batch (every per-sample tensor; ids are shared)."""
    per = batch["latents"].shape[0] // world
    return {k: v[rank * per:(rank + 1) * per] if k in SAMPLE_KEYS else v for k, v in batch.items()}


def step_slice(batch: dict, steps: slice) -> dict:
    """The batch restricted to some trained steps."""
    return {k: v[:, steps] if k in STEP_KEYS else v for k, v in batch.items()}


def _blocks():
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    return FluxTransformerBlock, FluxSingleTransformerBlock


def checkpoint_blocks(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing on every transformer block (DanceGRPO's
    apply_fsdp_checkpointing)."""
    blocks = _blocks()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, blocks))


def wrap_dit(model: nn.Module, wrapper: str, *, checkpointing: bool, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` wrapped as the trainers wrap it (module docstring); needs a process group.
    ``param_dtype`` (FSDP2): a ``MixedPrecisionPolicy`` computing in that dtype, gradients reduced
    in float32 (what bf16 training of a 12B DiT uses)."""
    if wrapper == "ddp":
        if checkpointing:
            checkpoint_blocks(model)
        return nn.parallel.DistributedDataParallel(model)
    if wrapper in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(set(_blocks())),
                                           sharding_strategy=ShardingStrategy.FULL_SHARD,
                                           use_orig_params=wrapper == "fsdp1_orig", device_id=device)
        if checkpointing:
            checkpoint_blocks(wrapped)
        return wrapped
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if checkpointing:
            checkpoint_blocks(model)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
        options = dict(mp_policy=policy) if policy is not None else {}
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            fully_shard(block, **options)
        return fully_shard(model, **options)
    raise ValueError(f"wrapper {wrapper!r}: use one of {WRAPPERS}")


@contextlib.contextmanager
def count_collectives(ddp: nn.Module | None = None):
    """Counts of the torch.distributed calls FSDP makes while the context is open (a dict by
    function name), plus ``allreduce_buckets`` of ``ddp`` (a DDP module: its comm hook)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    counts["allreduce_buckets"] = 0
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    if ddp is not None:
        _DDP_COUNTS[id(ddp)] = counts
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        _DDP_COUNTS.pop(id(ddp), None)


_DDP_COUNTS: dict[int, dict] = {}


def install_ddp_counter(ddp: nn.Module) -> None:
    """A comm hook that all-reduces as DDP's default does and counts buckets for count_collectives."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        counts = _DDP_COUNTS.get(id(ddp))
        if counts is not None:
            counts["allreduce_buckets"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)


class GradientWatch:
    """The largest gradient storage the wrapper holds at any DiT forward after the first."""

    def __init__(self, dit: nn.Module):
        self.dit, self.peak, self.forwards = dit, 0, 0
        self.slots = fsdp_gradient_slots(dit) if fsdp_version(dit) else None

    def held(self) -> int:
        if self.slots is not None:
            return storage_bytes(g for s in self.slots for g in s.held())
        return storage_bytes(p.grad for p in self.dit.parameters())

    def __enter__(self):
        def before(module, args):
            self.forwards += 1
            if self.forwards > 1:
                self.peak = max(self.peak, self.held())

        before._jaggc_observer = True
        self.handle = self.dit.register_forward_pre_hook(before)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def parameter_storages(dit: nn.Module):
    """What ``track_saved_tensors`` must not count as activations: FSDP1's unsharded FlatParameters."""
    leaves = [s.graph_leaf() for s in fsdp_gradient_slots(dit)] if fsdp_version(dit) == 1 else []
    return lambda: leaves


def gradient_sizes(dit: nn.Module, full_numel: int) -> dict:
    """Bytes of one full gradient and of this rank's shard of it (what FSDP's sharded .grad takes)."""
    full = full_numel * 4
    shard = storage_bytes(s.shard() for s in fsdp_gradient_slots(dit)) if fsdp_version(dit) else full
    return dict(full_grad_bytes=full, shard_bytes=shard)


@dataclass
class Row:
    wrapper: str
    checkpointing: bool
    mode: str
    works: bool = True
    error: str = ""
    collectives: dict = field(default_factory=dict)
    peak_activation_bytes: int = 0
    buffer_bytes: int = 0
    held_grad_bytes: int = 0


def run_mode(dit: nn.Module, batch: dict, mode: str, *, window: int) -> Row:
    """One loss and its backward in ``mode`` (a backward mode, or the per-step loop)."""
    from jaggc import jagg_compile

    row = Row("", False, mode)
    compiled = None if mode == "per_step" else jagg_compile(dance_grpo_loss, dit=dit, window=window, weights="t",
                                                            backward=mode)
    for p in dit.parameters():
        p.grad = None
    try:
        ddp = dit if isinstance(dit, nn.parallel.DistributedDataParallel) else None
        with count_collectives(ddp) as counts, track_saved_tensors(parameter_storages(dit)) as saved, \
                GradientWatch(dit) as watch:
            if compiled is None:
                num_steps = batch["timesteps"].shape[1]
                for j in range(num_steps):
                    (dance_grpo_loss(dit, step_slice(batch, slice(j, j + 1))) / num_steps).backward()
            else:
                compiled(dit, batch).backward()
        row.collectives = dict(counts)
        row.peak_activation_bytes = saved.peak_bytes
        row.held_grad_bytes = watch.peak
        row.buffer_bytes = (compiled.report.lowmem_buffer_bytes or 0) if compiled is not None else 0
    except Exception as e:  # noqa: BLE001 - the table reports what fails, and how
        row.works, row.error = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def measure(*, size: str, steps: int, window: int, batch: int, wrappers=WRAPPERS, modes=MODES) -> tuple[list[Row], dict]:
    """Every (wrapper, checkpointing, mode) row on this rank (collective: call it on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = build_problem("flux", size, num_steps=steps, batch=batch, seed=0)
    share = rank_share(problem.batch, rank, world)
    rows, sizes = [], {}
    for wrapper in wrappers:
        for checkpointing in (False, True):
            dit = wrap_dit(copy.deepcopy(problem.model), wrapper, checkpointing=checkpointing)
            if wrapper == "ddp":
                install_ddp_counter(dit)
            sizes[wrapper] = gradient_sizes(dit, problem.num_params)
            for mode in modes:
                row = run_mode(dit, share, mode, window=window)
                row.wrapper, row.checkpointing = wrapper, checkpointing
                rows.append(row)
    return rows, sizes


def _collectives(row: Row) -> str:
    c = row.collectives
    if not row.works:
        return "-"
    if row.wrapper == "ddp":
        return f"{c['allreduce_buckets']} all-reduce"
    gathers = c["all_gather_single"] + c["all_gather_into_tensor"] + c["all_gather"]
    return f"{c['reduce_scatter_single']} RS, {gathers} AG"


def _kb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def format_table(rows: list[Row], sizes: dict, command: str) -> str:
    lines = [f"Measured with `{command}` (per rank; 'RS' reduce-scatters, 'AG' all-gathers, DDP: all-reduced buckets).",
             "", "| wrapper | AC | mode | works | collectives / loss | peak activations | lowmem buffer | "
             "gradient held at later forwards |", "|---|---|---|---|---|---|---|---|"]
    names = {"ddp": "DDP", "fsdp1": "FSDP1 `use_orig_params=False`", "fsdp1_orig": "FSDP1 `use_orig_params=True`",
             "fsdp2": "FSDP2"}
    modes = {"per_step": "per-step loop (trainer's own)"}
    for r in rows:
        works = "yes" if r.works else f"refused: {r.error}"
        lines.append(f"| {names[r.wrapper]} | {'yes' if r.checkpointing else 'no'} | {modes.get(r.mode, r.mode)} | "
                     f"{works} | {_collectives(r)} | {_kb(r.peak_activation_bytes) if r.works else '-'} | "
                     f"{_kb(r.buffer_bytes) if r.mode == 'lowmem' and r.works else '-'} | "
                     f"{_kb(r.held_grad_bytes) if r.works else '-'} |")
    lines += ["", "One gradient: " + ", ".join(
        f"{names[w]} full {_kb(s['full_grad_bytes'])}, rank's shard {_kb(s['shard_bytes'])}" for w, s in sizes.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "10m"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks)")
    parser.add_argument("--wrappers", default=",".join(WRAPPERS), help=f"comma-separated subset of {WRAPPERS}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--out", default=None, help="also write the table to this file (rank 0)")
    args = parser.parse_args(argv)
    wrappers, modes = args.wrappers.split(","), args.modes.split(",")
    unknown = sorted(set(wrappers) - set(WRAPPERS)) + sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown wrapper or mode {unknown}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")   # FSDP2 on diffusers' outputs
    dist.init_process_group("gloo")
    try:
        rows, sizes = measure(size=args.size, steps=args.steps, window=args.window, batch=args.batch,
                              wrappers=wrappers, modes=modes)
        subset = "".join(f" --{k} {','.join(v)}" for k, v, full in (("wrappers", wrappers, WRAPPERS),
                                                                     ("modes", modes, MODES)) if tuple(v) != full)
        command = (f"torchrun --nproc-per-node {dist.get_world_size()} -m jaggc_studies.bench.sharded --size {args.size} "
                   f"--steps {args.steps} --window {args.window} --batch {args.batch}{subset}")
        if dist.get_rank() == 0:
            table = format_table(rows, sizes, command)
            print(table)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(table + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
