"""Where one engine step's time goes: decode steps against their memory floor, kernel by kernel,
and what an eager (prefill or mixed) step costs the host.

    python test/benchmark/engine/profile_step.py --model DIR --load-format dummy --out-md profile.md

For each decode batch size (default 1 and 256, `--context` tokens cached per request, the
server's `max_req_total_len` and `running_max_req_size` so the same CUDA graphs are captured):

- `engine step, one in flight`: decode steps launched back to back as the engine core does
  (each call launches the next step and answers with the previous one's tokens, so the host's
  work overlaps the device's), time per step; `engine step alone`: one synchronous step
  (`run_step`: upload, graph replay, sampling, download), median over `--iters`; `replay`: the captured graph alone, timed with CUDA events; the floor is
  the bytes a decode step must read (weights + the batch's KV) over the measured copy bandwidth.
- the step's kernels under torch.profiler, grouped: each projection GEMM (named by its place in
  the layer: qkv, o, gate_up, down, then lm_head), attention, norms, rotary and KV write, the
  sampler and the rest; per step their device time, and the step's gaps (the wall time of the
  step in which no kernel runs).
- each projection GEMM alone at M = batch: time and achieved bandwidth against the copy bandwidth,
  as `F.linear` (the model's call) and as `x @ Wt` with the weight stored transposed once
  ([in, out]), the layout cuBLAS may serve faster for small M.

Then steps with prompt chunks (replayed from the mixed-step graphs where they fit, eager with
`--no-cuda-graph`): a prefill step of one 128-token prompt and a mixed step (`--mixed-decodes`
decodes and `--mixed-chunk` prompt tokens in `--mixed-prompts` prompts; on CUDA its kernels
grouped as the decode steps' are): wall time, the host's launch time, device busy
time, and a cProfile of the host's Python (the top functions by own time).

Runs on the CPU too (`--device cpu`, tiny model: the plumbing; CUDA-only parts are skipped).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import (Bench, copy_bandwidth, int_list, kv_bytes_per_token, replay_us,  # noqa: E402
                                               sync, timed, weight_bytes)

from lightllm.engine.config import EngineConfig  # noqa: E402
from lightllm.engine.model_runner import ModelRunner  # noqa: E402
from benchmark.lib.direct_step import run_step
from lightllm.engine.plan import StepPlan  # noqa: E402

logger = logging.getLogger("profile_step")

GEMM_NAMES = ("qkv", "o", "gate_up", "down")
DECODE_CONTEXT = 256  # cached tokens of the mixed steps' decode rows when they join
TRITON_GROUPS = {  # kernel name fragment -> group, the first that matches
    # the hybrid models' linear layers (fla's kernels: the prompt chunks' delta rule)
    "_gated_delta_rule_step": "delta rule step (states)", "_gated_delta_rule_runs": "delta rule runs (verify)",
    "_causal_conv1d": "causal conv", "_gated_rms_norm": "gated norm", "_linear_gates": "linear gates",
    "_l2norm_heads": "q/k l2 norm", "_chunk_states": "chunk states in/out (fla path)",
    "chunk_": "fla chunk kernels", "solve_tril": "fla chunk kernels", "recompute_w_u": "fla chunk kernels",
    "_decode_split": "attention (decode)", "_extend": "attention (extend)",
    "_rms_norm": "rms norm (+ residual)", "_rotary_kv": "rotary + kv write", "_silu": "silu*mul",
    "_quantize_rows": "fp8 input quantisation",
}
# between a projection GEMM and the kernels that name it (an eager mixed step has memsets there)
SKIPPED_NEIGHBOURS = ("GEMM split", "fp8 input", "copies")


def is_gemm(name: str) -> bool:
    lowered = name.lower()
    if "reduce" in lowered:  # cuBLAS's split-K reduction: part of the GEMM before it
        return False
    return any(s in lowered for s in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas")) or "_fp8_gemm" in name


def group_of(name: str) -> str:
    for fragment, group in TRITON_GROUPS.items():
        if fragment in name:
            return group
    lowered = name.lower()
    if "splitkreduce" in lowered:
        return "GEMM split-K reduction"
    if any(s in lowered for s in ("softmax", "argmax", "reduce", "gather", "topk", "sort", "max")):
        return "sampler and reductions"
    if "memcpy" in lowered or "memset" in lowered:
        return "copies"
    return "other elementwise"


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device activity (kernels, copies) in the trace, by start."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda k: k[1])


def label_kernels(kernels: list[tuple[str, float, float]], num_layers: int) -> list[tuple[str, float, float]]:
    """Group names; a projection GEMM is named by the kernels around it, as the layer orders
    them: norm -> qkv -> rotary, attention -> o, norm -> gate_up -> silu, silu -> down, and the
    last norm -> LM head (whichever cuBLAS kernel serves each); a hybrid model's linear layers
    in_proj -> gates and conv, gated norm -> out_proj."""
    groups = [None if is_gemm(name) else group_of(name) for name, _, _ in kernels]
    named = [g if g and not g.startswith(SKIPPED_NEIGHBOURS) else None for g in groups]
    labelled = []
    for i, (name, start, end) in enumerate(kernels):
        if groups[i] is not None:
            labelled.append((groups[i], start, end))
            continue
        # the nearest named kernels each side; a gated attention's output gate (elementwise) sits between
        # its attention and o, its q/k norms between qkv and the rotary
        before = next((g for g in reversed(named[:i]) if g and g != "other elementwise"), "")
        after = next((g for g in named[i + 1:] if g), "")
        after_norms = next((g for g in named[i + 1:] if g and not g.startswith("rms norm")), "")
        if before.startswith("attention"):
            which = "o"
        elif before.startswith("silu"):
            which = "down"
        elif before.startswith("gated norm"):
            which = "out_proj"
        elif after.startswith("silu"):
            which = "gate_up"
        elif after.startswith(("linear gates", "causal conv")):
            which = "in_proj"
        elif after.startswith("rotary") or after_norms.startswith("rotary"):
            which = "qkv"
        else:
            which = "lm_head"
        labelled.append((f"GEMM {which}", start, end))
    return labelled


def busy_us(kernels) -> float:
    """Union of the kernels' intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for _, start, end in sorted(kernels, key=lambda k: k[1]):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def profile_steps(fn, steps: int, started=None):
    """`steps` calls of fn under torch's profiler; `started()` runs once the profiler is on."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        if started is not None:
            started()
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return prof


@dataclass
class Roofline:
    """What bounds a kernel group: bandwidth (bytes/s, the measured copy rate) and dense peak FLOP/s."""
    bandwidth: float
    peak: float
    rows: list = field(default_factory=list)  # (step, step ms, kernel ms, floor ms, losses) of each step tabled

    def floor_us(self, nbytes: float, flops: float) -> tuple[float, str]:
        memory, compute = nbytes / self.bandwidth, flops / self.peak
        return 1e6 * max(memory, compute), ("memory" if memory >= compute else "compute")


def step_work(cfg, itemsize: int, kv_itemsize: int, decode_contexts: list[int],
              prompts: list[tuple[int, int]]) -> dict[str, tuple[float, float]] | None:
    """(bytes, FLOPs) each kernel group of a dense model's step must move and compute, at the least:
    decodes at `decode_contexts` cached tokens, `prompts` as (cached tokens, new tokens), one logit row
    each. Weights are read once a step; activations once in and once out of each kernel; attention
    reads each K/V row once a request (FLOPs 4 a head dimension a key, causal within a chunk). None
    for an MoE or hybrid model (their own benchmarks price those: moe_bench.py, delta_rule_bench.py)."""
    if getattr(cfg, "moe", None) is not None or getattr(cfg, "linear_attn", None) is not None:
        return None
    layers, hidden, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tokens = len(decode_contexts) + sum(n for _, n in prompts)
    weight_itemsize = 1 if getattr(cfg, "quantization", None) == "fp8" else itemsize

    def gemm(k: int, n: int, m: int, times: int, weight: int = weight_itemsize) -> tuple[float, float]:
        return times * (k * n * weight + m * (k + n) * itemsize), times * 2.0 * m * k * n

    work = {"GEMM qkv": gemm(hidden, q_out + 2 * kv_out, tokens, layers), "GEMM o": gemm(q_out, hidden, tokens, layers),
            "GEMM gate_up": gemm(hidden, 2 * inter, tokens, layers), "GEMM down": gemm(inter, hidden, tokens, layers),
            "GEMM lm_head": gemm(hidden, cfg.vocab_size, len(decode_contexts) + len(prompts), 1, itemsize),
            # the add-and-norm reads x and the residual and writes both; a layer has two, the model one more
            "rms norm (+ residual)": ((2 * layers + 1) * 4 * tokens * hidden * itemsize, 0.0),
            # q, k and v in; q out, k and v into the cache
            "rotary + kv write": (layers * tokens * ((2 * q_out + 2 * kv_out) * itemsize
                                                      + 2 * kv_out * kv_itemsize), 0.0),
            "silu*mul": (layers * tokens * 3 * inter * itemsize, 0.0)}
    kv_row = 2 * kv_out * kv_itemsize
    if decode_contexts:
        keys = sum(decode_contexts)
        work["attention (decode)"] = (layers * (keys * kv_row + len(decode_contexts) * 2 * q_out * itemsize),
                                      layers * 4.0 * q_out * keys)
    if prompts:
        pairs = sum(n * (cached + (n + 1) / 2) for cached, n in prompts)
        work["attention (extend)"] = (layers * sum((cached + n) * kv_row + n * 2 * q_out * itemsize
                                                   for cached, n in prompts), layers * 4.0 * q_out * pairs)
    return work


def kernel_table(kernels, steps: int, step_ms: float, title: str, num_layers: int,
                 work: dict[str, tuple[float, float]] | None = None, roofline: Roofline | None = None,
                 step: str | None = None) -> list[str]:
    """The step's kernels by group; with `work` (step_work) and a `roofline`, each group's floor and its
    fraction of the bound's peak, and the step's row in `roofline.rows` (under `step`)."""
    labelled = label_kernels(kernels, num_layers)
    groups: dict[str, list[float]] = {}
    for label, start, end in labelled:
        groups.setdefault(label, []).append(end - start)
    kernel_us = sum(sum(v) for v in groups.values()) / steps
    busy = busy_us(labelled) / steps
    priced = work is not None and roofline is not None
    lines = [f"#### {title}", "",
             f"{len(labelled) / steps:.0f} device activities a step, {kernel_us / 1000:.3f} ms of kernels, "
             f"busy {busy / 1000:.3f} ms of a {step_ms:.3f} ms step: gaps {max(0.0, step_ms - busy / 1000):.3f} ms "
             f"({100 * max(0.0, 1 - busy / 1000 / step_ms):.1f}%)", "",
             "| group | calls a step | ms a step | share of kernel time |"
             + (" floor ms | of peak | bound |" if priced else ""),
             "| --- | ---: | ---: | ---: |" + (" ---: | ---: | --- |" if priced else "")]
    floor_total, losses = 0.0, []
    for label, times in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        ms = sum(times) / steps / 1000
        row = f"| {label} | {len(times) / steps:.0f} | {ms:.3f} | {100 * sum(times) / steps / kernel_us:.1f}% |"
        if priced:
            if label in work:
                floor_us, bound = roofline.floor_us(*work[label])
                floor_total += floor_us / 1000
                losses.append((ms - floor_us / 1000, label))
                share = f"{100 * floor_us / 1000 / ms:.0f}%" if ms > 0 else "-"
                row += f" {floor_us / 1000:.3f} | {share} | {bound} |"
            else:  # sampler, copies, elementwise glue: no floor of their own, all of it a loss
                losses.append((ms, label))
                row += " - | - | - |"
        lines.append(row)
    if priced:
        lines += ["", f"Floor: {floor_total:.3f} ms of kernels at {roofline.bandwidth / 1e9:.0f} GB/s and "
                      f"{roofline.peak / 1e12:.0f} TFLOP/s, {100 * floor_total / step_ms:.0f}% of the step"]
        roofline.rows.append((step or title, step_ms, kernel_us / 1000, floor_total,
                              sorted(losses, reverse=True)[:3]))
    names: dict[str, list[float]] = {}
    for name, start, end in kernels:
        names.setdefault(name, []).append(end - start)
    lines += ["", "| kernel (top 12 by time) | calls a step | us each | ms a step |", "| --- | ---: | ---: | ---: |"]
    for name, times in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:12]:
        lines.append(f"| `{name[:90]}` | {len(times) / steps:.0f} | {statistics.mean(times):.1f} | "
                     f"{sum(times) / steps / 1000:.3f} |")
    return lines + [""]


def gemm_table(runner: ModelRunner, batch: int, bandwidth: float, iters: int) -> list[str]:
    """Each projection of layer 0 and the LM head at M = batch: F.linear against x @ W^T with W^T
    stored once as [in, out], event-timed, bytes of the weight over the time."""
    layer, device = runner.model.layers[0], runner.device
    def out_in(linear):  # the weight as [out, in], whichever layout the layer keeps
        return linear.weight if hasattr(linear, "weight") else linear.weight_t.t()

    mlp = {"gate_up": out_in(layer.mlp.gate_up), "down": out_in(layer.mlp.down)} if hasattr(layer.mlp, "gate_up") else {}
    layers = runner.model.layers
    full = next((getattr(lay, "attn", None) or lay.mixer for lay in layers if not getattr(lay, "linear", False)), None)
    linear = next((lay.mixer for lay in layers if getattr(lay, "linear", False)), None)  # a hybrid's Gated DeltaNet
    mixers = {"qkv": out_in(full.qkv), "o": out_in(full.o)} if full is not None else {}
    if linear is not None:
        mixers.update({"in_proj": out_in(linear.in_proj), "out_proj": out_in(linear.out)})
    weights = {**mixers, **mlp, "lm_head": out_in(runner.model.lm_head)}  # experts: moe_bench.py times them
    lines = [f"#### Projection GEMMs alone, M = {batch}", "",
             "| weight | shape | F.linear us | GB/s | of copy | x @ W^T (stored [in, out]) us | GB/s | of copy |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, w in weights.items():
        x = torch.randn(batch, w.shape[1], dtype=w.dtype, device=device)
        w = w.contiguous()  # [out, in] row-major, as F.linear takes it
        wt = w.t().contiguous()  # [in, out] row-major: the same product, the other memory order
        row = [name, "x".join(map(str, w.shape))]
        for fn in (lambda: F.linear(x, w), lambda: x @ wt):
            fn()
            seconds = timed(device, lambda: [fn() for _ in range(iters)]) / iters
            rate = w.numel() * w.element_size() / seconds
            row += [f"{seconds * 1e6:.1f}", f"{rate / 1e9:.0f}", f"{rate / bandwidth:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def replay_ms(runner: ModelRunner, batch: int, iters: int) -> float | None:
    graphs = runner.graphs
    if graphs is None or not graphs.graphs:
        return None
    return replay_us(graphs.graphs[graphs.bucket(batch)], iters) / 1000


_plan_ids = iter(range(-(1 << 40), 0))


def in_flight_ms(runner: ModelRunner, ids: list[int], steps: int) -> tuple[float, float]:
    """(ms per step, host ms per launch) of `steps` decode steps launched as the engine core
    does: each call launches the next step and returns the previous one's tokens, so host work
    overlaps the device. The launch (`ModelRunner._launch`, the host's part) is timed apart."""
    with LaunchTimer(runner) as launches:
        runner.step(StepPlan(next(_plan_ids), list(ids)))  # fill the pipeline
        sync(runner.device)
        start = time.perf_counter()
        for _ in range(steps):
            runner.step(StepPlan(next(_plan_ids), list(ids)))
        runner.step(StepPlan(next(_plan_ids)))  # empty: drains the step in flight
        sync(runner.device)
        # the device ran `steps` steps in this time (the first one's work ended before it began, the
        # empty drain has none): dividing by steps + 1, as before 2026-11-25, read 1/(steps + 1) low
        per_step = 1000 * (time.perf_counter() - start) / steps
    return per_step, 1000 * statistics.median(launches.seconds[1:])


def host_profile(fn, steps: int, top: int) -> list[str]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    body = [line for line in text.getvalue().splitlines() if line.strip()][-(top + 1):]
    return ["```", *(body or ["(no samples)"]), "```", ""]


def decode_section(runner: ModelRunner, bench: Bench, batch: int, context: int, bandwidth: float,
                   args) -> list[str]:
    cfg, itemsize = runner.config, runner.model.dtype.itemsize
    reqs = bench.new_reqs(batch, context)
    per_chunk = max(1, 16384 // context)
    for start in range(0, batch, per_chunk):
        run_step(runner, prompts=reqs[start: start + per_chunk])
    ids = [r[0] for r in reqs]
    step = lambda: run_step(runner, ids)  # noqa: E731
    times = [timed(runner.device, step) for _ in range(args.warmup + args.iters)][args.warmup:]
    step_ms = 1000 * statistics.median(times)
    # a hybrid model's requests also read and write their recurrent and conv states once a step
    state = 2 * runner.state_pool.slot_bytes() if runner.state_pool is not None else 0
    floor_ms = 1000 * (weight_bytes(cfg, itemsize) + batch * (context * kv_bytes_per_token(cfg, runner.kv_dtype.itemsize)
                                                             + state)) / bandwidth
    replay = replay_ms(runner, batch, args.iters) if runner.device.type == "cuda" else None
    host = [f"Host, {args.host_steps} engine steps one in flight (cProfile, own time):", ""]
    host += host_profile(lambda: runner.step(StepPlan(next(_plan_ids), list(ids))), args.host_steps, args.top)
    runner.step(StepPlan(next(_plan_ids)))  # drain
    in_flight, launch_ms = in_flight_ms(runner, ids, args.iters)
    lines = [f"### Decode, batch {batch}, context {context}", "",
             "| measure | ms | floor ms | floor / measure |", "| --- | ---: | ---: | ---: |",
             f"| engine step, one in flight (the server's loop) | {in_flight:.3f} | {floor_ms:.3f} | "
             f"{floor_ms / in_flight:.2f} |",
             f"| engine step alone (run_step, synchronous) | {step_ms:.3f} | {floor_ms:.3f} | {floor_ms / step_ms:.2f} |",
             f"| host launch of a step (ModelRunner._launch, one in flight) | {launch_ms:.3f} | | |"]
    if replay is not None:
        lines.append(f"| graph replay alone | {replay:.3f} | {floor_ms:.3f} | {floor_ms / replay:.2f} |")
    lines.append("")
    if runner.device.type == "cuda":
        prof = profile_steps(step, args.profile_steps)
        # the rows' context by now: the timed steps, the host's and the in-flight ones decoded a token each
        cached = context + args.warmup + 2 * args.iters + args.host_steps + 2
        work = step_work(cfg, itemsize, runner.kv_dtype.itemsize, [cached] * batch, [])
        lines += kernel_table(device_kernels(prof), args.profile_steps, step_ms,
                              f"Kernels of the engine step (graph replay + sampler), batch {batch}", cfg.num_layers,
                              work, args.roofline, f"decode {batch} x {context}")
    if runner.device.type == "cuda" and runner.graphs is not None:
        graphs, bucket = runner.graphs, runner.graphs.bucket(batch)
        forward = lambda: graphs._forward(bucket, graphs.max_seqlen)  # noqa: E731  eager, same kernels
        with torch.inference_mode():
            forward()
            sync(runner.device)
            eager_ms = 1000 * statistics.median(timed(runner.device, forward) for _ in range(5))
            prof = profile_steps(forward, args.profile_steps)
        lines += kernel_table(device_kernels(prof), args.profile_steps, eager_ms,
                              f"Kernels of the same forward run eagerly (no graph), batch {batch}: "
                              f"{eager_ms:.3f} ms", cfg.num_layers)
    lines += host
    runner.free(ids)
    return lines


class LaunchTimer:
    """Times the host's part of each step (`ModelRunner._launch`) while in use."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.seconds = runner, []

    def __enter__(self):
        launch = self.runner._launch

        def timed_launch(plan, *args):
            start = time.perf_counter()
            try:
                return launch(plan, *args)
            finally:
                self.seconds.append(time.perf_counter() - start)

        self.runner._launch = timed_launch
        return self

    def __exit__(self, *exc):
        del self.runner._launch


def eager_section(runner: ModelRunner, bench: Bench, args) -> list[str]:
    how = "eager" if runner.graphs is None else f"replayed from a CUDA graph up to {runner.graphs.max_tokens} tokens"
    lines = [f"### Steps with prompt chunks ({how})", "",
             "| step | wall ms | host launch ms | device busy ms | busy share |", "| --- | ---: | ---: | ---: | ---: |"]
    # the mixed steps' decodes and their prompts each take a request row: fewer decodes where there are fewer
    count = max(len(args.mixed_decodes), len(args.mixed_chunk), len(args.mixed_prompts))
    def nth(values: list[int], i: int) -> int:  # a list of one applies to every mixed step
        return values[i] if len(values) > 1 else values[0]
    mixes = [(nth(args.mixed_decodes, i), nth(args.mixed_prompts, i), nth(args.mixed_chunk, i)) for i in range(count)]
    rows = runner.req_table.free_count - max(prompts for _, prompts, _ in mixes)
    if max(d for d, _, _ in mixes) > rows:
        logger.info("mixed steps: at most %d decodes: --running-max-req-size leaves %d request rows", rows,
                    runner.req_table.free_count)
    decodes = bench.new_reqs(min(rows, max(d for d, _, _ in mixes)), DECODE_CONTEXT)
    for start in range(0, len(decodes), 32):
        run_step(runner, prompts=decodes[start: start + 32])
    ids = [r[0] for r in decodes]
    shapes = {"prefill 1 x 128": ([], 1, 128)}
    for wanted, num_prompts, chunk in mixes:
        dec = ids[:min(wanted, rows)]
        shapes[f"mixed: {len(dec)} decodes + {num_prompts} x {chunk // num_prompts}"] = (dec, num_prompts,
                                                                                         chunk // num_prompts)
    host, kernels, steps_run = [], [], {i: 0 for i in ids}  # each decode row's tokens decoded here
    cfg = runner.config
    for label, (dec, num_prompts, length) in shapes.items():
        def one(dec=dec, num_prompts=num_prompts, length=length):
            prompts = bench.new_reqs(num_prompts, length)
            run_step(runner, dec, prompts)
            runner.free([p[0] for p in prompts])
            for i in dec:
                steps_run[i] += 1
        for _ in range(args.warmup):
            one()
        with LaunchTimer(runner) as launches:
            wall = 1000 * statistics.median(timed(runner.device, one) for _ in range(args.iters))
        launch_ms = 1000 * statistics.median(launches.seconds)
        busy = None
        if runner.device.type == "cuda":
            contexts = [DECODE_CONTEXT + steps_run[i] + args.profile_steps // 2 for i in dec]
            prof = profile_steps(one, args.profile_steps)
            busy = busy_us(device_kernels(prof)) / args.profile_steps / 1000
            work = step_work(cfg, runner.model.dtype.itemsize, runner.kv_dtype.itemsize, contexts,
                             [(0, length)] * num_prompts)
            kernels += kernel_table(device_kernels(prof), args.profile_steps, wall, f"Kernels of the {label} step",
                                    cfg.num_layers, work, args.roofline, label.removeprefix("mixed: "))
        cells = f"{busy:.3f} | {100 * busy / wall:.0f}%" if busy is not None else "- | -"
        lines.append(f"| {label} | {wall:.3f} | {launch_ms:.3f} | {cells} |")
        host.append((label, one))
    lines.append("")
    lines += kernels
    for label, one in host:
        lines += [f"Host, {args.host_steps} steps of {label} (cProfile, own time):", ""]
        lines += host_profile(one, args.host_steps, args.top)
    runner.free(ids)
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, required=True)
    add("--load-format", default="dummy")
    add("--quantization", choices=("fp8",), default=None, help="the server's --quantization (no GEMM tables: "
        "test/benchmark/kernels/fp8_gemm_bench.py times those)")
    add("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto", help="the server's --kv_cache_dtype")
    add("--mamba-ssm-cache-dtype", default="auto", help="the server's --mamba_ssm_cache_dtype (hybrid models)")
    add("--mxfp4-experts", choices=("auto", "packed", "dequantized"), default="auto",
        help="the server's --mxfp4_experts (gpt-oss)")
    add("--dtype", default="bfloat16")
    add("--device", default=None)
    add("--max-total-token-num", type=int, default=300000, help="KV budget: 256 x 1024 decode context and the eager steps fit, room is left for the GEMM timings")
    add("--max-req-total-len", type=int, default=3072, help="the server's default")
    add("--running-max-req-size", type=int, default=512, help="the server's default (graph buckets)")
    add("--batches", type=int_list, default=[1, 256])
    add("--gemm-m", type=int_list, default=[1, 256, 4096], help="M of the projection GEMMs timed alone")
    add("--context", type=int, default=1024)
    add("--mixed-decodes", type=int_list, default=[64], help="decodes of each mixed step (at 256 cached tokens); "
        "these three lists, zipped, give the mixed steps (a list of one applies to each)")
    add("--mixed-chunk", type=int_list, default=[512], help="each mixed step's prompt tokens")
    add("--mixed-prompts", type=int_list, default=[1], help="the prompts they are cut into (a burst's step holds dozens)")
    add("--peak-tflops", type=float, default=989.0, help="dense peak of the dtype, for the roofline (H100 / H200 SXM bf16)")
    add("--warmup", type=int, default=3)
    add("--iters", type=int, default=20)
    add("--profile-steps", type=int, default=5)
    add("--host-steps", type=int, default=10)
    add("--top", type=int, default=15)
    add("--no-cuda-graph", action="store_true")
    add("--triton-launch", choices=("fast", "triton"), default="fast",
        help="triton: every kernel through Triton's own launch path (lightllm.kernels._triton.FAST_LAUNCH off)")
    add("--no-pdl", action="store_true",
        help="no programmatic dependent launch (lightllm.kernels._triton.USE_PDL off): each kernel waits for the "
             "one ahead to end before it is scheduled")
    add("--split-sum-rows", type=int, default=None,
        help="the most rows whose down projection returns partial sums over K for the next norm to add "
             "(lightllm.models.layers.SPLIT_SUM_ROWS; 0: never)")
    add("--out-md", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.triton_launch == "triton":
        import lightllm.kernels._triton

        lightllm.kernels._triton.FAST_LAUNCH = False
    if args.split_sum_rows is not None:
        from lightllm.models import layers

        layers.SPLIT_SUM_ROWS = args.split_sum_rows
    if args.no_pdl:
        import lightllm.kernels._triton

        lightllm.kernels._triton.USE_PDL = False
    config = EngineConfig(model_dir=str(args.model), max_total_token_num=args.max_total_token_num,
                          max_req_total_len=args.max_req_total_len, running_max_req_size=args.running_max_req_size,
                          data_type=args.dtype, load_format=args.load_format, disable_cuda_graph=args.no_cuda_graph,
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                          mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, mxfp4_experts=args.mxfp4_experts)
    runner = ModelRunner(config, device=args.device, check_budget=False)  # a given budget is taken as given
    bandwidth = copy_bandwidth(runner.device, 1 << 30 if runner.device.type == "cuda" else 1 << 24)
    name = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "CPU"
    lines = [f"## Step profile: {name}, {args.model.name}, {args.dtype}{', fp8 projections' if args.quantization else ''}{', fp8 KV cache' if args.kv_cache_dtype != 'auto' else ''}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
             f"Triton launches: {args.triton_launch}{', no PDL' if args.no_pdl else ''}", ""]
    bench = Bench(runner, seed=0)
    args.roofline = Roofline(bandwidth, args.peak_tflops * 1e12)
    print("\n".join(lines), flush=True)
    for section in [lambda b=b: decode_section(runner, bench, b, args.context, bandwidth, args) for b in args.batches] + [
            lambda: eager_section(runner, bench, args)] + [
            lambda m=m: gemm_table(runner, m, bandwidth, args.iters) for m in args.gemm_m
            if runner.device.type == "cuda" and not args.quantization]:
        part = section()
        print("\n".join(part), flush=True)  # each section as soon as it is measured
        lines += part
        if args.out_md:
            args.out_md.write_text("\n".join(lines) + "\n")
    if args.roofline.rows:
        part = roofline_table(args.roofline)
        print("\n".join(part), flush=True)
        lines += part
        if args.out_md:
            args.out_md.write_text("\n".join(lines) + "\n")
    return 0


def roofline_table(roofline: Roofline) -> list[str]:
    """Every tabled step against its floor, with the groups that lose the most time over theirs."""
    lines = [f"### Roofline ({roofline.bandwidth / 1e9:.0f} GB/s copy, {roofline.peak / 1e12:.0f} TFLOP/s)", "",
             "| step | step ms | kernels ms | floor ms | floor / step | largest losses (ms over the floor) |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for step, step_ms, kernel_ms, floor_ms, losses in roofline.rows:
        worst = ", ".join(f"{label} {loss:.3f}" for loss, label in losses)
        lines.append(f"| {step} | {step_ms:.3f} | {kernel_ms:.3f} | {floor_ms:.3f} | {floor_ms / step_ms:.2f} | {worst} |")
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
