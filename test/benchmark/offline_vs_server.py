"""The offline API (LLM.generate, in this process) against the HTTP server, same requests, one run:

    python test/benchmark/offline_vs_server.py --num-prompts 64 --output-len 32 --max-prompt-len 96 --rounds 2

ShareGPT prompts (sharegpt.py's sample, keeping those of at most --max-prompt-len tokens), each
greedy with EOS ignored and exactly --output-len new tokens. An LLM in this process and a
server started as a subprocess, with the same engine settings, are both loaded (not timed) and
warmed up on a few other prompts; then each round gives its own --num-prompts prompts to
LLM.generate (all at once) and to the server (every request at once, serving_client.py,
/generate), the two taking turns to go first, so that load from elsewhere on the machine
falls on both. Prints one table (requests/s, output tokens/s, wall time per round and mode,
offline / server over all rounds) and how many answers are the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules

from compare_servers import serve, stop  # noqa: E402
from serving_client import run_requests, warm_up  # noqa: E402
from sharegpt import SampledRequest, load_sharegpt_requests  # noqa: E402

from lightllm.server.config import build_parser as build_server_parser  # noqa: E402

logger = logging.getLogger("offline_vs_server")
WARMUP = 4  # prompts, besides the timed ones


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, default=None, help="model directory (default: the default model)")
    add("--num-prompts", type=int, default=64)
    add("--output-len", type=int, default=32, help="new tokens per request (EOS ignored)")
    add("--max-prompt-len", type=int, default=96, help="keep ShareGPT prompts of at most this many tokens")
    add("--rounds", type=int, default=2, help="rounds, each on its own prompts")
    add("--seed", type=int, default=0, help="ShareGPT sampling seed")
    add("--max-total-token-num", type=int, default=16384, help="KV budget of both engines")
    add("--engine-args", default="", help="more server flags for both (e.g. '--chunked_prefill_size 1024')")
    add("--result-json", type=Path, default=None)
    return parser


def sample(tokenizer, args) -> list[SampledRequest]:
    """rounds * num_prompts + WARMUP ShareGPT requests with short prompts and a fixed output length."""
    wanted = args.rounds * args.num_prompts + WARMUP
    pool = load_sharegpt_requests(tokenizer, wanted * 8, args.seed)
    short = [SampledRequest(r.prompt, r.prompt_ids, args.output_len) for r in pool if r.prompt_len <= args.max_prompt_len]
    if len(short) < wanted:
        raise SystemExit(f"only {len(short)} sampled prompts have <= {args.max_prompt_len} tokens; raise --max-prompt-len")
    return short[:wanted]


def engine_settings(args) -> dict:
    """--engine-args as LLM keyword arguments: the server's parser reads them (its flags are
    ServerConfig's field names), and those that differ from the defaults are passed on."""
    parser = build_server_parser()
    given, defaults = vars(parser.parse_args(shlex.split(args.engine_args))), vars(parser.parse_args([]))
    return {name: value for name, value in given.items() if value != defaults[name]}


class Offline:
    """An LLM in this process."""

    def __init__(self, args, model_dir: str, warmup: list[SampledRequest]):
        from lightllm import LLM, SamplingParams

        self.llm = LLM(model_dir, max_total_token_num=args.max_total_token_num, **engine_settings(args))
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.llm.generate([r.prompt for r in warmup], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)

    def run(self, requests: list[SampledRequest]) -> dict:
        start = time.perf_counter()
        outputs = self.llm.generate([r.prompt for r in requests], self.params)
        wall = time.perf_counter() - start
        return summary(wall, [len(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].text for o in outputs])

    def close(self) -> None:
        self.llm.shutdown()


class Server:
    """A server subprocess (compare_servers.serve) on a free port."""

    def __init__(self, args, model_dir: str, warmup: list[SampledRequest]):
        server_args = ["--model_dir", model_dir, "--max_total_token_num", str(args.max_total_token_num),
                       *shlex.split(args.engine_args)]
        log_path = Path(tempfile.mkdtemp(prefix="offline_vs_server_")) / "server.log"
        logger.info("server log: %s", log_path)
        self.process, self.url = serve(server_args, log_path)
        asyncio.run(warm_up(self.url, warmup, max_new_tokens=8))

    def run(self, requests: list[SampledRequest]) -> dict:
        results, wall = asyncio.run(run_requests(self.url, requests, stream=False))
        failed = [r.error for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} server requests failed, first: {failed[0]}")
        return summary(wall, [r.output_len for r in results], [r.output_text for r in results])

    def close(self) -> None:
        stop(self.process)


def run_rounds(args, modes: dict, requests: list[SampledRequest]) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in modes}
    for i in range(args.rounds):
        batch = requests[i * args.num_prompts: (i + 1) * args.num_prompts]
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for name in order:
            logger.info("round %d: %s, %d requests at once", i + 1, name, len(batch))
            results[name].append(modes[name].run(batch))
    return results


def summary(wall: float, output_lens: list[int], texts: list[str]) -> dict:
    return {"requests": len(output_lens), "wall_s": wall, "request_throughput": len(output_lens) / wall,
            "output_tokens": sum(output_lens), "output_throughput": sum(output_lens) / wall, "texts": texts}


COLUMNS = [("requests/s", "request_throughput", "{:.3f}"), ("output tok/s", "output_throughput", "{:.1f}"),
           ("wall s", "wall_s", "{:.1f}"), ("output tokens", "output_tokens", "{:d}")]


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| mode | round | " + " | ".join(name for name, _, _ in COLUMNS) + " |",
             "| --- | ---: |" + " ---: |" * len(COLUMNS)]
    totals = {}
    for name, rounds in results.items():
        for i, result in enumerate(rounds, 1):
            lines.append(f"| {name} | {i} | " + " | ".join(spec.format(result[key]) for _, key, spec in COLUMNS) + " |")
        wall = sum(r["wall_s"] for r in rounds)
        totals[name] = {"wall_s": wall, "request_throughput": sum(r["requests"] for r in rounds) / wall,
                        "output_throughput": sum(r["output_tokens"] for r in rounds) / wall}
    offline, server = totals.values()
    ratios = [f"{offline[key] / server[key]:.2f}x" for _, key, _ in COLUMNS[:3]]
    lines.append("| offline / server | all | " + " | ".join(ratios) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer

    from lightllm.tools.default_model import ensure_default_model

    model_dir = str(args.model or ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    sampled = sample(tokenizer, args)
    requests, warmup = sampled[:-WARMUP], sampled[-WARMUP:]
    logger.info("%d requests: %d prompt tokens, %d output tokens each", len(requests),
                sum(r.prompt_len for r in requests), args.output_len)
    modes: dict = {}
    try:
        modes["offline LLM.generate"] = Offline(args, model_dir, warmup)
        modes["HTTP server"] = Server(args, model_dir, warmup)
        results = run_rounds(args, modes, requests)
    finally:
        for mode in modes.values():
            mode.close()
    offline_texts, server_texts = [[t for r in rounds for t in r.pop("texts")] for rounds in results.values()]
    same = sum(a == b for a, b in zip(offline_texts, server_texts))
    import torch

    print(f"{args.rounds} rounds of {args.num_prompts} ShareGPT prompts (<= {args.max_prompt_len} tokens), "
          f"{args.output_len} greedy tokens each, EOS ignored; {platform.node()}, {os.cpu_count()} CPUs, "
          f"torch threads offline {torch.get_num_threads()}; {time.strftime('%Y-%m-%d %H:%M')}\n{table(results)}\n"
          f"same greedy text offline and served: {same} of {len(offline_texts)}", flush=True)
    if args.result_json:
        args.result_json.write_text(json.dumps({"args": vars(args) | {"model": model_dir}, "results": results,
                                                "same_text": same}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
