"""What a fresh parameter-sized flat vector costs beside a copy into a held one (runtime/flat_buffers.py).

``python -m jaggc_studies.bench.flat_vectors --params 9164304 --tensors 140 --rounds 9``: the
gradients of a model of that many parameters in that many tensors (the 10m Flux's by default), made
one flat float32 vector, in interleaved rounds: ``torch.cat`` into a new vector (what the guard's
probes did), and into a held one (what they do now). Process CPU time, one thread; the ratio of
the two per round, median [range].
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def measure(params: int, tensors: int, rounds: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(params, tensors, rounds)
    finally:
        torch.set_num_threads(threads)


def _measure(params: int, tensors: int, rounds: int) -> dict:
    size = params // tensors
    grads = [torch.randn(size) for _ in range(tensors)]
    held = torch.cat(grads)          # touched once: its pages are in, as a held vector's are
    ratios, fresh_s, held_s = [], [], []
    for _ in range(rounds):
        t = time.process_time()
        torch.cat(grads)
        fresh = time.process_time() - t
        t = time.process_time()
        torch.cat(grads, out=held)
        into = time.process_time() - t
        fresh_s.append(fresh)
        held_s.append(into)
        ratios.append(fresh / max(into, 1e-9))
    return dict(params=size * tensors, tensors=tensors, rounds=rounds,
                fresh_over_held=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios)),
                fresh_ms=1e3 * statistics.median(fresh_s), held_ms=1e3 * statistics.median(held_s))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=9_164_304)
    p.add_argument("--tensors", type=int, default=140)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.params, args.tensors, args.rounds)))


if __name__ == "__main__":
    main()
