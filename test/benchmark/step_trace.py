"""Summarise a step trace (`--step_trace PATH` of the server): where the device idled, and why.

    python test/benchmark/step_trace.py TRACE.jsonl [--long-gap-ms 1000] [--plot timeline.png]

Prints one table: the run's wall time on the device clock (first step's start to last step's
end), the device's busy time (sum of step times) and its idle time, split by what came next:
idle before a step is the time from the previous step's end to this step's start, which on the
GPU is when the host had finished launching it (steps are launched while the previous one runs,
so any idle there is host time the device waited for). Gaps over `--long-gap-ms` (no work: the
server waited for requests) are counted apart. Steps are grouped by kind (decode-only steps,
and steps with prefill chunks by their chunk tokens) and by how they ran (CUDA graph or eager).
"device waited for the launch" is, per step, how long past the moment the device reached the
step the host was still launching it (`launched_ms - start_ms`, at least 0): time inside the
step's device interval in which the device may have waited for the host, not run kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SIZE_EDGES = (256, 1024, 2048, 4096)


def load(path: Path) -> list[dict]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(steps, key=lambda s: s["start_ms"])


def kind(step: dict) -> str:
    if not step["chunks"]:
        return "decode only (graph)" if step["graph"] else "decode only (eager)"
    top = next((e for e in SIZE_EDGES if step["chunk_tokens"] <= e), None)
    label = f"<= {top}" if top else f"> {SIZE_EDGES[-1]}"
    return f"with chunks, {label} chunk tokens ({'graph' if step['graph'] else 'eager'})"


def summarise(steps: list[dict], long_gap_ms: float) -> dict:
    groups: dict[str, dict] = {}
    idle = long_idle = 0.0
    previous_end = None
    for step in steps:
        gap = 0.0 if previous_end is None else max(0.0, step["start_ms"] - previous_end)
        g = groups.setdefault(kind(step), {"steps": 0, "device_ms": [], "launch_ms": [], "idle_before_ms": 0.0,
                                           "decodes": [], "waited_ms": [], "cpu_ms": [], "gc_ms": [],
                                           "new_kernels": 0, "new_kernel_ms": []})
        g["steps"] += 1
        if "launched_ms" in step:  # traces from before launched_ms was recorded have none
            g["waited_ms"].append(max(0.0, step["launched_ms"] - step["start_ms"]))
        g["device_ms"].append(step["end_ms"] - step["start_ms"])
        g["launch_ms"].append(step["launch_ms"])
        if "launch_cpu_ms" in step:  # traces from before these were recorded have neither
            g["cpu_ms"].append(step["launch_cpu_ms"])
            g["gc_ms"].append(step["gc_ms"])
        if "new_kernels" in step:
            g["new_kernels"] += step["new_kernels"]
            g["new_kernel_ms"].append(step["new_kernel_ms"])
        g["decodes"].append(step["decodes"])
        if gap > long_gap_ms:
            long_idle += gap
        else:
            idle += gap
            g["idle_before_ms"] += gap
        previous_end = step["end_ms"] if previous_end is None else max(previous_end, step["end_ms"])
    wall = steps[-1]["end_ms"] - steps[0]["start_ms"] if steps else 0.0
    busy = sum(sum(g["device_ms"]) for g in groups.values())
    return {"steps": len(steps), "wall_ms": wall, "busy_ms": busy, "idle_ms": idle, "long_idle_ms": long_idle,
            "groups": groups}


def table(summary: dict) -> str:
    active = summary["wall_ms"] - summary["long_idle_ms"]
    lines = [f"{summary['steps']} steps over {summary['wall_ms'] / 1000:.2f} s of device clock; "
             f"busy {summary['busy_ms'] / 1000:.2f} s = {100 * summary['busy_ms'] / max(active, 1e-9):.1f}% of the "
             f"{active / 1000:.2f} s with work (idle between steps {summary['idle_ms'] / 1000:.2f} s; "
             f"{summary['long_idle_ms'] / 1000:.2f} s in gaps with no work left out)", "",
             "| steps | count | mean decodes | mean device ms | host launch ms, mean / max | its CPU ms, mean | "
             "its GC ms, mean / max | its new Triton kernels (most ms in one launch) | device waited for the launch, "
             "mean ms | idle before them, s | share of idle |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def mean(values: list, fmt: str = ".2f") -> str:
        return format(statistics.mean(values), fmt) if values else "-"

    for name, g in sorted(summary["groups"].items(), key=lambda kv: -kv[1]["idle_before_ms"]):
        gc_ms = f"{mean(g['gc_ms'])} / {max(g['gc_ms']):.1f}" if g["gc_ms"] else "-"
        new = f"{g['new_kernels']} ({max(g['new_kernel_ms']):.1f})" if g["new_kernel_ms"] else "-"
        lines.append(f"| {name} | {g['steps']} | {mean(g['decodes'], '.0f')} | {mean(g['device_ms'])} | "
                     f"{mean(g['launch_ms'])} / {max(g['launch_ms']):.1f} | {mean(g['cpu_ms'])} | {gc_ms} | {new} | "
                     f"{mean(g['waited_ms'])} | {g['idle_before_ms'] / 1000:.2f} | "
                     f"{100 * g['idle_before_ms'] / max(summary['idle_ms'], 1e-9):.0f}% |")
    return "\n".join(lines)


def plot(steps: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = steps[0]["start_ms"]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for s in steps:
        colour = "tab:blue" if not s["chunks"] else "tab:orange"
        ax.barh(0, (s["end_ms"] - s["start_ms"]) / 1000, left=(s["start_ms"] - t0) / 1000, height=0.8, color=colour,
                linewidth=0)
    ax.set_yticks([])
    ax.set_xlabel("seconds (device clock)")
    ax.set_title("device timeline: decode-only steps (blue), steps with prefill chunks (orange), idle (white)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--long-gap-ms", type=float, default=1000.0)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the device timeline")
    args = parser.parse_args(argv)
    steps = load(args.trace)
    if not steps:
        print(f"{args.trace}: no steps", file=sys.stderr)
        return 1
    print(table(summarise(steps, args.long_gap_ms)))
    if args.plot:
        plot(steps, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
