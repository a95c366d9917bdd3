"""What a step's plan and result cost crossing rpyc between the router and a model worker.

A step with drafts is synchronous: its plan's trip to the worker and its result's trip back are
part of the step's period (plain steps hide them behind the step in flight while the host keeps
up). This times that round trip alone: a worker process (forked, connected over a socket pair as
the router's local workers are, with the same rpyc settings) answers each plan, read with
`plan_from_wire`, with a prepared result; the router's side writes the plan with `plan_to_wire`
and reads the result with `result_from_wire`. Nothing else runs in either process.

    python test/benchmark/engine/wire_cost.py [--rounds 400] [--out-md wire.md]

Shapes (decodes x drafts each, prompt tokens in chunks): batch 1 with 8 drafts, 64 decodes, 64
with 4 drafts (3 tokens back each, the expected run at alpha 0.8), 256 decodes, and 64 decodes beside a
2,048-token chunk. To compare two trees, run this file with each tree's lightllm first on
PYTHONPATH. Both ends connect as the server's do (`workers.connect`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

import rpyc

from lightllm.engine.plan import (Chunk, SampledToken, StepPlan, StepResult, plan_from_wire, plan_to_wire,
                                  result_from_wire, result_to_wire)
from lightllm.engine.request import SamplingParams
from lightllm.engine.workers import connect

ACCEPTED = 0.8  # each draft accepted with this chance given the ones before (the run's expected length)
SHAPES = {  # name: (decodes, drafts each, prompt tokens in one chunk)
    "batch 1, 8 drafts": (1, 8, 0),
    "64 decodes": (64, 0, 0),
    "64 decodes, 4 drafts": (64, 4, 0),
    "256 decodes": (256, 0, 0),
    "64 decodes + 2,048-token chunk": (64, 0, 2048),
}


def step_of(decodes: int, drafts: int, prompt: int) -> tuple[StepPlan, StepResult]:
    """A plan of that shape and its result: each drafting request keeps the expected run (rounded)."""
    plan = StepPlan(7, decodes=list(range(decodes)), drafts={r: [1000 + r + j for j in range(drafts)]
                                                             for r in range(decodes)} if drafts else {})
    if prompt:
        plan.chunks.append(Chunk(decodes, [(7 * i) % 50000 for i in range(prompt)], 0, True, SamplingParams()))
    run = round(sum(ACCEPTED ** j for j in range(drafts + 1)))
    tokens = [SampledToken(r, 2000 + r + j, -0.25 - j / 7) for r in plan.sampled for j in range(run if r < decodes else 1)]
    return plan, StepResult(7, tokens)


class Worker(rpyc.Service):
    result_wire = None

    def exposed_step(self, plan: tuple) -> tuple:
        plan_from_wire(plan)
        return (Worker.result_wire,)


def serve(sock: socket.socket, result_wire: tuple) -> None:
    Worker.result_wire = result_wire
    connect(sock, Worker).serve_all()


def round_trip_ms(shape: tuple[int, int, int], rounds: int) -> tuple[float, int]:
    """Median ms of plan out, result back (both converted), and the result's token count."""
    plan, result = step_of(*shape)
    mine, theirs = socket.socketpair()
    worker = multiprocessing.get_context("fork").Process(target=serve, args=(theirs, result_to_wire(result)), daemon=True)
    worker.start()
    conn = connect(mine)
    step = conn.root.step
    times = []
    for i in range(rounds + rounds // 10):  # the first tenth warms up
        start = time.perf_counter()
        got = [result_from_wire(r) for r in step(plan_to_wire(plan))]
        if i >= rounds // 10:
            times.append(time.perf_counter() - start)
    assert got == [result]
    conn.close()
    worker.join(5)
    return statistics.median(times) * 1e3, len(result.tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--out-md", type=Path, default=None)
    args = parser.parse_args(argv)
    lines = [f"rpyc {rpyc.__version__}, Python {sys.version.split()[0]}; median of {args.rounds} round trips", "",
             "| step | tokens back | round trip, ms |", "| --- | ---: | ---: |"]
    for name, shape in SHAPES.items():
        ms, tokens = round_trip_ms(shape, args.rounds)
        lines.append(f"| {name} | {tokens} | {ms:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out_md is not None:
        args.out_md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
