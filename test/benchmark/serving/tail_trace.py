"""Which requests wait long for their first token, and what the server's steps did meanwhile.

    python test/benchmark/serving/tail_trace.py --model bench-8b --requests requests-1000.json \\
        --server-args "--load_format dummy --data_type bfloat16" --rate 20 --warmup 0 --out-dir tail-cold

One server with --step_trace, warmed up or not (--warmup N: the first N requests at 16 tokens each,
greedy, together, as compare.py warms a server), then the requests as vLLM's `bench serve` sends
them by default (--arrival vllm --api completions: its arrival times for --seed, its body, so the
server's default temperature, and its TTFT), then the server stopped and its trace read. Printed
(markdown, also OUT/tail.md; figures in OUT/tail.json):
  - TTFT p50/p90/p99 and the requests over --slow-ms: index, sent (s after the first), TTFT, prompt
  - the steps that ran while those requests waited, longest first: kind (benchmark/engine/step_trace.py's),
    CUDA graph or eager, device time against the median of its kind, idle before it, the host's
    launch time, and the Triton kernels it met first (compiled, or loaded from Triton's cache)
  - the steps anywhere in the run far over their kind's median (--over times it)
Times are seconds after the first request was sent, on the client's wall clock; the trace's
clock is placed on it by the trace's origin_unix_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.engine.step_trace import kind  # noqa: E402
from benchmark.lib.server_process import start_server  # noqa: E402
from benchmark.lib.serving_client import ARRIVALS, run_requests, warm_up  # noqa: E402
from benchmark.lib.serving_metrics import RequestResult, summarize  # noqa: E402
from benchmark.lib.sharegpt import read_requests  # noqa: E402

logger = logging.getLogger("tail_trace")
WARMUP_TOKENS = 16  # compare.py's


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, required=True, help="model directory")
    add("--requests", type=Path, required=True, help="requests saved by benchmark_serving.py --save-requests")
    add("--num-prompts", type=int, default=1000, help="the first this many requests are sent")
    add("--server-args", default="", help="the server's flags, one string (--step_trace is added)")
    add("--rate", type=float, default=20.0, help="requests per second")
    add("--seed", type=int, default=0, help="seed of the arrival times")
    add("--arrival", choices=ARRIVALS, default="vllm", help="arrival process (serving_client.arrival_offsets)")
    add("--api", choices=("generate", "completions"), default="completions", help="body and TTFT (serving_client)")
    add("--temperature", type=float, default=None, help="--api completions: the temperature sent (default: none)")
    add("--warmup", type=int, default=0, help="warm-up requests before the measured run (0: none, as vLLM's client)")
    add("--slow-ms", type=float, default=150.0, help="a request is slow past this TTFT")
    add("--over", type=float, default=3.0, help="a step is far over when its device time is this many medians")
    add("--top", type=int, default=15, help="rows of each step table")
    add("--label", default="", help="name of this run in the report")
    add("--out-dir", type=Path, default=Path("tail_out"))
    add("--server-tree", type=Path, default=None, help="run the server of this checkout (an older commit's), "
        "first on its PYTHONPATH; a trace without origin_unix_s (before d216d9d) is not placed among the requests")
    add("--start-timeout", type=float, default=240.0, help="seconds for the server to answer /health")
    add("--timeout", type=float, default=300.0, help="seconds the measured run may take")
    return parser


def measure(args) -> tuple[list[RequestResult], Path]:
    """The results of one run against a fresh server, and its step trace."""
    trace = (args.out_dir / "steps.jsonl").resolve()  # absolute: an older tree's server runs in that tree
    trace.unlink(missing_ok=True)
    requests = read_requests(args.requests)[: args.num_prompts]
    server_args = ["--model_dir", str(args.model.resolve()), "--host", "127.0.0.1", *shlex.split(args.server_args),
                   "--step_trace", str(trace)]
    tree = {}
    if args.server_tree:
        path = os.pathsep.join([str(args.server_tree.resolve()), os.environ.get("PYTHONPATH", "")])
        tree = {"env": {**os.environ, "PYTHONPATH": path}, "cwd": str(args.server_tree)}
    server = start_server(server_args, args.out_dir / "server.log", args.start_timeout, own_session=True, **tree)
    try:
        if args.warmup:
            asyncio.run(warm_up(server.url, requests[: args.warmup], WARMUP_TOKENS))
        results, _ = asyncio.run(run_requests(
            server.url, requests, stream=True, request_rate=args.rate, seed=args.seed, timeout_s=args.timeout,
            progress=False, arrival=args.arrival, api=args.api, temperature=args.temperature))
    finally:
        server.stop(timeout=60)  # the worker writes the trace's last lines as it exits
    return results, trace


def load_steps(path: Path, origin_s: float) -> list[dict]:
    """The trace's steps in start order, with `start`, `end` (s after `origin_s` on the wall clock;
    `placed` False: on the trace's own clock, which has no origin), `device_ms`, `idle_ms` (since the
    previous step's end) and `kind`."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return []
    origins = [line["origin_unix_s"] for line in lines if "origin_unix_s" in line]
    if not origins:  # an older server's trace: its own clock, and no request can be placed on it
        logger.warning("%s has no origin_unix_s: step times are the trace's own", path)
    zero = origins[0] - origin_s if origins else 0.0
    steps = sorted(lines, key=lambda s: s["start_ms"])
    previous_end = None
    for s in steps:
        s["start"], s["end"], s["placed"] = zero + s["start_ms"] / 1000, zero + s["end_ms"] / 1000, bool(origins)
        s["device_ms"] = s["end_ms"] - s["start_ms"]
        s["idle_ms"] = 0.0 if previous_end is None else max(0.0, s["start_ms"] - previous_end)
        s["kind"] = kind(s)
        previous_end = s["end_ms"]
    return steps


def slow_requests(rows: dict[str, list], slow_ms: float) -> list[dict]:
    """summarize's per_request rows whose TTFT is over `slow_ms`, in the order they were sent."""
    slow = [{"index": i, "sent": sent, "ttft_ms": 1000 * ttft, "prompt_len": prompt}
            for i, (sent, ttft, prompt) in enumerate(zip(rows["sent_s"], rows["ttft_s"], rows["prompt_len"]))
            if ttft is not None and 1000 * ttft > slow_ms]
    return sorted(slow, key=lambda r: r["sent"])


def kind_medians(steps: list[dict]) -> dict[str, float]:
    by_kind: dict[str, list[float]] = {}
    for s in steps:
        by_kind.setdefault(s["kind"], []).append(s["device_ms"])
    return {name: statistics.median(times) for name, times in by_kind.items()}


def steps_while_waiting(steps: list[dict], slow: list[dict]) -> list[dict]:
    """Steps whose device time overlaps some slow request's wait (its send to its first token),
    longest first; each names the slow requests it held up."""
    held = []
    for s in (s for s in steps if s["placed"]):
        waiting = [r["index"] for r in slow if s["start"] < r["sent"] + r["ttft_ms"] / 1000 and s["end"] > r["sent"]]
        if waiting:
            held.append({**s, "waiting": waiting})
    return sorted(held, key=lambda s: -s["device_ms"])


def far_over(steps: list[dict], medians: dict[str, float], factor: float) -> list[dict]:
    """Steps whose device time is over `factor` times their kind's median, longest first."""
    return sorted((s for s in steps if s["device_ms"] > factor * medians[s["kind"]]), key=lambda s: -s["device_ms"])


def step_rows(steps: list[dict], medians: dict[str, float], top: int) -> list[str]:
    lines = ["| start s | kind | decodes | chunk tokens | device ms | kind median ms | idle before ms | launch ms "
             "| new kernels | waiting |", "|" + " ---: |" * 2 + " ---: |" * 8]
    for s in steps[:top]:
        names = ",".join(s.get("new_kernel_names", [])) or "-"
        waiting = ",".join(map(str, s.get("waiting", [])[:8])) or "-"
        lines.append(f"| {s['start']:.3f} | {s['kind']} | {s['decodes']} | {s['chunk_tokens']} | {s['device_ms']:.1f} "
                     f"| {medians[s['kind']]:.1f} | {s['idle_ms']:.1f} | {s['launch_ms']:.1f} | "
                     f"{s.get('new_kernels', 0)} ({s.get('new_kernel_ms', 0):.0f} ms) {names} | {waiting} |")
    return lines


def report(label: str, summary: dict, slow: list[dict], held: list[dict], over: list[dict],
           medians: dict[str, float], args) -> str:
    lines = [f"## {label}: {summary['completed']} requests ({summary['failed']} failed) at {args.rate:g} req/s, "
             f"arrival {args.arrival}, api {args.api}, warm-up {args.warmup}", "",
             f"TTFT p50 / p90 / p99: {summary['median_ttft_ms']:.1f} / {summary['p90_ttft_ms']:.1f} / "
             f"{summary['p99_ttft_ms']:.1f} ms; TPOT p50 / p99: {summary['median_tpot_ms']:.2f} / "
             f"{summary['p99_tpot_ms']:.2f} ms", "",
             f"### {len(slow)} requests over {args.slow_ms:g} ms", "",
             "| index | sent s | TTFT ms | prompt |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['index']} | {r['sent']:.3f} | {r['ttft_ms']:.1f} | {r['prompt_len']} |" for r in slow]
    lines += ["", f"### steps while they waited ({len(held)}), longest first", "", *step_rows(held, medians, args.top)]
    lines += ["", f"### steps over {args.over:g}x their kind's median ({len(over)}), longest first", "",
              *step_rows(over, medians, args.top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results, trace = measure(args)
    summary = summarize(results, 1.0)
    origin = min(r.sent_at for r in results if r.sent_at)
    steps = load_steps(trace, origin)
    medians = kind_medians(steps)
    slow = slow_requests(summary["per_request"], args.slow_ms)
    held, over = steps_while_waiting(steps, slow), far_over(steps, medians, args.over)
    text = report(args.label or str(args.out_dir), summary, slow, held, over, medians, args)
    print(text, flush=True)
    (args.out_dir / "tail.md").write_text(text + "\n")
    figures = {key: summary[key] for key in ("completed", "failed", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                                             "median_tpot_ms", "p99_tpot_ms", "errors")}
    strip = lambda s: {k: v for k, v in s.items() if k not in ("start_ms", "end_ms")}  # noqa: E731
    (args.out_dir / "tail.json").write_text(json.dumps(
        {"figures": figures, "slow": slow, "held": [strip(s) for s in held[: args.top]],
         "over": [strip(s) for s in over[: args.top]], "per_request": summary["per_request"]}, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
