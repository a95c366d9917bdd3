"""What the host's draft sources cost a step: `propose`, `extend` and `finish` of ngram and suffix,
in one process, on token streams that repeat the way served outputs do.

    python test/benchmark/engine/draft_source_cost.py                       # this tree
    python test/benchmark/engine/draft_source_cost.py --tree /tmp/old       # another checkout's lightllm/

A step with drafts is synchronous, so every microsecond of a proposal at 64 requests in flight is
64 of the step's period (docs/benchmarks.md, "Speculative decoding"). Each workload starts
--requests requests (a random prompt, then an output that loops over a short cycle) beside a pool
of --pool finished ones; `shared` draws every loop from four cycles that the pool's outputs also
repeat (dummy weights' outputs, a copy-heavy agent), `own` gives each request a cycle of its own.
Then --steps steps: each request's proposal of --k tokens, then two tokens (the proposal's first
two, as if accepted) appended; then every request finishes. Times are the best of --rounds, in
microseconds a call (extend: a call of two tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path

WORKLOADS = ("shared", "own")


def load_drafts(tree: Path | None):
    """lightllm.engine.spec.drafts of this tree, or of `tree` (a directory holding lightllm/)."""
    if tree is None:
        from lightllm.engine.spec import drafts

        return drafts
    spec = importlib.util.spec_from_file_location("other_drafts", tree / "lightllm/engine/spec/drafts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_drafts"] = module
    spec.loader.exec_module(module)
    return module


def start(source, workload: str, requests: int, pool: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    cycles = [[rng.randrange(32000) for _ in range(n)] for n in (3, 7, 11, 20)]
    def tokens(n: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(n)]

    for i in range(pool):
        source.start(10**6 + i, tokens(100) + (rng.choice(cycles) * 30)[:rng.randrange(50, 200)])
        source.finish(10**6 + i)
    for i in range(requests):
        cycle = rng.choice(cycles) if workload == "shared" else tokens(rng.choice((3, 7, 20)))
        source.start(i, tokens(200) + (cycle * 30)[:rng.randrange(50, 150)])


def measure(drafts, method: str, workload: str, args) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        source = drafts.SuffixDraft() if method == "suffix" else drafts.NgramDraft()
        start(source, workload, args.requests, args.pool)
        times = {"propose": 0.0, "extend": 0.0, "finish": 0.0}
        for _ in range(args.steps):
            began = time.perf_counter()
            proposals = [source.propose(i, args.k) for i in range(args.requests)]
            middle = time.perf_counter()
            for i, drafted in enumerate(proposals):
                source.extend(i, drafted[:2] or [5])
            times["propose"] += middle - began
            times["extend"] += time.perf_counter() - middle
        began = time.perf_counter()
        for i in range(args.requests):
            source.finish(i)
        times["finish"] = (time.perf_counter() - began) * args.steps
        for name, seconds in times.items():
            best[name] = min(best.get(name, float("inf")), seconds / (args.steps * args.requests) * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=None, help="time the drafts.py under this directory's lightllm/")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--pool", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    drafts = load_drafts(args.tree)
    print(f"| method | workload | propose us | extend us | finish us |  ({args.tree or 'this tree'}, "
          f"{args.requests} requests, pool {args.pool}, k {args.k})")
    print("| --- | --- | ---: | ---: | ---: |")
    for method in args.methods.split(","):
        for workload in WORKLOADS:
            t = measure(drafts, method, workload, args)
            print(f"| {method} | {workload} | {t['propose']:.1f} | {t['extend']:.1f} | {t['finish']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
