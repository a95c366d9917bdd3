"""Two server variants on the same requests, one run: by default the prefix cache on against off.

    python test/benchmark/compare_servers.py --out-dir cmp \\
        --bench "shared-prefix=--workload shared-prefix --prefix-groups 8 --prefix-group-size 8 --stream" \\
        --bench "sharegpt=--requests saved.json --num-prompts 32 --stream" [--server-args "..."]
    python test/benchmark/compare_servers.py --out-dir dp --variant "dp 2=--dp 2" --variant "dp 1=--dp 1" \\
        --server-args "--model_dir TINY" --bench "sharegpt=--model TINY --num-prompts 64 --stream"

For each --bench (NAME=benchmark_serving flags) a server is started per --variant (NAME=its own
flags, added to --server-args; default: "cache on" and "cache off" = --disable_prefix_cache), and
benchmark_serving runs against each; the table gives every variant and the first / second ratio,
with the hit rate read from /metrics. JSON per run in --out-dir, the table in OUT/summary.md, a
plot in OUT/compare.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules

import benchmark_serving  # noqa: E402
from server_process import start_server  # noqa: E402

logger = logging.getLogger("compare_servers")
DEFAULT_VARIANTS = {"cache on": [], "cache off": ["--disable_prefix_cache"]}
COLUMNS = [("req/s", "request_throughput", "{:.3f}"), ("output tok/s", "output_throughput", "{:.1f}"),
           ("median TTFT ms", "median_ttft_ms", "{:.0f}"), ("median TPOT ms", "median_tpot_ms", "{:.0f}"),
           ("duration s", "duration", "{:.1f}"), ("hit rate", "prefix_cache_hit_rate", "{:.1%}")]


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def table(results: dict, variants: list[str]) -> str:
    head = "| workload | server | " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    lines = [head, "| --- | --- |" + " ---: |" * len(COLUMNS)]
    for bench, runs in results.items():
        for mode, summary in runs.items():
            cells = [fmt(summary.get(key), spec) for _, key, spec in COLUMNS]
            lines.append(f"| {bench} | {mode} | " + " | ".join(cells) + " |")
        first, second = (runs.get(v) for v in variants[:2])
        if first and second:
            ratios = [fmt(first[key] / second[key] if first.get(key) and second.get(key) and key != "prefix_cache_hit_rate"
                          else None, "{:.2f}x") for _, key, _ in COLUMNS]
            lines.append(f"| {bench} | {variants[0]} / {variants[1]} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def plot(results: dict, variants: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, (label, key) in zip(axes, [("requests/s", "request_throughput"), ("median TTFT (ms)", "median_ttft_ms")]):
        for offset, mode in zip((-0.2, 0.2), reversed(variants[:2])):
            values = [results[n].get(mode, {}).get(key) or 0 for n in names]
            ax.bar([i + offset for i in range(len(names))], values, width=0.4, label=mode)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", action="append", required=True, help="NAME=benchmark_serving flags")
    parser.add_argument("--server-args", default="", help="flags for every server (besides --port)")
    parser.add_argument("--variant", action="append", help="NAME=flags of one server (give two or more); "
                                                           "default: the prefix cache on and off")
    parser.add_argument("--out-dir", type=Path, default=Path("prefix_cache_cmp"))
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = DEFAULT_VARIANTS
    if args.variant:
        variants = {name: shlex.split(flags) for name, _, flags in (v.partition("=") for v in args.variant)}
    results: dict[str, dict] = {}
    failed = 0
    for bench in args.bench:
        name, _, flags = bench.partition("=")
        results[name] = {}
        for mode, extra in variants.items():
            tag = f"{name}-{mode.replace(' ', '-')}"
            server = start_server(shlex.split(args.server_args) + extra, args.out_dir / f"{tag}.log", timeout=600)
            try:
                started = time.perf_counter()
                bench_args = benchmark_serving.parse_args(
                    [*shlex.split(flags), "--base-url", server.url, "--result-json", str(args.out_dir / f"{tag}.json")])
                summary = benchmark_serving.run(bench_args)
                failed += summary["failed"]
                results[name][mode] = summary
                logger.info("%s: %.0f s", tag, time.perf_counter() - started)
            finally:
                server.stop()
    text = table(results, list(variants))
    (args.out_dir / "summary.md").write_text(text + "\n")
    (args.out_dir / "summary.json").write_text(json.dumps(results, indent=2, default=str))
    plot(results, list(variants), args.out_dir / "compare.png")
    print(text, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
