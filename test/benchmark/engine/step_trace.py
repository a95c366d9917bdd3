"""Summarise a step trace (`--step_trace PATH` of the server): where the device idled, and why.

    python test/benchmark/engine/step_trace.py TRACE.jsonl [--long-gap-ms 1000] [--plot timeline.png] \
        [--floor MODEL_DIR]

Prints one table: the run's wall time on the device clock (first step's start to last step's
end), the device's busy time (sum of step times) and its idle time, split by what came next:
idle before a step is the time from the previous step's end to this step's start, which on the
GPU is when the host had finished launching it (steps are launched while the previous one runs,
so any idle there is host time the device waited for). Gaps over `--long-gap-ms` (no work: the
server waited for requests) are counted apart. Steps are grouped by kind (decode-only steps by
their decodes, steps with prefill chunks by their chunk tokens) and by how they ran (CUDA graph or eager).
"device waited for the launch" is, per step, how long past the moment the device reached the
step the host was still launching it (`launched_ms - start_ms`, at least 0): time inside the
step's device interval in which the device may have waited for the host, not run kernels.

`--floor MODEL_DIR` adds a second table: the steps' device time against what the step could take
at best on that model (bf16), from its shape alone, grouped by decodes. Each step reads every
weight once and its attention reads its KV tokens (`decode_context` + `chunk_context`, traces
since 2026-11-27), at `--bandwidth-gbs`; its tokens' projections cost 2 FLOPs a parameter (the LM
head for the decodes alone; attention's own FLOPs left out) at `--peak-tflops`. "roofline" is the
larger of the two, as if every kernel overlapped memory and compute perfectly; "GEMMs, then
attention" is max(weights, FLOPs) + the KV stream, what a step takes when its projections and its
attention run one after the other, as the layers launch them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

SIZE_EDGES = (256, 1024, 2048, 4096)  # chunk tokens
DECODE_EDGES = (8, 64, 256, 512)  # decodes
HELD_MS = 20.0  # a launch this much longer than its thread's CPU time was held up


def load(path: Path) -> list[dict]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(steps, key=lambda s: s["start_ms"])


def size_class(value: int, edges: tuple[int, ...]) -> tuple[int, str]:
    """(index, label) of the first edge >= value: "<= edge", or "> last edge" past them all."""
    i = next((i for i, e in enumerate(edges) if value <= e), len(edges))
    return i, f"<= {edges[i]}" if i < len(edges) else f"> {edges[-1]}"


def kind(step: dict) -> str:
    if not step["chunks"]:
        label = size_class(step["decodes"], DECODE_EDGES)[1]
        return f"decode only, {label} decodes ({'graph' if step['graph'] else 'eager'})"
    label = size_class(step["chunk_tokens"], SIZE_EDGES)[1]
    return f"with chunks, {label} chunk tokens ({'graph' if step['graph'] else 'eager'})"


def summarise(steps: list[dict], long_gap_ms: float) -> dict:
    groups: dict[str, dict] = {}
    found = []  # (step, ms, kernel names) of the steps with new Triton specialisations
    libraries = []  # (step, launch ms, compilations, kernel names) of the steps that compiled any Triton kernel
    waits: dict[str, dict] = {}  # a line where launches waited for the device: its waits, steps, step kinds
    pinned = []  # (step, kind, blocks, ms) of the launches that took pinned host memory from the driver
    held = []  # (step, kind, ms held, blocked, preempted) of the launches held HELD_MS+ beyond their CPU time
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
            if step["launch_ms"] - step["launch_cpu_ms"] >= HELD_MS:  # blocked / preempted: since 2026-12-08
                held.append((step["step"], kind(step), step["launch_ms"] - step["launch_cpu_ms"],
                             step.get("blocked", 0), step.get("preempted", 0)))
        if "new_kernels" in step:
            g["new_kernels"] += step["new_kernels"]
            g["new_kernel_ms"].append(step["new_kernel_ms"])
            if step["new_kernels"]:  # names since 2026-12-02
                found.append((step["step"], step["new_kernel_ms"], step.get("new_kernel_names", [])))
        if step.get("compiles"):  # every library's compilations, since 2026-12-03
            libraries.append((step["step"], step["launch_ms"], step["compiles"], step.get("compiled", [])))
        if step.get("pinned_allocs"):  # since 2026-12-03
            pinned.append((step["step"], kind(step), step["pinned_allocs"], step["pinned_alloc_ms"]))
        for site in step.get("syncs", []):  # since 2026-12-03
            w = waits.setdefault(site, {"waits": 0, "steps": set(), "kinds": set()})
            w["waits"] += 1
            w["steps"].add(step["step"])
            w["kinds"].add(kind(step))
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
            "groups": groups, "compiles": found, "all_compiles": libraries, "waits": waits, "pinned": pinned,
            "held": held}


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
    return "\n".join(lines + compiles(summary["compiles"]) + all_compiles(summary["all_compiles"])
                     + host_waits(summary.get("waits", {})) + pinned_allocs(summary.get("pinned", []))
                     + held_launches(summary.get("held", [])))


def compiles(found: list[tuple[int, float, list[str]]]) -> list[str]:
    """Lines naming the steps that met a Triton specialisation new to the server, and its kernels."""
    if not found:
        return []
    return ["", "Steps that compiled (or loaded) a Triton kernel: "
            + "; ".join(f"step {step} {ms:.1f} ms: {', '.join(names) or '?'}" for step, ms, names in found)]


def all_compiles(found: list[tuple[int, float, int, list[str]]]) -> list[str]:
    """Lines naming the steps during whose launch Triton compiled any kernel (a library's too)."""
    if not found:
        return []
    return ["", "Steps during whose launch Triton compiled kernels (any library's): "
            + "; ".join(f"step {step} ({ms:.0f} ms launch) {n}: {', '.join(names)}" for step, ms, n, names in found)]


def host_waits(waits: dict[str, dict]) -> list[str]:
    """Lines naming where launches waited for the device (torch's sync debug mode, CUDA traces)."""
    if not waits:
        return []
    return ["", "Lines at which launches waited for the device: "
            + "; ".join(f"{site} {w['waits']} times in {len(w['steps'])} steps ({', '.join(sorted(w['kinds']))})"
                        for site, w in sorted(waits.items(), key=lambda kv: -kv[1]["waits"]))]


def pinned_allocs(pinned: list[tuple[int, str, int, float]]) -> list[str]:
    """A line naming the launches that took page-locked host memory from the driver (CUDA traces)."""
    if not pinned:
        return []
    return ["", f"Launches that took pinned host memory from the driver: {len(pinned)}, "
            f"{sum(n for _, _, n, _ in pinned)} blocks, {sum(ms for *_, ms in pinned):.1f} ms in those calls; "
            + "; ".join(f"step {step} ({kind}) {n} in {ms:.1f} ms" for step, kind, n, ms in pinned[:20])]


def held_launches(held: list[tuple[int, str, float, int, int]]) -> list[str]:
    """A line on the launches held beyond their CPU time, and whether their thread waited or was preempted."""
    if not held:
        return []
    blocked = sum(1 for *_, b, _ in held if b)
    preempted = sum(1 for *_, b, p in held if p and not b)
    return ["", f"Launches held {HELD_MS:g}+ ms beyond their CPU time: {len(held)}, {sum(h[2] for h in held):.0f} ms "
            f"in all; {blocked} gave up the CPU (a lock, the GIL, a driver call), {preempted} only had it taken "
            f"(other work on the core), {len(held) - blocked - preempted} neither; "
            + "; ".join(f"step {step} ({kind}) {ms:.0f} ms, {b} blocked, {p} preempted"
                        for step, kind, ms, b, p in sorted(held, key=lambda h: -h[2])[:20])]


def step_floor(step: dict, model: dict) -> tuple[float, float]:
    """(roofline ms, GEMMs-then-attention ms) of one step; model: floor_model's constants."""
    weights = model["weight_bytes"] / model["bandwidth"]
    kv = (step["decode_context"] + step["chunk_context"]) * model["kv_bytes"] / model["bandwidth"]
    flops = ((step["decodes"] + step["chunk_tokens"]) * model["flops_per_token"]
             + step["decodes"] * model["head_flops"]) / model["peak"]
    return 1000 * max(weights + kv, flops), 1000 * (max(weights, flops) + kv)


def floor_model(model_dir: Path, bandwidth_gbs: float, peak_tflops: float) -> dict:
    from lightllm.models import read_config
    from benchmark.engine.static_benchmark import kv_bytes_per_token, projection_params, weight_bytes

    cfg = read_config(str(model_dir))
    return {"weight_bytes": weight_bytes(cfg, 2), "kv_bytes": kv_bytes_per_token(cfg, 2),
            "flops_per_token": 2 * projection_params(cfg), "head_flops": 2 * cfg.vocab_size * cfg.hidden_size,
            "bandwidth": bandwidth_gbs * 1e9, "peak": peak_tflops * 1e12}


def floor_table(steps: list[dict], model: dict) -> str:
    groups: dict[tuple[int, str], list] = {}  # (order, name) -> [steps, device ms, roofline ms, serial ms]
    for step in steps:
        if step["chunks"]:
            key = (len(DECODE_EDGES) + 1, "with chunks")
        else:
            i, label = size_class(step["decodes"], DECODE_EDGES)
            key = (i, f"decode only, {label} decodes")
        g = groups.setdefault(key, [0, 0.0, 0.0, 0.0])
        roofline, serial = step_floor(step, model)
        g[0] += 1
        g[1] += step["end_ms"] - step["start_ms"]
        g[2] += roofline
        g[3] += serial
    lines = [f"Against the floor: {model['bandwidth'] / 1e9:.0f} GB/s, {model['peak'] / 1e12:.0f} TFLOP/s, "
             f"{model['weight_bytes'] / 1e9:.2f} GB of weights a step, {model['kv_bytes']} B of KV a token", "",
             "| steps | count | device s | roofline s | device / roofline | GEMMs, then attention s | "
             "device / that |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    total = [0, 0.0, 0.0, 0.0]
    for (_, name), g in sorted(groups.items()):
        total = [a + b for a, b in zip(total, g)]
        lines.append(f"| {name} | {g[0]} | {g[1] / 1000:.2f} | {g[2] / 1000:.2f} | {g[1] / g[2]:.2f} | "
                     f"{g[3] / 1000:.2f} | {g[1] / g[3]:.2f} |")
    lines.append(f"| all | {total[0]} | {total[1] / 1000:.2f} | {total[2] / 1000:.2f} | {total[1] / total[2]:.2f} | "
                 f"{total[3] / 1000:.2f} | {total[1] / total[3]:.2f} |")
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
    parser.add_argument("--floor", type=Path, default=None, metavar="MODEL_DIR",
                        help="the steps against their floor on this model (the trace's decode_context, chunk_context)")
    parser.add_argument("--bandwidth-gbs", type=float, default=3000.0, help="H100 copy bandwidth, measured")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM)")
    args = parser.parse_args(argv)
    steps = load(args.trace)
    if not steps:
        print(f"{args.trace}: no steps", file=sys.stderr)
        return 1
    print(table(summarise(steps, args.long_gap_ms)))
    if args.floor:
        if "decode_context" not in steps[0]:
            print(f"{args.trace}: no decode_context (a trace from before 2026-11-27): no floor", file=sys.stderr)
            return 1
        print()
        print(floor_table(steps, floor_model(args.floor, args.bandwidth_gbs, args.peak_tflops)))
    if args.plot:
        plot(steps, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
