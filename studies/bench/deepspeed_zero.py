"""A per-step GRPO loop on DeepSpeed ZeRO (2 ranks, CPU, gloo): unchanged against ``jaggc.stepwise``.

    torchrun --nproc-per-node 2 -m jaggc_studies.bench.deepspeed_zero --size 10m --steps 16 --window 4 --rounds 3

The loop is the shape DeepSpeed users write (Flow-Factory's default config is ZeRO-2): per step
``out = engine(...)``, ``engine.backward(loss)``, ``engine.step()``, ``gradient_accumulation_steps`` =
the trajectory's steps. Each round runs one trajectory of the unchanged loop and one with
``jaggc.stepwise(engine, window=W, weights="t")``, alternately, on two engines of the same weights;
the figure is the ratio of the process CPU time per trajectory (rank 0's, summed over rounds; rank 1's
printed beside it), with the collectives each loop makes. Cost model, per window of W steps (F a DiT
forward, a backward about 2F): unchanged W (F + 2F), stepwise W F + 2 (2F) (two knots in one joint
backward of twice the batch), ratio 3W / (W + 4) = 1.5 at W=4; the σ-free plain weights ("t") so that
every window is JAGG. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time
import warnings

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
               "all_gather_into_tensor", "broadcast")


@contextlib.contextmanager
def counting_collectives():
    counts = dict.fromkeys(COLLECTIVES, 0)
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="10m")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args(argv)

    import deepspeed

    import jaggc
    from jaggc import models

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    B, T = args.batch, args.steps
    base = models.sd3(args.size)
    cond = models.sd3_conditioning(base, B, seed=1).kwargs
    shape = models.sd3_latent_shape(base, B)
    g = torch.Generator().manual_seed(100 + rank)
    sigmas = torch.linspace(1.0, 0.1, T)

    def engine():
        config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": T,
                  "zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0,
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        dit = copy.deepcopy(base)
        return deepspeed.initialize(model=dit, optimizer=torch.optim.AdamW(dit.parameters(), lr=1e-5),
                                    config=config)[0]

    plain, jagg = engine(), engine()
    jaggc.stepwise(jagg, window=args.window, weights="t")
    cpu = {"unchanged": 0.0, "stepwise": 0.0}
    collectives = {"unchanged": 0, "stepwise": 0}
    for _ in range(args.rounds):
        ts = (1000 * sigmas).expand(B, T)
        zs = [torch.randn(shape, generator=g) for _ in range(T)]
        gs = [torch.randn(shape, generator=g) for _ in range(T)]
        for name, eng in (("unchanged", plain), ("stepwise", jagg)):
            steps = range(T) if name == "unchanged" else jaggc.stepwise(eng).steps(list(range(T)), ts)
            dist.barrier()
            start = time.process_time()
            with counting_collectives() as counts, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for j in steps:
                    out = eng(hidden_states=zs[j], timestep=ts[:, j], return_dict=False, **cond)[0]
                    eng.backward((out * gs[j]).sum() / B)
                    eng.step()
            cpu[name] += time.process_time() - start
            collectives[name] += sum(counts.values())
    times = torch.tensor([cpu["unchanged"], cpu["stepwise"]], dtype=torch.float64)
    gathered = [torch.zeros_like(times) for _ in range(world)]
    dist.all_gather(gathered, times)
    if rank == 0:
        counts = jaggc.stepwise(jagg).counts
        W = args.window
        print(f"Measured with `torchrun --nproc-per-node {world} -m jaggc_studies.bench.deepspeed_zero --size {args.size} "
              f"--steps {T} --window {W} --rounds {args.rounds} --stage {args.stage}` (process CPU time per trajectory, "
              f"{args.rounds} trajectories each, alternating)\n")
        print("| loop | CPU s / trajectory (rank 0, rank 1) | ratio | cost model | collectives / trajectory | DiT backward passes |")
        print("|---|---|---|---|---|---|")
        per = [t / args.rounds for t in gathered]
        print(f"| unchanged, ZeRO-{args.stage} | {per[0][0]:.2f}, {per[1][0]:.2f} | 1.00 | 1.00 | "
              f"{collectives['unchanged'] / args.rounds:.0f} | {T} |")
        print(f"| stepwise W={W} weights='t', ZeRO-{args.stage} | {per[0][1]:.2f}, {per[1][1]:.2f} | "
              f"{per[0][0] / per[0][1]:.2f}x, {per[1][0] / per[1][1]:.2f}x | {3 * W / (W + 4):.2f}x | "
              f"{collectives['stepwise'] / args.rounds:.0f} | {counts.backwards / counts.trajectories:.0f} |")
    jaggc.stepwise(jagg).close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 2 -m jaggc_studies.bench.deepspeed_zero")
    main()
