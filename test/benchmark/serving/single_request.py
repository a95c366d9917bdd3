"""One request at a time against a running server: latency of an idle server.

    python test/benchmark/serving/single_request.py --url http://127.0.0.1:8000 --max-new-tokens 128

Sends `--repeat` streamed /generate_stream requests one after another (greedy, EOS ignored)
and reports, per request, time to first token, the mean time per later token and the whole
latency, measured at the client; then checks that /generate and /v1/chat/completions answer
with the asked number of tokens. Exit status 1 when any answer is wrong.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import requests

logger = logging.getLogger("single_request")


def timed_stream(url: str, prompt: str, max_new_tokens: int, adapter: str | None = None) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if adapter is not None:
        body["parameters"]["adapter_id"] = adapter
    start = time.perf_counter()
    stamps, last = [], None
    with requests.post(f"{url}/generate_stream", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line:
                stamps.append(time.perf_counter() - start)
                last = json.loads(line[len(b"data:"):])
    if len(stamps) != max_new_tokens or not last["finished"]:
        raise RuntimeError(f"asked for {max_new_tokens} tokens, got {len(stamps)} events")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"ttft_ms": stamps[0] * 1e3, "tpot_ms": tpot * 1e3, "e2e_ms": stamps[-1] * 1e3}


def check_other_routes(url: str, prompt: str, max_new_tokens: int) -> None:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    answer = requests.post(f"{url}/generate", json=body, timeout=600).json()
    if answer.get("count_output_tokens") != max_new_tokens:
        raise RuntimeError(f"/generate answered {answer}")
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens, "ignore_eos": True}
    reply = requests.post(f"{url}/v1/chat/completions", json=chat, timeout=600).json()
    if reply.get("usage", {}).get("completion_tokens") != max_new_tokens:
        raise RuntimeError(f"/v1/chat/completions answered {reply}")
    logger.info("/generate and /v1/chat/completions answered with %d tokens each", max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompt", default="Explain what a large language model is, in simple words.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5, help="timed requests; the first is also reported")
    parser.add_argument("--adapter", default=None, help="the LoRA adapter the timed requests name (default: none)")
    args = parser.parse_args(argv)
    try:
        runs = [timed_stream(args.url, args.prompt, args.max_new_tokens, args.adapter) for _ in range(args.repeat)]
        check_other_routes(args.url, args.prompt, args.max_new_tokens)
    except (requests.RequestException, RuntimeError) as exc:
        logger.error("%s", exc)
        return 1
    print(f"\n| request | TTFT ms | TPOT ms | E2E ms ({args.max_new_tokens} tokens) |\n|---|---|---|---|")
    for i, run in enumerate(runs, 1):
        print(f"| {i} | {run['ttft_ms']:.1f} | {run['tpot_ms']:.2f} | {run['e2e_ms']:.1f} |")
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(f"| median | {median['ttft_ms']:.1f} | {median['tpot_ms']:.2f} | {median['e2e_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
