"""Flow-Factory's loop on its default engine (accelerate's DeepSpeed ZeRO-2 plugin, 2 ranks, CPU, gloo),
unchanged against jaggc's two lines, timed side by side.

    torchrun --nproc-per-node 2 -m jaggc_studies.loops.frameworks_speed_zero2 --size 10m --rounds 3

W=4 ``weights="t"``, 8 trained steps per trajectory in the loop's random order (two JAGG windows,
the deferred schedule inside the last step's ``engine.backward``), a LoRA with the KL reference
(``disable_adapter``) and CFG, two batches of 2 samples per rank and one engine step per epoch,
``--precision bf16`` (DeepSpeed's bf16 mode, bf16 latents: Flow-Factory's default) or ``no``
(float32). One thread per rank. Each round runs one epoch of each loop on its own engine, in a
rotated order; the figure is the ratio of the process CPU time per epoch, unchanged / jaggc,
median [range] over rounds, per rank. Cost model as in ``frameworks_speed`` (one process):
W (F + B + N) against 2 F + (W - 2) N + 2 B + W N per window; on ZeRO-2 every ``engine.backward``
also copies each gradient into ZeRO's bucket and all-reduces it, which the joint backward does once
per trajectory instead of once per step. Prints one markdown row per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

import torch
import torch.distributed as dist

import jaggc
from jaggc_studies.loops import flow_factory as ff
from jaggc_studies.loops.frameworks_speed import STEPS, W, _cpu


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="10m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=("bf16", "no"))
    args = p.parse_args(argv)
    import deepspeed

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def build(stepwise):
        run = ff.setup(size=args.size, engine="deepspeed", shard=(rank, world), num_sde_steps=STEPS,
                       sde_steps=tuple(range(1, 9)), latent_dtype=dtype, mixed_precision=args.precision,
                       stepwise=stepwise)
        loop = ff.train_unchanged if stepwise is None else ff.train_jaggc
        return lambda: loop(run), run

    (unchanged, _), (jagg, run) = build(None), build(dict(window=W, weights="t"))
    loops = {"unchanged": unchanged, "jaggc": jagg}
    for fn in loops.values():          # warm up
        fn()
    times = {"unchanged": [], "jaggc": []}
    for r in range(args.rounds):
        for label in (("unchanged", "jaggc") if r % 2 == 0 else ("jaggc", "unchanged")):
            dist.barrier()
            times[label].append(_cpu(loops[label]))
    ratios = torch.tensor([u / j for u, j in zip(times["unchanged"], times["jaggc"])], dtype=torch.float64)
    per_epoch = torch.tensor([statistics.median(times["unchanged"]), statistics.median(times["jaggc"])],
                             dtype=torch.float64)
    gathered = [torch.zeros_like(ratios) for _ in range(world)]
    epochs = [torch.zeros_like(per_epoch) for _ in range(world)]
    dist.all_gather(gathered, ratios)
    dist.all_gather(epochs, per_epoch)
    counts = jaggc.stepwise(run.transformer).counts
    if rank == 0:
        print(f"jaggc per epoch: {counts.jagg_windows / (args.rounds + 1):.0f} JAGG windows, "
              f"{counts.backwards / (args.rounds + 1):.0f} joint backwards, {counts.fallbacks} fallbacks")
        print(f"Measured with `torchrun --nproc-per-node {world} -m jaggc_studies.loops.frameworks_speed_zero2 "
              f"--size {args.size} --rounds {args.rounds} --precision {args.precision}` (W={W}, {STEPS} trained steps, "
              f"process CPU time per epoch, ratios unchanged / jaggc, median [range])\n")
        print("| rank | unchanged CPU s / epoch | jaggc CPU s / epoch | ratio |")
        print("|---|---|---|---|")
        for i, (rs, ep) in enumerate(zip(gathered, epochs)):
            rs = rs.tolist()
            print(f"| {i} | {ep[0]:.2f} | {ep[1]:.2f} | {statistics.median(rs):.2f}x [{min(rs):.2f}-{max(rs):.2f}] |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 2 -m jaggc_studies.loops.frameworks_speed_zero2")
    main()
