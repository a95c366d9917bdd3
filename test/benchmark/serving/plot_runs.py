"""Bars of several serving runs side by side: request throughput, median TTFT and median TPOT.

    python test/benchmark/serving/plot_runs.py --out runs.png "bf16=DIR/new-1000/compare.json" "fp8=..."

Each argument is LABEL=PATH of a compare.py `compare.json` (its first variant, or PATH#VARIANT;
device_serving.sh saves one per run), of an older `compare.json` (its "lightllm" side) or of a
benchmark_serving.py result JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = [("requests/s", "request_throughput"), ("median TTFT (ms)", "median_ttft_ms"),
          ("median TPOT (ms)", "median_tpot_ms")]


def load(path: Path) -> dict:
    path, _, variant = str(path).partition("#")
    data = json.loads(Path(path).read_text())
    if "results" in data:  # compare.py: {"results": {workload: {variant: summary}}}
        runs = next(iter(data["results"].values()))
        return runs[variant] if variant else next(iter(runs.values()))
    return data.get("lightllm", data)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.6))
    labels = list(runs)
    for ax, (title, key) in zip(axes, PANELS):
        values = [runs[label][key] for label in labels]
        bars = ax.bar(range(len(labels)), values, color=[f"C{i}" for i in range(len(labels))])
        ax.bar_label(bars, fmt="%.1f" if max(values) < 1000 else "%.0f", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=PATH[#VARIANT] to a compare.json or benchmark result JSON")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = {label: load(path) for label, _, path in (run.partition("=") for run in args.runs)}
    plot(runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
