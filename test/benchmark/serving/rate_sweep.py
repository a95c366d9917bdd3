"""Latency against load: the same ShareGPT requests sent to one server at several Poisson rates.

    python test/benchmark/serving/rate_sweep.py --base-url http://127.0.0.1:8000 --model DIR \\
        --requests saved.json --num-prompts 1000 --rates 5,10,20,30,40 \\
        --label bf16 --out-json sweep.json --plot sweep.png
    python test/benchmark/serving/rate_sweep.py --plot-only both.png A=sweepA.json B=sweepB.json

Every rate replays the same requests (the first --num-prompts of --requests, else
benchmark_serving's ShareGPT sample), streamed from /generate_stream with Poisson arrivals
seeded by --seed, one rate after the other through benchmark_serving's request runner. Per
rate: TTFT and TPOT at p50/p90/p99, request throughput, and goodput: the requests per second
whose own TTFT and TPOT were within --slo-ttft-ms and --slo-tpot-ms (serving_metrics). One
markdown table on stdout, the figures in --out-json, latency and goodput against rate in --plot.
--plot-only draws saved sweeps (LABEL=JSON, or JSON and its --label) on the same axes.

--arrival vllm --api completions --warmup 0 replays what vLLM's `vllm bench serve --backend vllm
--dataset-name sharegpt --ignore-eos --request-rate R --seed S` sends (on the requests saved with
vLLM's sampling rules for that seed, which are in its order): its arrival times, no request before
the measured ones (its 0.26 release skips the initial test request unless --ready-check-timeout-sec
is given, and warms up only with --num-warmups), its body (no temperature: the server's default)
and its TTFT (the first chunk with a choice).

A server with the prefix cache on still holds a rate's prompts when the next rate sends them
again, which makes later rates look faster: start it with --disable_prefix_cache (the table
gives each rate's hit rate when the server's /metrics has the counters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.serving.benchmark_serving import (add_client_args, json_safe, load_tokenizer, sharegpt_requests,  # noqa: E402
                                                traffic)
from benchmark.lib.serving_client import read_prefix_cache_counters, run_requests, warm_up  # noqa: E402
from benchmark.lib.serving_metrics import PERCENTILE_RANKS, SLO, goodput, prefix_cache_figures, summarize  # noqa: E402
from benchmark.lib.sharegpt import SampledRequest  # noqa: E402

logger = logging.getLogger("rate_sweep")

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"))
COLUMNS = [  # (header, key of a rate's entry, format)
    ("rate req/s", "request_rate", "{:g}"),
    ("completed", "completed", "{}"),
    ("failed", "failed", "{}"),
    ("throughput req/s", "request_throughput", "{:.2f}"),
    ("goodput req/s", "goodput", "{:.2f}"),
    *[(f"{name} p{rank} ms", f"{stat}_{key}_ms", "{:.1f}")
      for key, name in LATENCIES for stat, rank in PERCENTILE_RANKS.items()],
    ("prefix hit rate", "prefix_cache_hit_rate", "{:.0%}"),
]
PLOTTED = {"median": "-", "p99": "--"}  # percentile drawn: line style
CACHED_WARNING = 0.1  # ShareGPT prompts share little: a higher hit rate means a rate replayed cached prompts


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"want positive finite requests per second, comma-separated: {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_args(parser)
    add = parser.add_argument
    add("--rates", type=parse_rates, help="Poisson request rates (req/s) to sweep, comma-separated, e.g. 5,10,20")
    add("--slo-ttft-ms", type=float, default=SLO.ttft_ms, help="goodput: most TTFT of a good request (ms)")
    add("--slo-tpot-ms", type=float, default=SLO.tpot_ms, help="goodput: most TPOT of a good request (ms)")
    add("--label", default=None, help="name of this sweep in plots (default: --base-url)")
    add("--out-json", type=Path, default=None, help="write the sweep to this JSON file")
    add("--plot", type=Path, default=None, help="draw latency and goodput against rate to this PNG")
    add("--plot-only", type=Path, default=None, metavar="PNG", help="only draw the saved sweeps given as SWEEPS")
    add("sweeps", nargs="*", metavar="SWEEPS", help="--plot-only: LABEL=JSON or JSON of earlier sweeps")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_only and not args.sweeps:
        parser.error("--plot-only needs the sweeps to draw (LABEL=JSON ...)")
    if not args.plot_only and (args.sweeps or not args.rates):
        parser.error("a sweep needs --rates and takes no positional arguments (those are for --plot-only)")
    return args


def measure_rate(args, requests: list[SampledRequest], rate: float, slo: SLO) -> dict:
    """One streamed run of every request at `rate`; its figures, goodput and prefix-cache hits."""
    before = asyncio.run(read_prefix_cache_counters(args.base_url))
    results, duration = asyncio.run(run_requests(
        args.base_url, requests, stream=True, request_rate=rate, max_concurrency=args.max_concurrency,
        seed=args.seed, timeout_s=args.timeout, progress=not args.no_progress, **traffic(args)))
    after = asyncio.run(read_prefix_cache_counters(args.base_url))
    entry = {"request_rate": rate, **summarize(results, duration), "goodput": goodput(results, duration, slo)}
    entry.update(prefix_cache_figures(before, after))
    for error, count in entry["errors"].items():
        logger.error("rate %g: %d failed request(s): %s", rate, count, error)
    if (entry["prefix_cache_hit_rate"] or 0) > CACHED_WARNING:
        logger.warning("rate %g: %.0f%% of prompt tokens were cached by earlier runs, so TTFT is low; "
                       "start the server with --disable_prefix_cache", rate, 100 * entry["prefix_cache_hit_rate"])
    return entry


def sweep(args, requests: list[SampledRequest], slo: SLO) -> list[dict]:
    if args.warmup:
        asyncio.run(warm_up(args.base_url, requests[: args.warmup]))
    entries = []
    for rate in tqdm(args.rates, desc="rates", disable=args.no_progress):
        entries.append(measure_rate(args, requests, rate, slo))
        logger.info("rate %g req/s: throughput %.2f, goodput %.2f req/s", rate,
                    entries[-1]["request_throughput"], entries[-1]["goodput"])
    return entries


def table(result: dict) -> str:
    slo = result["slo"]
    lines = [f"{result['label']}: {result['num_prompts']} requests per rate; goodput = requests with "
             f"TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms, per second", ""]
    lines.append("| " + " | ".join(header for header, _, _ in COLUMNS) + " |")
    lines.append("|" + " ---: |" * len(COLUMNS))
    for entry in result["rates"]:
        lines.append("| " + " | ".join(fmt(entry.get(key), spec) for _, key, spec in COLUMNS) + " |")
    return "\n".join(lines)


def run(args) -> dict:
    tokenizer = None if args.requests else load_tokenizer(args)  # a saved sample is counted already
    requests = sharegpt_requests(args, tokenizer)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    result = {"label": args.label or args.base_url, "num_prompts": len(requests),
              "slo": asdict(slo), "config": json_safe(vars(args))}
    result["rates"] = sweep(args, requests, slo)
    print(table(result), flush=True)  # the result itself goes to stdout; diagnostics are logged
    if args.out_json:
        args.out_json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot({result["label"]: result}, args.plot)
    return result


def load_sweep(arg: str) -> tuple[str, dict]:
    """LABEL=JSON, or JSON alone under the label it was saved with."""
    label, _, path = arg.rpartition("=")
    result = json.loads(Path(path).read_text())
    return label or result["label"], {**result, "label": label or result["label"]}


def values(entries: list[dict], key: str) -> list[float]:
    """A figure at every rate, NaN where a rate has none (no request succeeded): a gap in the line."""
    return [math.nan if entry.get(key) is None else entry[key] for entry in entries]


def plot_latency(ax, key: str, name: str, sweeps: dict[str, dict]) -> None:
    for color, (label, result) in enumerate(sweeps.items()):
        rates = values(result["rates"], "request_rate")
        for stat, style in PLOTTED.items():
            ax.plot(rates, values(result["rates"], f"{stat}_{key}_ms"), style, marker="o", color=f"C{color}",
                    label=f"{label} p{PERCENTILE_RANKS[stat]}")
        ax.axhline(result["slo"][f"{key}_ms"], ls=":", lw=1, color=f"C{color}")  # the goodput bound
    ax.set(xlabel="request rate (req/s)", ylabel=f"{name} (ms)", title=f"{name} (dotted: SLO)")


def plot_goodput(ax, sweeps: dict[str, dict]) -> None:
    offered = sorted({rate for result in sweeps.values() for rate in values(result["rates"], "request_rate")})
    ax.plot(offered, offered, ":", color="grey", label="offered rate")
    for color, (label, result) in enumerate(sweeps.items()):
        rates = values(result["rates"], "request_rate")
        ax.plot(rates, values(result["rates"], "goodput"), "-o", color=f"C{color}", label=f"{label} goodput")
        ax.plot(rates, values(result["rates"], "request_throughput"), "--", color=f"C{color}",
                label=f"{label} throughput")
    ax.set(xlabel="request rate (req/s)", ylabel="req/s", title="goodput (within the SLO) and throughput")


def plot(sweeps: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, name) in zip(axes, LATENCIES):
        plot_latency(ax, key, name, sweeps)
    axes[0].set_yscale("log")  # TTFT grows by orders of magnitude once requests queue
    plot_goodput(axes[2], sweeps)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.plot_only:
        sweeps = dict(map(load_sweep, args.sweeps))
        for result in sweeps.values():
            print(table(result) + "\n", flush=True)
        plot(sweeps, args.plot_only)
        return 0
    result = run(args)
    return 1 if any(entry["failed"] for entry in result["rates"]) else 0


if __name__ == "__main__":
    sys.exit(main())
