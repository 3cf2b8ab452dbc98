"""``jaggc trainers --loops``: the trainers' own loops with ``jaggc.stepwise``, measured per loop.

For Flow-GRPO, DanceGRPO and MixGRPO (``jaggc_studies.loops``):

  * lines changed: the user's diff, measured from the unchanged and the changed loop's source;
  * CPU time of one epoch of the loop (trajectories of the 10m models) against the unchanged loop,
    W=4 plain JAGG (``weights="t"``) per backward form, interleaved rounds (unchanged, then each
    form, per round), process CPU time, one thread; the ratio's median and range, and the cost
    model with this machine's measured forward and backward times;
  * peak activation memory: the saved tensors' peak (``runtime/memory.py``) against the unchanged
    loop's, per form;
  * collectives per trajectory (DanceGRPO, MixGRPO): FSDP1 reduce-scatters in a one-rank gloo group
    (per-rank counts do not depend on the world size), unchanged against stepwise.

Flow-GRPO runs with its KL reference forwards (beta 0.04) and CFG, and LoRA as its default; its
backward through a LoRA model skips the frozen weights' gradients, so it costs about one forward,
not two, which lowers the cost model from 1.33x to what ``cost_model`` prints.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
import warnings
from typing import Callable

import torch

import jaggc
from jaggc.runtime.memory import track_saved_tensors
from jaggc.runtime.module_state import unwrap
from jaggc_studies import loops
from jaggc_studies.loops import dance_grpo as dg, flow_grpo as fg, mix_grpo as mg

FORMS = ("joint", "lowmem", "per_window")


def _setups(name: str, size: str) -> tuple[Callable, Callable, Callable]:
    """(setup(stepwise=...), train_unchanged, train_jaggc) of a loop at ``size``. The Flux loops'
    latents are 8 x 8 packed tokens at 10m (64: 16 tokens leave a CPU latency-bound, where a
    backward costs 1.25 forwards instead of the 2 it costs at 64 tokens and beyond, and at the
    thousands of a real image), 4 x 4 on the tiny model."""
    side = 8 if size == "10m" else 4
    if name == "flow_grpo":
        return (lambda **kw: fg.setup(size=size, num_steps=8, batch=2, trajectories=1, **kw),
                fg.train_unchanged, fg.train_jaggc)
    if name == "dance_grpo":
        # its finetune_flux_grpo.sh: 16 sampling steps (15 stored), 60% trained (9: windows of 4, 4, 1),
        # an optimizer step every 4 samples, gradient checkpointing
        return (lambda **kw: dg.setup(size=size, num_steps=15, samples=4, fraction=0.6, gradient_accumulation_steps=4,
                                      checkpointing=True, side=side, **kw), dg.train_unchanged, dg.train_jaggc)
    # its 4-step window at the start of the run, an optimizer step every 3 samples
    return (lambda **kw: mg.setup(size=size, samples=3, gradient_accumulation_steps=3, side=side, **kw),
            mg.train_unchanged, mg.train_jaggc)


def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def speed(name: str, *, size: str = "10m", rounds: int = 5, window: int = 4, forms=FORMS) -> dict:
    """Interleaved CPU-time rounds of the unchanged loop and each stepwise form, each round in a
    rotated order (module docstring)."""
    setup, unchanged, changed = _setups(name, size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _quiet():
            base = setup()
            runs = {form: setup(stepwise=dict(window=window, weights="t", backward=form)) for form in forms}
            unchanged(base)
            for form, run in runs.items():
                changed(run)                       # warm: the first trajectory's one-off costs
            times = {"unchanged": []} | {form: [] for form in forms}
            order = ["unchanged"] + list(forms)
            for r in range(rounds):
                # each round in another order: no form always runs right after another
                for form in order[r % len(order):] + order[:r % len(order)]:
                    t = time.process_time()
                    unchanged(base) if form == "unchanged" else changed(runs[form])
                    times[form].append(time.process_time() - t)
            counts = {form: vars(jaggc.stepwise(run.transformer).counts).copy() for form, run in runs.items()}
            for run in runs.values():
                jaggc.stepwise(run.transformer).close()
    finally:
        torch.set_num_threads(threads)
    ratios = {form: [u / v for u, v in zip(times["unchanged"], times[form])] for form in forms}
    model = base.transformer
    return dict(model=f"{type(unwrap(model)).__name__}-{size}",
                params=sum(p.numel() for p in model.parameters()),
                trainable=sum(p.numel() for p in model.parameters() if p.requires_grad), rounds=rounds,
                median={f: statistics.median(r) for f, r in ratios.items()},
                min={f: min(r) for f, r in ratios.items()}, max={f: max(r) for f, r in ratios.items()},
                seconds={k: statistics.median(v) for k, v in times.items()}, counts=counts,
                cost_model=cost_model(name, size))


def cost_model(name: str, size: str, window: int = 4) -> dict:
    """The per-window cost of each form against the unchanged loop, from this machine's forward (F)
    and backward (B) times of one step's DiT call: unchanged W (F + B) (+ W F for Flow-GRPO's KL
    reference forwards), joint W F + 2 B (+ W F), per_window (W + 2) F + 2 B."""
    setup, _, _ = _setups(name, size)
    with _quiet():
        run = setup()
    call = _one_call(name, run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = call()
        g = torch.randn_like(out)

        def median_ms(fn, n=5):
            fn()
            ts = []
            for _ in range(n):
                t = time.process_time()
                fn()
                ts.append(time.process_time() - t)
            return statistics.median(ts)

        with torch.no_grad():
            forward = median_ms(call)
        both = median_ms(lambda: call().backward(g))
    finally:
        torch.set_num_threads(threads)
    backward = max(both - forward, 1e-9)
    reference = window * forward if name == "flow_grpo" else 0.0
    unchanged = window * (forward + backward) + reference
    return dict(forward_s=forward, backward_s=backward,
                joint=unchanged / (window * forward + 2 * backward + reference),
                per_window=unchanged / ((window + 2) * forward + 2 * backward + reference))


def _one_call(name: str, run) -> Callable:
    """One step's DiT call of the loop, as it calls it (the CFG batch for Flow-GRPO)."""
    if name == "flow_grpo":
        s = run.samples_batched[0]
        embeds = torch.cat([run.train_neg_prompt_embeds[:len(s["prompt_embeds"])], s["prompt_embeds"]])
        pooled = torch.cat([run.train_neg_pooled_prompt_embeds[:len(s["pooled_prompt_embeds"])],
                            s["pooled_prompt_embeds"]])
        return lambda: run.transformer(hidden_states=torch.cat([s["latents"][:, 0]] * 2),
                                       timestep=torch.cat([s["timesteps"][:, 0]] * 2), encoder_hidden_states=embeds,
                                       pooled_projections=pooled, return_dict=False)[0]
    s = run.samples_batched_list[0]
    return lambda: run.transformer(hidden_states=s["latents"][:, 0], encoder_hidden_states=s["encoder_hidden_states"],
                                   timestep=s["timesteps"][:, 0] / 1000, guidance=torch.tensor([3.5]),
                                   txt_ids=s["text_ids"], pooled_projections=s["pooled_prompt_embeds"],
                                   img_ids=s["image_ids"], return_dict=False)[0]


def memory(name: str, *, size: str = "10m", window: int = 4, forms=FORMS) -> dict:
    """Peak saved-activation bytes of one epoch per form, and against the unchanged loop's."""
    setup, unchanged, changed = _setups(name, size)
    peaks = {}
    with _quiet():
        for form in ("unchanged",) + tuple(forms):
            run = setup() if form == "unchanged" else setup(stepwise=dict(window=window, weights="t", backward=form))
            with track_saved_tensors() as stats:
                (unchanged if form == "unchanged" else changed)(run)
            peaks[form] = stats.peak_bytes
            if form != "unchanged":
                jaggc.stepwise(run.transformer).close()
    return dict(peak_bytes=peaks, ratio={f: peaks[f] / peaks["unchanged"] for f in forms})


def _collective_counts(rank: int, world: int, name: str, size: str, window: int) -> dict:
    from jaggc_studies.bench.sharded import count_collectives, wrap_dit

    setup, unchanged, changed = _setups(name, size)
    out = {}
    with _quiet():
        for form in ("unchanged", "joint", "lowmem"):
            stepwise = None if form == "unchanged" else dict(window=window, weights="t", backward=form)
            run = setup(wrap=lambda m: wrap_dit(m, "fsdp1", checkpointing=False), stepwise=stepwise,
                        shard=(rank, world))
            with count_collectives() as counts:
                (unchanged if form == "unchanged" else changed)(run)
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


def run_loops(names=loops.LOOPS, *, size: str = "10m", rounds: int = 5,
              progress: Callable[[str], None] = print) -> dict:
    results = {}
    for name in names:
        progress(f"{name} loop: lines changed, memory ...")
        row = dict(lines_changed=loops.lines_changed(name), diff=loops.user_diff(name))
        row["memory"] = memory(name, size=size)
        if rounds:
            progress(f"{name} loop: CPU time against the unchanged loop, {rounds} rounds ({size}) ...")
            row["speed"] = speed(name, size=size, rounds=rounds)
        if name != "flow_grpo":
            progress(f"{name} loop: FSDP1 reduce-scatters per trajectory ...")
            row["collectives"] = collectives(name)
        results[name] = row
    return results


def format_loops(results: dict) -> str:
    lines = ["the trainers' own loops with jaggc.stepwise (W=4, weights='t'; ratios: unchanged / stepwise):"]
    for name, r in results.items():
        parts = [f"{name}: {r['lines_changed']} lines changed"]
        if "speed" in r:
            s = r["speed"]
            parts.append("CPU time " + ", ".join(
                f"{f} {s['median'][f]:.2f}x [{s['min'][f]:.2f}-{s['max'][f]:.2f}]" for f in s["median"])
                + f" ({s['model']}, {s['trainable'] / 1e6:.2f}M trained of {s['params'] / 1e6:.1f}M, {s['rounds']} rounds;"
                f" cost model joint {s['cost_model']['joint']:.2f}x, per_window {s['cost_model']['per_window']:.2f}x)")
        m = r["memory"]
        parts.append("peak activations " + ", ".join(f"{f} {v:.2f}x" for f, v in m["ratio"].items()))
        if "collectives" in r:
            c = r["collectives"]["reduce_scatters_per_trajectory"]
            parts.append("FSDP1 reduce-scatters per trajectory " + ", ".join(f"{f} {v:g}" for f, v in c.items()))
        else:
            parts.append("collectives: one DDP sync per trajectory in both (accelerate's accumulate)")
        lines.append("  " + "; ".join(parts))
    return "\n".join(lines)


__all__ = ["collectives", "cost_model", "format_loops", "memory", "run_loops", "speed"]
