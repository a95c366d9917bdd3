"""The front end's ceiling: the real server (HTTP process, routers, detokenizer) with simulated
GPUs, so that what is measured is how many streamed tokens a second the processes around the
model deliver, on the CPU, with no GPU.

    python test/benchmark/serving/frontend_bench.py --model .gpu/bench-8b --num-prompts 1000 [--dp 2]
        [--client-procs 2] [--tree DIR] [--device-scale S] [--request-rate R]

Each router's model workers are `sim_device.SimDevice` (the H100 cost model of bench-8b,
`--device-scale` times faster: 0 for a device that takes no time): the router, its scheduler,
the detokenizer and the HTTP process are the real ones, started by the real api_server in a
process of their own. `--tree DIR` serves another checkout's code (PYTHONPATH=DIR; this
script's own helpers stay), to compare an old front end with this one. Printed: requests and
streamed tokens a second as the client saw them, and each server process's CPU seconds per
streamed token and share of a core. On a machine with few cores the processes compete for them:
compare trees on the same machine, not the absolute figures with a GPU host's.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

logger = logging.getLogger("frontend_bench")


# ---- the server role: api_server with simulated model workers ----


def serve(argv: list[str], device_scale: float) -> int:
    from lightllm.server import api_server
    from lightllm.server.router import manager as router

    os.environ["FRONTEND_BENCH_DEVICE_SCALE"] = str(device_scale)  # the routers (spawned) read it
    router.start_workers, router.load_model = _sim_workers, _sim_model  # a router spawned re-imports this module: below
    return api_server.main(argv)


def _sim_workers(config, replica: int = 0):
    from benchmark.simulator.sim_cost import H100CostModel
    from benchmark.simulator.sim_device import SimDevice

    class SimWorkers(SimDevice):
        sentinels: list[int] = []

        def shutdown(self) -> None:
            pass

        def dead_worker_message(self, timeout: float = 0.0) -> str:
            return ""

    scale = float(os.environ.get("FRONTEND_BENCH_DEVICE_SCALE", "1"))
    return SimWorkers(ScaledCost(H100CostModel(), scale), eos_token_ids=_eos_ids(config))


class ScaledCost:
    """The H100 cost model with every time times `scale` (0: a device and host launch that take no time)."""

    def __init__(self, cost, scale: float):
        self._cost, self._scale = cost, scale
        self.call_overhead_ms = cost.call_overhead_ms * scale

    def device_ms(self, work) -> float:
        return self._cost.device_ms(work) * self._scale

    def host_ms(self, work) -> float:
        return self._cost.host_ms(work) * self._scale


def _eos_ids(config) -> list[int]:
    from lightllm.models import read_config

    return list(read_config(config.model_dir).eos_token_ids)


def _sim_model(workers, config, replica: int = 0):
    from benchmark.simulator.sim_serving import sim_burst_budget

    from lightllm.models import read_config

    cfg = read_config(config.model_dir)
    info = {"architecture": cfg.architecture, "dtype": "bfloat16", "vocab_size": cfg.vocab_size,
            "eos_token_ids": list(cfg.eos_token_ids), "max_position_embeddings": cfg.max_position_embeddings,
            "model_dir": str(config.model_dir), "burst_chunked_prefill_size": sim_burst_budget(config),
            "sampling_defaults": list(cfg.sampling_defaults.items())}
    from benchmark.simulator.sim_serving import H100_MAX_TOTAL_TOKEN_NUM

    return config.max_total_token_num or H100_MAX_TOTAL_TOKEN_NUM, info

if __name__ == "__mp_main__":  # a spawned router: the same simulated workers
    from lightllm.server.router import manager as _router

    _router.start_workers, _router.load_model = _sim_workers, _sim_model


# ---- the bench role ----


def server_pids(log: str) -> dict[int, str]:
    """The child processes' pids by role, from their ready lines in the server's log."""
    pids = {}
    for name, pid in re.findall(r"\[(router(?: \d+)?|detokenizer)\] \S+: \w+ ready \(pid (\d+)\)", log):
        pids[int(pid)] = name
    return pids


def bench(args) -> dict:
    import asyncio

    import psutil

    from benchmark.lib.server_process import ServerProcess
    from benchmark.lib.serving_client import run_requests_in_processes, warm_up
    import numpy as np

    from benchmark.lib.serving_metrics import latency_values, summarize
    from benchmark.lib.sharegpt import read_requests

    sample = read_requests(args.requests)[: args.num_prompts]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (args.tree, os.environ.get("PYTHONPATH")) if p))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    entry = [str(Path(__file__).resolve()), "--serve", "--device-scale", str(args.device_scale), "--"]
    server = ServerProcess(["--model_dir", str(args.model), "--host", "127.0.0.1", "--dp", str(args.dp),
                            *args.server_args.split()], args.out_dir / "server.log", own_session=True, entry=entry,
                           env=env)
    try:
        server.wait_healthy(120)
        asyncio.run(warm_up(server.url, sample[:16]))
        roles = {server.proc.pid: "http", **server_pids(server.log_text())}
        procs = {pid: psutil.Process(pid) for pid in roles}
        before = {pid: sum(p.cpu_times()[:2]) for pid, p in procs.items()}
        results, duration, client_cpu = run_requests_in_processes(server.url, sample, True, args.client_procs,
                                                                  request_rate=args.request_rate)
        cpu = {roles[pid]: sum(p.cpu_times()[:2]) - before[pid] for pid, p in procs.items()}
    finally:
        server.stop(timeout=60)
    summary = summarize(results, duration)
    tokens = summary["total_output_tokens"]
    ttft_s = latency_values([r for r in results if r.success])["ttft"]
    cpu["client"] = client_cpu
    return {"tree": args.tree or "this checkout", "dp": args.dp, "requests": len(sample), "failed": summary["failed"],
            "req_s": summary["request_throughput"], "tok_s": summary["output_throughput"],
            "duration_s": duration, "median_tpot_ms": summary["median_tpot_ms"],
            # The first and the tenth percentile's first token: how long a burst takes to reach the routers.
            "ttft_ms": {"first": 1e3 * min(ttft_s, default=math.nan),
                        "P10": 1e3 * float(np.percentile(ttft_s, 10)) if ttft_s else math.nan,
                        "P50": summary["median_ttft_ms"] or math.nan, "P99": summary["p99_ttft_ms"] or math.nan},
            "cpu_us_per_token": {k: v / max(tokens, 1) * 1e6 for k, v in cpu.items()},
            "core_share": {k: v / duration for k, v in cpu.items()}}


def format_row(r: dict) -> str:
    cpu = ", ".join(f"{k} {r['cpu_us_per_token'][k]:.0f} us ({r['core_share'][k] * 100:.0f}%)"
                    for k in sorted(r["cpu_us_per_token"]))
    return (f"| {r['tree']} | {r['dp']} | {r['requests']} | {r['failed']} | {r['req_s']:.2f} | {r['tok_s']:.0f} | "
            f"{' / '.join(f'{v:.0f}' for v in r['ttft_ms'].values())} | {r['median_tpot_ms']:.1f} | {cpu} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, required=True, help="model directory: config and tokenizer (no weights are read)")
    add("--requests", type=Path, default=Path(".gpu/requests-2000.json"), help="saved ShareGPT requests")
    add("--num-prompts", type=int, default=1000)
    add("--dp", type=int, default=1, help="routers (simulated GPUs) behind the one HTTP process and detokenizer")
    add("--client-procs", type=int, default=2)
    add("--request-rate", type=float, default=math.inf, help="Poisson arrivals a second (default: all at once)")
    add("--device-scale", type=float, default=1.0, help="times the H100 cost model's step time (0: none)")
    add("--tree", default="", help="serve this checkout's lightllm (PYTHONPATH) instead of the installed one")
    add("--server-args", default="", help="more server flags, one string (--server-args='--flag value')")
    add("--out-dir", type=Path, default=Path("/tmp/frontend_bench"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        scale = float(argv[argv.index("--device-scale") + 1])
        return serve(argv[argv.index("--") + 1:], scale)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    row = bench(args)
    print("| tree | dp | requests | failed | req/s | streamed tok/s | TTFT first / P10 / P50 / P99 ms | median TPOT ms | CPU a token (share of a core) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print(format_row(row))
    return 0 if row["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
