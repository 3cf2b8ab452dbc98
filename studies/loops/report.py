"""``jaggc trainers --loops``: the trainers' own loops with ``jaggc.stepwise``, measured per loop.

For Flow-GRPO, DanceGRPO and MixGRPO (``jaggc_studies.loops``):

  * lines changed: the user's diff, measured from the unchanged and the changed loop's source;
  * CPU time per trajectory of every variant (``speed.py``: each backward form, with the CFG slice,
    on-policy with the rollout cache) against the unchanged loop, interleaved rounds, beside the cost
    model priced with this machine's measured forward and backward of one step's call;
  * peak activation memory: the saved tensors' peak (``runtime/memory.py``) against the unchanged
    loop's, per variant;
  * collectives per trajectory (DanceGRPO, MixGRPO): FSDP1 reduce-scatters in a one-rank gloo group
    (per-rank counts do not depend on the world size), unchanged against stepwise.

Flow-GRPO runs with its KL reference forwards (beta 0.04), CFG, and LoRA as its default; its
backward through a LoRA model skips the frozen weights' gradients, so it costs about one forward,
which the measured B says.
"""

from __future__ import annotations

import socket
from typing import Callable

import torch

import jaggc
from jaggc.runtime.memory import track_saved_tensors
from jaggc_studies import loops
from jaggc_studies.bench.device import CudaPeakMemory
from jaggc_studies.loops.speed import (FORMS, baseline, epoch, guard_overhead, loop_setup, on_cuda, quiet, run_on,
                                       speed, variants, whole_epoch)
from jaggc_studies.trainers.sizes import Where


def memory(name: str, where: Where, *, forms=FORMS) -> dict:
    """Peak memory of one training epoch (after a warm epoch) per variant, and against the unchanged
    loop's (on-policy variants: the training after the sampling, against the unchanged loop's
    on-policy epoch). On the CPU: the autograd-saved tensors' peak; on CUDA: the allocator's peak."""
    loop = loop_setup(name, where)
    peaks = {}
    with run_on(where):
        for label, (kw, on_policy) in variants(loop, forms).items():
            run = loop.setup(stepwise=kw) if kw is not None else loop.setup()
            epoch(loop, run, on_policy, seed=100, changed=kw is not None)
            if on_policy:
                loop.sample(run, seed=101)
            meter = CudaPeakMemory(where.device) if on_cuda(where) else track_saved_tensors()
            with meter as stats:
                (loop.changed if kw is not None else loop.unchanged)(run)
            peaks[label] = stats.peak_bytes
            if kw is not None:
                jaggc.stepwise(run.transformer).close()
            del run
    kind = CudaPeakMemory.kind if on_cuda(where) else "autograd-saved tensors"
    return dict(kind=kind, peak_bytes=peaks,
                ratio={k: peaks[k] / peaks[baseline(k)] for k in peaks if not k.startswith("unchanged")})


def _collective_counts(rank: int, world: int, name: str, size: str, window: int) -> dict:
    from jaggc_studies.bench.sharded import count_collectives, wrap_dit

    loop = loop_setup(name, Where(size))
    out = {}
    with quiet():
        for form in ("unchanged", "joint", "lowmem"):
            stepwise = None if form == "unchanged" else dict(window=window, weights="t", backward=form)
            run = loop.setup(wrap=lambda m: wrap_dit(m, "fsdp1", checkpointing=False), stepwise=stepwise,
                             shard=(rank, world))
            with count_collectives() as counts:
                (loop.unchanged if form == "unchanged" else loop.changed)(run)
            out[form] = counts["reduce_scatter_single"] / len(run.samples_batched_list)
            if stepwise is not None:
                jaggc.stepwise(run.transformer).close()
    return out


def _rank(rank: int, world: int, port: int, queue, args) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        queue.put((rank, _collective_counts(rank, world, *args)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put((rank, f"{type(e).__name__}: {e}"))


def collectives(name: str, *, size: str = "tiny", window: int = 4, world: int = 2, timeout_s: float = 600) -> dict:
    """FSDP1 reduce-scatters per trajectory on each of ``world`` gloo ranks (forked from this
    process), unchanged and stepwise (DanceGRPO and MixGRPO)."""
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, queue, (name, size, window))) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout_s)
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"collective counts on {world} ranks failed: {failed}")
    return dict(world=world, reduce_scatters_per_trajectory=results[0])


def run_loops(names=loops.LOOPS, *, size: str = "10m", rounds: int = 5, where: Where | None = None,
              progress: Callable[[str], None] = print, forms=FORMS) -> dict:
    """Every loop's lines, memory, speed and (on the CPU) collectives, for the backward ``forms``;
    ``where`` (trainers/sizes.py) overrides ``size`` with a size, a device and a dtype."""
    where = where if where is not None else Where(size)
    results = {}
    for name in names:
        progress(f"{name} loop: lines changed, memory ...")
        row = dict(lines_changed=loops.lines_changed(name), diff=loops.user_diff(name))
        row["memory"] = memory(name, where, forms=forms)
        if rounds:
            progress(f"{name} loop: time against the unchanged loop, {rounds} rounds ({where.size}, {where.device}, "
                     f"{str(where.dtype).removeprefix('torch.')}) ...")
            row["speed"] = speed(name, where, rounds=rounds, forms=forms)
            progress(f"{name} loop: a whole epoch as the trainer runs it, sampling included ...")
            row["epoch"] = whole_epoch(name, where, rounds=rounds)
        if name != "flow_grpo" and not on_cuda(where):
            progress(f"{name} loop: FSDP1 reduce-scatters per trajectory ...")
            row["collectives"] = collectives(name)
        results[name] = row
    return results


def format_loops(results: dict) -> str:
    lines = ["the trainers' own loops with jaggc.stepwise (W=4, weights='t'; ratios: unchanged / stepwise; "
             "'/slice': cfg_slice=True, '/cache': on-policy, rollout_cache=True, against the unchanged loop on-policy; "
             "'/probe': every trajectory probed by the guard, against the unprobed form):"]
    for name, r in results.items():
        lines.append(f"  {name}: {r['lines_changed']} lines changed")
        m = r["memory"]
        if "speed" in r:
            s = r["speed"]
            units = s["cost_model"]["units"]
            lines.append(f"    {s['model']} on {s['device']} ({s['dtype']}, {s['clock']} time), "
                         f"{s['trainable'] / 1e6:.2f}M trained of {s['params'] / 1e6:.1f}M, "
                         f"{s['rounds']} rounds; peak memory: {m['kind']}; measured one step's call: "
                         + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in units.items())
                         + f"; unchanged {s['seconds_per_trajectory']['unchanged']:.3f} s per trajectory"
                         + (f", of which {s['cost_model']['shared_s']:.3f} s not in its modelled DiT passes"
                            if "shared_s" in s["cost_model"] else ""))
            for label in s["median"]:
                extra = (f", sampling {s['rollout_s'][label]:.2f} s (unchanged's {s['rollout_s'][baseline(label)]:.2f})"
                         if label in s["rollout_s"] else "")
                if label.endswith("/probe"):
                    extra += (f"; vs {baseline(label)}: Guard(every=8) adds {100 * guard_overhead(s['median'][label]):.1f}% "
                              f"[{100 * guard_overhead(s['max'][label]):.1f}-{100 * guard_overhead(s['min'][label]):.1f}] "
                              f"(cost model {100 * guard_overhead(s['cost_model']['ratio'][label]):.1f}%)")
                shared = s["cost_model"].get("ratio_with_shared", {})
                lines.append(f"    {label:22s} {s['median'][label]:.2f}x [{s['min'][label]:.2f}-{s['max'][label]:.2f}]"
                             f"  cost model {s['cost_model']['ratio'][label]:.2f}x"
                             + (f" ({shared[label]:.2f}x with the loop's other work)" if label in shared else "")
                             + f"  {s['seconds_per_trajectory'][label]:.3f} s/trajectory"
                             f"  peak memory {m['ratio'][label]:.2f}x{extra}")
        else:
            lines.append("    peak memory " + ", ".join(f"{f} {v:.2f}x" for f, v in m["ratio"].items()))
        if "epoch" in r:
            e = r["epoch"]
            lines.append(f"    a whole epoch ({e['variant']}): training {e['training']['median']:.2f}x "
                         f"[{e['training']['min']:.2f}-{e['training']['max']:.2f}], sampling included "
                         f"{e['epoch']['median']:.2f}x [{e['epoch']['min']:.2f}-{e['epoch']['max']:.2f}]")
        if "collectives" in r:
            c = r["collectives"]["reduce_scatters_per_trajectory"]
            lines.append("    FSDP1 reduce-scatters per trajectory " + ", ".join(f"{f} {v:g}" for f, v in c.items()))
        else:
            lines.append("    collectives: one DDP sync per trajectory in both (accelerate's accumulate)")
    return "\n".join(lines)


__all__ = ["collectives", "format_loops", "memory", "run_loops"]
