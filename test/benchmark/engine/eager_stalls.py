"""Do eager steps stall their own launch the first time they meet a shape? CUDA loads a kernel's
module at its first launch (lazy loading, CUDA_MODULE_LOADING=LAZY, torch's default), and a load
may wait for the device to finish what it runs: with one step in flight, the launch of an eager
step whose GEMMs pick a cuBLAS kernel not used before would then wait for the step ahead of it
(hundreds of ms in a burst's 8,192-token steps), and the device idles while the rest is launched.
Torch's sync debug mode does not see such a wait; the step trace sees a launch far longer than its
thread's CPU time.

    python test/benchmark/engine/eager_stalls.py --model DIR --load-format dummy --modes lazy,eager,lazy-ladder

Each mode runs in a process of its own (the variable is read when CUDA starts):
`lazy` and `eager` set CUDA_MODULE_LOADING; `lazy-ladder` is lazy with eager steps of a ladder of
shapes run before the measured passes (decodes 0, --ladder, 2 x --ladder, ...: does a coarse
warm-up load what the measured shapes need?). In each, --decodes requests of 256 cached tokens
are prefilled, then --passes passes of --steps eager steps run back to back with one in flight,
as the engine runs them: each --prompts new prompts of --chunk tokens in all (a burst's step)
beside the first d decodes, d drawn once (seed 0) from 1 .. --decodes, the same sequence in every
pass and mode. From the step trace (`--step_trace`, lightllm/engine/step_trace.py), per pass: the
median launch (wall and the thread's CPU), the launches whose wall time exceeds their CPU time by
--stall-ms or more (held up without running), the device's idle time between steps, and the
pass's wall time; with the time each process took to start (load the model, capture the graphs).
If lazy loading holds the launches, the first lazy pass stalls, its second pass does not, and
eager mode never does. What it found on a GPU is in docs/benchmarks.md (LoRA, "what holds them").

Runs on the CPU too (`--device cpu`, a tiny model when --model is left out: the plumbing).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import Bench, sync  # noqa: E402
from benchmark.lib.direct_step import run_step  # noqa: E402

logger = logging.getLogger("eager_stalls")

MODES = {"lazy": "LAZY", "eager": "EAGER", "lazy-ladder": "LAZY"}
CONTEXT = 256  # cached tokens of each decode request when the passes begin


def decode_counts(decodes: int, steps: int) -> list[int]:
    """The decodes beside each step's prompt chunk: one draw, the same in every pass and mode."""
    rng = random.Random(0)
    return [rng.randint(1, decodes) for _ in range(steps)]


def run_steps(runner, bench: Bench, ids: list[int], counts: list[int], chunk: int, prompts: int, step_ids) -> float:
    """Eager steps back to back with one in flight (each call launches the next and collects the
    one ahead), each `prompts` new prompts of `chunk` tokens in all beside the first d of `ids`;
    the prompts' requests are released once their step is collected. Returns the wall seconds
    from the first launch to the last step's end."""
    from lightllm.engine.plan import Chunk, StepPlan

    sync(runner.device)
    start, in_flight = time.perf_counter(), []
    for d in counts:
        new = bench.new_reqs(prompts, chunk // prompts)
        runner.step(StepPlan(next(step_ids), ids[:d], [Chunk(i, prompt, 0, True, params) for i, prompt, params in new]))
        runner.free(in_flight)
        in_flight = [i for i, _, _ in new]
    runner.step(StepPlan(next(step_ids)))  # empty: collects the last one
    runner.free(in_flight)
    sync(runner.device)
    return time.perf_counter() - start


def child(args) -> dict:
    """One mode in this process: start the runner, run the passes, summarise the trace."""
    from lightllm.engine.config import EngineConfig
    from lightllm.engine.model_runner import ModelRunner

    trace = Path(args.work) / f"steps-{args.mode}.jsonl"
    started = time.perf_counter()
    config = EngineConfig(model_dir=str(args.model), max_total_token_num=args.max_total_token_num,
                          max_req_total_len=args.chunk + 1024,
                          running_max_req_size=args.decodes + 2 * args.prompts + 8,
                          data_type=args.dtype, load_format=args.load_format, disable_cuda_graph=args.no_cuda_graph,
                          chunked_prefill_size=args.chunk, step_trace=str(trace))
    runner = ModelRunner(config, device=args.device, check_budget=False)
    sync(runner.device)
    start_s = time.perf_counter() - started
    bench = Bench(runner, seed=0)
    reqs = bench.new_reqs(args.decodes, CONTEXT)
    per_step = max(1, args.chunk // CONTEXT)
    for first in range(0, len(reqs), per_step):
        run_step(runner, prompts=reqs[first: first + per_step])
    ids = [r[0] for r in reqs]
    step_ids = iter(range(1 << 40, 1 << 41))
    if args.mode == "lazy-ladder":
        run_steps(runner, bench, ids, list(range(0, args.decodes + 1, args.ladder)), args.chunk, args.prompts,
                  step_ids)
    counts = decode_counts(args.decodes, args.steps)
    passes = []
    for _ in range(args.passes):
        first_id = next(step_ids)
        wall = run_steps(runner, bench, ids, counts, args.chunk, args.prompts, step_ids)
        passes.append((first_id, wall))
    runner._trace.flush(wait=True)
    return {"mode": args.mode, "start_s": start_s, "passes": summarise(trace, passes, args.stall_ms)}


def summarise(trace: Path, passes: list[tuple[int, float]], stall_ms: float) -> list[dict]:
    """Per pass (its first step id, its wall seconds): launch and idle figures from the trace."""
    records = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    out = []
    bounds = [first for first, _ in passes] + [1 << 62]
    for (first, wall), end in zip(passes, bounds[1:]):
        steps = [r for r in records if first < r.get("step", -1) < end and r.get("chunk_tokens")]
        held = [r["launch_ms"] - r["launch_cpu_ms"] for r in steps]
        idle = [b["start_ms"] - a["end_ms"] for a, b in zip(steps, steps[1:])]
        out.append({"steps": len(steps), "wall_s": wall,
                    "launch_ms": statistics.median(r["launch_ms"] for r in steps) if steps else 0.0,
                    "launch_cpu_ms": statistics.median(r["launch_cpu_ms"] for r in steps) if steps else 0.0,
                    "stalls": sum(h >= stall_ms for h in held), "held_ms": sum(h for h in held if h >= stall_ms),
                    "idle_ms": sum(max(0.0, i) for i in idle),
                    "device_ms": statistics.median(r["end_ms"] - r["start_ms"] for r in steps) if steps else 0.0})
    return out


def table(results: list[dict], args) -> list[str]:
    lines = [f"Eager steps of {args.chunk} prompt tokens in {args.prompts} prompts beside 1-{args.decodes} decodes "
             f"({CONTEXT}+ cached tokens "
             f"each), {args.steps} a pass, one in flight; a stall: a launch held {args.stall_ms:g}+ ms beyond "
             "its CPU time", "",
             "| mode | start s | pass | wall s | device ms (median) | launch ms (median) | launch CPU ms (median) "
             "| stalls | held ms | device idle ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for result in results:
        for i, p in enumerate(result["passes"], 1):
            lines.append(f"| {result['mode']} | {result['start_s']:.1f} | {i} | {p['wall_s']:.2f} | "
                         f"{p['device_ms']:.1f} | {p['launch_ms']:.1f} | {p['launch_cpu_ms']:.1f} | {p['stalls']} | "
                         f"{p['held_ms']:.0f} | {p['idle_ms']:.0f} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, default=None, help="a model directory (default: a tiny Llama written for the run)")
    add("--load-format", default="auto")
    add("--dtype", default="bfloat16")
    add("--device", default=None)
    add("--modes", default="lazy,eager,lazy-ladder", help=f"comma-separated, of {', '.join(MODES)}")
    add("--chunk", type=int, default=8192, help="each step's prompt tokens (the server's burst_chunked_prefill_size)")
    add("--prompts", type=int, default=32, help="the prompts they are cut into (a ShareGPT burst's hold ~250 tokens)")
    add("--decodes", type=int, default=600, help="the most decodes beside a chunk")
    add("--steps", type=int, default=30)
    add("--passes", type=int, default=2)
    add("--ladder", type=int, default=64, help="lazy-ladder's spacing of decodes in its warm-up steps")
    add("--stall-ms", type=float, default=20.0)
    add("--max-total-token-num", type=int, default=300000)
    add("--no-cuda-graph", action="store_true")
    add("--out-md", type=Path, default=None)
    add("--mode", choices=tuple(MODES), default=None, help=argparse.SUPPRESS)  # a child's
    add("--work", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.mode is not None:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory() as work:
        if args.model is None:
            from lightllm.tools.bench_model import write_bench_model

            args.model = write_bench_model(Path(work), "tiny")
            argv = [*argv, "--model", str(args.model), "--load-format", "dummy"]
        results = []
        for mode in args.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
            logger.info("mode %s", mode)
            env = os.environ | {"CUDA_MODULE_LOADING": MODES[mode]}
            done = subprocess.run([sys.executable, __file__, *argv, "--mode", mode, "--work", work], env=env,
                                  stdout=subprocess.PIPE, text=True, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            lines = table(results, args)  # written after each mode: a call cut short keeps those done
            if args.out_md:
                args.out_md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
