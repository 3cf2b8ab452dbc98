"""Two versions of jaggc timed side by side on the trainers' loops: is a change slower on the CPU?

``python -m jaggc_studies.loops.commits_ab --base REV [--head REV] --loops flow_grpo,dance_grpo,mix_grpo``

Each version runs in its own process (a source tree on ``PYTHONPATH``: ``git archive`` of the
revision, or this working tree for the head), built by that version's own ``jaggc_studies.loops.speed``
(the loops, their variants: the unchanged loop, ``jaggc.stepwise`` joint, with the CFG slice, with
the rollout cache on-policy). Both processes set their loops up and warm them, then the parent asks
them in turn for one epoch of one variant, in a rotated order per round, base and head alternating:
the two versions meet the same machine load, one core busy at a time. Each epoch is timed in its own
process (process CPU time, one thread).

Reported per loop and variant: head / base seconds (median and range over the rounds; < 1: the
head is faster), and each version's unchanged / variant speed-up. The unchanged loop runs no jaggc
code, so its head / base spread is the noise a change must be judged against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("JAGGC_STUDIES_CACHE", Path.home() / ".cache" / "jaggc_studies")) / "commits_ab"


# --- the child: one version's loops, one epoch per request -----------------------------------------
def child(loop_names: list[str], size: str) -> None:
    from jaggc_studies.loops import speed
    from jaggc_studies.trainers.sizes import Where

    # the protocol's lines alone on stdout: whatever the loops print goes to stderr
    reply, sys.stdout = sys.stdout, sys.stderr
    where = Where(size)
    now = speed.clock(where)
    loops, runs, tables = {}, {}, {}
    with speed.run_on(where):
        for name in loop_names:
            loop = loops[name] = speed.loop_setup(name, where)
            table = tables[name] = {label: v for label, v in speed.variants(loop, ("joint",)).items()
                                    if not label.endswith("/probe")}
            runs[name] = {label: loop.setup(stepwise=kw) if kw is not None else loop.setup()
                          for label, (kw, _) in table.items()}
            for warm in range(2):    # the first trajectories' one-off costs; the slice learned
                for label, (kw, on_policy) in table.items():
                    speed.epoch(loop, runs[name][label], on_policy, seed=100 + warm, changed=kw is not None, now=now)
        print(json.dumps({"labels": {n: list(t) for n, t in tables.items()}}), file=reply, flush=True)
        for line in sys.stdin:
            ask = json.loads(line)
            name, label = ask["loop"], ask["label"]
            kw, on_policy = tables[name][label]
            _, train = speed.epoch(loops[name], runs[name][label], on_policy, seed=ask["seed"],
                                   changed=kw is not None, now=now)
            print(json.dumps({"train_s": train}), file=reply, flush=True)


# --- the parent --------------------------------------------------------------------------------------
def source_tree(rev: str | None) -> Path:
    """The revision's source tree (``git archive``, cached by commit), or this working tree."""
    if rev is None:
        return ROOT
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = CACHE / sha
    if not (tree / "jaggc" / "__init__.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as tar:
            subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, stdout=tar)
            tar.seek(0)
            tarfile.open(fileobj=tar).extractall(tree, filter="data")
    return tree


def importable(tree: Path) -> Path:
    """A directory for PYTHONPATH in which the tree's packages (and ``jaggc_studies``: its ``studies/``)
    are found before the installed ones."""
    shim = Path(tempfile.mkdtemp(prefix="jaggc-ab-"))
    for name, target in (("jaggc", "jaggc"), ("passes", "passes"), ("verify", "verify"), ("jaggc_studies", "studies")):
        if (tree / target).exists():
            (shim / name).symlink_to(tree / target)
    return shim


class Version:
    def __init__(self, label: str, tree: Path, loops: list[str], size: str):
        env = dict(os.environ, PYTHONPATH=str(importable(tree)), OMP_NUM_THREADS="1")
        self.label = label
        # -P: the script's directory is not put on sys.path, so every import is the tree's
        self.proc = subprocess.Popen([sys.executable, "-P", __file__, "--child", "--loops", ",".join(loops),
                                      "--size", size], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.labels = json.loads(self.proc.stdout.readline())["labels"]

    def epoch(self, loop: str, label: str, seed: int) -> float:
        self.proc.stdin.write(json.dumps({"loop": loop, "label": label, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["train_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def compare(base: str, head: str | None, loops: list[str], size: str, rounds: int) -> dict:
    versions = [Version("base", source_tree(base), loops, size), Version("head", source_tree(head), loops, size)]
    times = {v.label: {n: {} for n in loops} for v in versions}
    try:
        for name in loops:
            labels = versions[0].labels[name]
            assert labels == versions[1].labels[name], "the two versions' loops have different variants"
            for r in range(rounds):
                for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                    for v in versions if r % 2 == 0 else versions[::-1]:
                        times[v.label][name].setdefault(label, []).append(v.epoch(name, label, seed=r))
    finally:
        for v in versions:
            v.close()
    out = {}
    for name in loops:
        base_t, head_t = times["base"][name], times["head"][name]
        rows = {}
        for label in base_t:
            ratio = [h / b for h, b in zip(head_t[label], base_t[label])]
            row = dict(head_over_base=statistics.median(ratio), range=[min(ratio), max(ratio)])
            if not label.startswith("unchanged"):
                ref = "unchanged/on-policy" if label.endswith("/cache") else "unchanged"
                for v, t in (("base", base_t), ("head", head_t)):
                    row[f"speedup_{v}"] = statistics.median(u / x for u, x in zip(t[ref], t[label]))
            rows[label] = row
        out[name] = rows
    return dict(base=base, head=head or "working tree", size=size, rounds=rounds, loops=out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the revision to compare against (git rev)")
    p.add_argument("--head", default=None, help="the revision to compare (default: this working tree)")
    p.add_argument("--loops", default="flow_grpo,dance_grpo,mix_grpo")
    p.add_argument("--size", default="10m")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    loops = [n for n in args.loops.split(",") if n]
    if args.child:
        child(loops, args.size)
        return
    if args.base is None:
        p.error("--base is required")
    result = compare(args.base, args.head, loops, args.size, args.rounds)
    print(f"head ({result['head']}) / base ({args.base}) seconds per epoch, median [range] over {args.rounds} rounds:")
    for name, rows in result["loops"].items():
        for label, row in rows.items():
            extra = (f"   speed-up base {row['speedup_base']:.2f}x, head {row['speedup_head']:.2f}x"
                     if "speedup_base" in row else "")
            print(f"  {name:11s} {label:22s} {row['head_over_base']:.3f} [{row['range'][0]:.3f}-{row['range'][1]:.3f}]{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
