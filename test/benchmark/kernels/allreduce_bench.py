"""The tensor-parallel all-reduce against NCCL: time per call by message size, eagerly and inside
CUDA graphs, with every path's sums checked against NCCL's; and, with --profile-model, where one
decode step's time goes at tp N (compute, all-reduce, gaps), with symmetric memory and without.

    python test/benchmark/kernels/allreduce_bench.py --world-size 2                    # sizes 1 KiB .. 64 MiB
    python test/benchmark/kernels/allreduce_bench.py --world-size 2 --sizes '' --profile-model .gpu/bench-8b
    python test/benchmark/kernels/allreduce_bench.py --device cpu --world-size 2 --sizes 1024,65536

One process per rank (torch.multiprocessing spawn, no torchrun), joined through init_tp as the
server's model workers are. Sizes are message bytes (K and M suffixes: KiB, MiB) of --dtype. The
size table's columns, in us per call (the slowest rank's): NCCL (gloo on the CPU); one-shot and
two-shot through a symmetric buffer as large as the largest size, whatever the server's cap;
"chosen", what TPGroup.all_reduce does in the server (its path in brackets); each eagerly (a
loop of calls between two events) and inside a CUDA graph (--graph-calls calls captured once,
replayed --graph-replays times). "sums" says whether every path's result equals NCCL's:
bitwise for 2 ranks (a + b in either order), within the dtype's rounding beyond. Exit status 1
when one does not.

The profile (CUDA; the CPU runs its plumbing): for each of --profile-modes (tp1: one GPU;
nccl: every message through NCCL, LIGHTLLM_SYMM_MEM_ALL_REDUCE=0; unfused: symmetric memory,
the all-reduce and the RMSNorm after it apart, LIGHTLLM_FUSED_ALL_REDUCE_NORM=0; symmetric: the
server's choice) the ranks load the model (dummy weights), prefill --batches requests of --context
tokens and time synchronous decode steps (run_step: upload, graph replay, sampling); rank 0 then
profiles --profile-steps of them. Per step: device busy time, split into all-reduce kernels,
all-gather (the LM head's logits) and the rest (compute, copies into the symmetric buffer
included), and gaps (the step's wall time in which no kernel runs).

torch's profiler runs at tp 1, and at tp N with --kernel-profile. The tp 2 profile "hung" in
five calls of 2026-11-26/27; the stacks (--stacks-after) showed every rank done measuring and
waiting in destroy_process_group, which CUDA ranks now skip. Whether the profiler itself runs
at tp 2 is not yet seen. At tp N the all-reduce's share is also timed by subtraction, from
events alone: the batch's decode graph is captured once more with TPGroup.all_reduce an
identity (wrong sums, the same kernels otherwise; where the all-reduce is fused with the
residual add and RMSNorm, kernels/allreduce_norm.py, the norm alone) and replayed; the
all-reduce's time, its copies and the wait for the other rank included, is the served graph's
replay less that one's.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.engine.static_benchmark import graph_call_us  # noqa: E402

from lightllm.utils.allreduce import FUSED_ENV, SYMMETRIC_ENV, AllReducePath, SymmetricAllReduce  # noqa: E402
from lightllm.utils.dist import TPGroup, init_tp  # noqa: E402
from lightllm.utils.net import free_port  # noqa: E402

logger = logging.getLogger("allreduce_bench")

DEFAULT_SIZES = ",".join(f"{1 << k}K" if k < 10 else f"{1 << (k - 10)}M" for k in range(17))  # 1K .. 64M
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_sizes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20}
    return [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in text.upper().split(",") if s]


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


# ---- time per call by size ----


def methods(group: TPGroup, bench: SymmetricAllReduce | None) -> dict:
    """name -> fn(x) returning the sum (each may write into x)."""
    def collective(x):
        dist.all_reduce(x)
        return x

    out = {"collective": collective}
    if bench is not None:
        out.update({"one-shot": bench.one_shot, "two-shot": bench.two_shot})
    out["chosen"] = group.all_reduce
    return out


def eager_us(fn, x: torch.Tensor, iters: int) -> float:
    work = x.clone()
    for _ in range(3):
        fn(work)
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(work)
        end.record()
        end.synchronize()
        return 1000 * start.elapsed_time(end) / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn(work)
    return 1e6 * (time.perf_counter() - begin) / iters


def graph_us(fn, x: torch.Tensor, calls: int, replays: int) -> float:
    """Per call, `calls` calls captured in one graph (values are not checked here: they grow)."""
    work = x.clone()
    return graph_call_us(lambda: fn(work), calls, replays)


def same_sum(got: torch.Tensor, reference: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """NCCL's sum bitwise for two ranks (a + b in either order). Beyond, the summation orders
    differ; each sum must then lie within the rounding bound of any order: n u sum |x_r|."""
    if len(inputs) == 2:
        return torch.equal(got, reference)
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(got.dtype, 2.0 ** -24)
    return bool(((got.double() - exact).abs() <= len(inputs) * u * magnitude + 1e-30).all())


def size_row(group: TPGroup, bench, nbytes: int, args, device: torch.device) -> dict:
    dtype, world = DTYPES[args.dtype], group.world_size
    gen = torch.Generator().manual_seed(1000 * args.seed + group.rank)
    x = torch.randn(nbytes // dtype.itemsize, generator=gen).to(dtype).to(device)
    reference, inputs = x.clone(), [torch.empty_like(x) for _ in range(world)]
    dist.all_reduce(reference)
    dist.all_gather(inputs, x)
    path = AllReducePath.COLLECTIVE if group.symmetric is None else group.symmetric.path(x)
    row = {"bytes": nbytes, "path": path.value, "sums": True}
    for name, fn in methods(group, bench).items():
        if name in ("one-shot", "two-shot") and nbytes > bench.capacity:
            continue
        row["sums"] &= same_sum(fn(x.clone()), reference, inputs)
        row[f"{name} eager"] = eager_us(fn, x, args.iters)
        if device.type == "cuda":
            row[f"{name} graph"] = graph_us(fn, x, args.graph_calls, args.graph_replays)
    return row


def slowest_rank(row: dict, device: torch.device) -> dict:
    """Times: the largest over the ranks; sums: whether they held on every rank."""
    keys = [k for k in row if k.endswith(("eager", "graph"))]
    values = torch.tensor([row[k] for k in keys] + [-float(row["sums"])], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {**row, **dict(zip(keys, values[:-1].tolist())), "sums": values[-1].item() < 0}


def worker_logging(rank: int, args) -> None:
    """A spawned rank's logging (INFO, to stderr, as the parent's), and with --stacks-after S every
    thread's stack to stderr S seconds in: where a rank waits when a run hangs."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    if args.stacks_after:
        faulthandler.dump_traceback_later(args.stacks_after)


def sizes_worker(rank: int, args, port: int, results) -> None:
    worker_logging(rank, args)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    group = init_tp(rank, args.world_size, port, device)
    bench = None
    if group.symmetric is not None:
        capacity = -(-max(args.sizes) // 16) * 16
        bench = group.symmetric if capacity <= group.symmetric.capacity else \
            SymmetricAllReduce.create(device, args.world_size, capacity)
    for nbytes in args.sizes:
        row = slowest_rank(size_row(group, bench, nbytes, args, device), device)
        if rank == 0:
            results.append(row)
            logger.info("%s: %s", human(nbytes), row)
    dist.destroy_process_group()


def sizes_table(rows: list[dict], args) -> list[str]:
    names = ["collective", "one-shot", "two-shot", "chosen"]
    kinds = ["eager", "graph"] if args.device == "cuda" else ["eager"]
    collective = "NCCL" if args.device == "cuda" else "gloo"
    heads = [f"{collective if n == 'collective' else n} {k} us" for k in kinds for n in names]
    agree = (f"equal to {collective}'s, bitwise" if args.world_size == 2 else
             f"within n u sum|x| of the exact sum, as {collective}'s (summation orders differ)")
    lines = [f"### All-reduce, {args.world_size} ranks, {args.dtype}: us per call (slowest rank)", "",
             f"sums: every path's result {agree}.", "",
             "| message | " + " | ".join(heads) + f" | chosen path | chosen / {collective} ({kinds[-1]}) | sums |",
             "| --- |" + " ---: |" * len(heads) + " --- | ---: | --- |"]
    for row in rows:
        cells = [f"{row[f'{n} {k}']:.1f}" if f"{n} {k}" in row else "-" for k in kinds for n in names]
        kind = kinds[-1]
        ratio = f"{row[f'chosen {kind}'] / row[f'collective {kind}']:.2f}"
        sums = "ok" if row["sums"] else "**DIFFERENT**"
        lines.append(f"| {human(row['bytes'])} | " + " | ".join(cells) + f" | {row['path']} | {ratio} | {sums} |")
    return lines + [""]


# ---- the all-reduce and the add + RMSNorm after it: fused against apart, by size ----


def norm_row(group: TPGroup, fused: dict, nbytes: int, args, device: torch.device) -> dict:
    """One message of `nbytes` as rows of --hidden: the server's unfused way (TPGroup.all_reduce
    by its path, then add_rms_norm) against the fused kernel with each --fused-programs, in
    CUDA graphs; "same" whether every fused result equals the unfused one (the residual bitwise
    at two ranks, the norm within a rounding)."""
    from lightllm.kernels.rms_norm import add_rms_norm_triton

    dtype, hidden = DTYPES[args.dtype], args.hidden
    rows = nbytes // (hidden * dtype.itemsize)
    gen = torch.Generator().manual_seed(1000 * args.seed + group.rank + 7)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    shared = torch.Generator().manual_seed(args.seed)  # residual and weight: the same on every rank
    residual = torch.randn(rows, hidden, generator=shared).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=shared)).to(dtype).to(device)

    def unfused(x, residual):
        return add_rms_norm_triton(group.all_reduce(x.clone()), residual, weight, 1e-5), residual

    y_ref, residual_ref = unfused(x, residual.clone())
    path = AllReducePath.COLLECTIVE if group.symmetric is None else group.symmetric.path(x)
    row = {"bytes": nbytes, "rows": rows, "path": path.value, "same": True}
    work = residual.clone()
    row["apart graph"] = graph_us(lambda x: unfused(x, work), x, args.graph_calls, args.graph_replays)
    for programs, symmetric in fused.items():
        got = symmetric.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
        if got is None:
            continue
        y, res = got
        row["same"] &= torch.equal(res, residual_ref) and torch.allclose(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
        work = residual.clone()
        row[f"fused {programs} graph"] = graph_us(lambda x: symmetric.add_rms_norm(x, work, weight, 1e-5), x,
                                                 args.graph_calls, args.graph_replays)
    return row


def norm_worker(rank: int, args, port: int, results) -> None:
    worker_logging(rank, args)
    device = torch.device("cuda", rank)
    group = init_tp(rank, args.world_size, port, device)
    sizes = [n for n in args.norm_sizes if n % (args.hidden * DTYPES[args.dtype].itemsize) == 0]
    fused = {p: SymmetricAllReduce.create(device, args.world_size, 16, fused_bytes=max(sizes), programs=p)
             for p in args.fused_programs}
    for nbytes in sizes:
        row = norm_row(group, fused, nbytes, args, device)
        keys = [k for k in row if k.endswith("graph")]
        values = torch.tensor([row[k] for k in keys] + [-float(row["same"])], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        row = {**row, **dict(zip(keys, values[:-1].tolist())), "same": values[-1].item() < 0}
        if rank == 0:
            results.append(row)
            logger.info("%s: %s", human(nbytes), row)
    dist.destroy_process_group()


def norm_table(rows: list[dict], args) -> list[str]:
    fused = [f"fused {p} graph" for p in args.fused_programs]
    lines = [f"### All-reduce + residual add + RMSNorm, {args.world_size} ranks, {args.dtype}, rows of {args.hidden}: "
             "us per call in CUDA graphs (slowest rank)", "",
             "apart: the server's all-reduce by its path, then add_rms_norm; fused P: kernels/allreduce_norm.py with "
             "at most P programs. same: every fused result equals apart's (residual bitwise, norm within 2e-2).", "",
             "| message | rows | all-reduce path | apart us | " + " | ".join(f"fused, {p} programs us" for p in
                                                                     args.fused_programs)
             + " | best fused / apart | same |",
             "| --- | ---: | --- | ---: |" + " ---: |" * len(fused) + " ---: | --- |"]
    for row in rows:
        cells = [f"{row[k]:.1f}" if k in row else "-" for k in fused]
        best = min((row[k] for k in fused if k in row), default=float("nan"))
        lines.append(f"| {human(row['bytes'])} | {row['rows']} | {row['path']} | {row['apart graph']:.1f} | "
                     + " | ".join(cells) + f" | {best / row['apart graph']:.2f} | "
                     + ("ok" if row["same"] else "**DIFFERENT**") + " |")
    return lines + [""]


# ---- one decode step at tp N ----


def comm_kind(name: str) -> str | None:
    flat = name.lower().replace("_", "")
    return "all-reduce" if "allreduce" in flat else "all-gather" if "allgather" in flat else None


def step_breakdown(kernels: list, steps: int, step_ms: float) -> dict:
    from benchmark.engine.profile_step import busy_us

    comm = {"all-reduce": [], "all-gather": []}
    compute = []
    for kernel in kernels:
        kind = comm_kind(kernel[0])
        (comm[kind] if kind else compute).append(kernel)
    if not kernels:  # the CPU: no device timeline
        return {**dict.fromkeys(("busy", "compute", "all-reduce", "all-reduce calls", "all-gather", "gaps")),
                "groups": {}}
    busy = busy_us(kernels) / steps
    return {"busy": busy, "compute": busy_us(compute) / steps, "all-reduce": busy_us(comm["all-reduce"]) / steps,
            "all-reduce calls": len(comm["all-reduce"]) / steps, "all-gather": busy_us(comm["all-gather"]) / steps,
            "gaps": max(0.0, 1000 * step_ms - busy), "groups": kernel_groups(compute, comm, steps)}


def kernel_groups(compute: list, comm: dict, steps: int) -> dict[str, float]:
    """us a step by kernel group (profile_step's: each projection GEMM by its role, attention,
    norms, ...), the collectives apart so that they do not hide a GEMM's neighbours."""
    from benchmark.engine.profile_step import label_kernels

    groups: dict[str, float] = {}
    for label, start, end in label_kernels(compute, 0) + [(k, s, e) for k, ks in comm.items() for _, s, e in ks]:
        groups[label] = groups.get(label, 0.0) + (end - start) / steps
    return groups


def replay_without_all_reduce_ms(runner, batch: int, iters: int) -> float:
    """ms per replay of the decode graph of `batch`'s bucket captured with every all-reduce an
    identity (its sums wrong; every other kernel, the LM head's all-gather included, as served;
    a fused all-reduce + add + RMSNorm becomes the add + RMSNorm kernel)."""
    from benchmark.engine.static_benchmark import replay_us

    graphs = runner.graphs
    bucket = graphs.bucket(batch)
    forward = lambda: graphs._forward(bucket, graphs.max_seqlen)  # noqa: E731  (the meta of the last step)
    served, fused = TPGroup.all_reduce, TPGroup.reduce_add_rms_norm
    TPGroup.all_reduce = lambda self, x: x
    TPGroup.reduce_add_rms_norm = lambda self, *args: None  # the norms then run alone, as unfused
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            graphs.logits[:bucket].copy_(forward())
        torch.cuda.current_stream().wait_stream(stream)
    finally:
        TPGroup.all_reduce, TPGroup.reduce_add_rms_norm = served, fused
    return replay_us(graph, iters) / 1000


def profile_worker(rank: int, args, mode: str, world_size: int, port: int, results) -> None:
    from benchmark.engine.profile_step import device_kernels, profile_steps, replay_ms
    from benchmark.engine.static_benchmark import Bench, sync, timed

    from lightllm.engine.config import EngineConfig
    from lightllm.engine.model_runner import ModelRunner
    from benchmark.lib.direct_step import run_step

    worker_logging(rank, args)
    os.environ[SYMMETRIC_ENV] = "0" if mode == "nccl" else "1"  # read by init_tp's set-up
    os.environ[FUSED_ENV] = "0" if mode == "unfused" else "1"
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    longest = max(args.batches) * (args.context + args.iters + args.profile_steps + 16)
    config = EngineConfig(model_dir=str(args.profile_model), max_total_token_num=longest,
                          max_req_total_len=args.context + 1024, running_max_req_size=max(args.batches),
                          data_type=args.profile_dtype, load_format="dummy", tp=world_size, nccl_port=port)
    runner = ModelRunner(config, rank, device=device, check_budget=False)
    logger.info("rank %d (%s): runner ready", rank, mode)
    bench = Bench(runner, seed=0)  # the same requests on every rank
    # Only rank 0 profiles; its profiler starts and stops while no rank has a step on its device
    # (the ranks meet on the CPU, gloo), so no rank's collective waits on a profiler's start.
    cpu_group = dist.new_group(backend="gloo") if world_size > 1 else None

    def meet() -> None:
        sync(runner.device)
        if cpu_group is not None:
            dist.barrier(group=cpu_group)
    for batch in args.batches:
        reqs = bench.new_reqs(batch, args.context)
        per_chunk = max(1, 16384 // args.context)
        for start in range(0, batch, per_chunk):
            run_step(runner, prompts=reqs[start: start + per_chunk])
        ids = [r[0] for r in reqs]
        logger.info("rank %d (%s): batch %d prefilled", rank, mode, batch)
        step = lambda: run_step(runner, ids)  # noqa: E731
        step_ms = 1000 * statistics.median(timed(runner.device, step) for _ in range(args.iters))
        logger.info("rank %d (%s): batch %d steps timed", rank, mode, batch)
        cuda = runner.device.type == "cuda"
        replay = replay_ms(runner, batch, args.iters) if cuda else None
        bare = replay_without_all_reduce_ms(runner, batch, args.iters) if cuda and world_size > 1 else None
        logger.info("rank %d (%s): batch %d graphs timed", rank, mode, batch)
        kernels = []
        if world_size == 1 or args.kernel_profile:
            meet()  # every device idle
            if rank == 0:
                kernels = device_kernels(profile_steps(step, args.profile_steps, started=meet))
            else:
                meet()  # rank 0's profiler is on
                for _ in range(args.profile_steps):
                    step()
            meet()  # and off again
        if rank == 0:
            row = {"mode": mode, "batch": batch, "step ms": step_ms, "replay ms": replay, "bare ms": bare,
                   "reduce calls": 2 * runner.model.config.num_layers if world_size > 1 else 0}
            results.append({**row, **step_breakdown(kernels, args.profile_steps, step_ms)})
        runner.free(ids)
    if world_size > 1 and runner.device.type == "cuda":
        # The rows are in; the rank ends here. destroy_process_group never returned on two H100s
        # with the runner's captured NCCL kernels alive: every "profile hang" of 2026-11-26/27 was
        # this, after the table was measured (--stacks-after's stacks, 2026-11-27).
        meet()
        logging.shutdown()
        os._exit(0)
    if world_size > 1:
        dist.destroy_process_group()


def profile_table(rows: list[dict], args) -> list[str]:
    lines = [f"### One decode step of {Path(args.profile_model).name}, context {args.context}: where the time goes",
             "", "Kernel columns from torch's profiler (tp 1; '-' where it did not run); the last two by "
             "subtraction: the decode graph's replay less its replay with every all-reduce an identity, "
             "in all and per call.", "",
             "| all-reduce | batch | engine step ms | graph replay ms | device busy us | compute us "
             "| all-reduce us (calls) | all-gather us | gaps us | replay without all-reduce ms "
             "| all-reduce by subtraction us (per call) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    def cell(value, spec=".0f"):
        return "-" if value is None else format(value, spec)

    def subtracted(r) -> str:
        if r["bare ms"] is None or r["replay ms"] is None:
            return "-"
        us = 1000 * (r["replay ms"] - r["bare ms"])
        return f"{us:.0f} ({us / r['reduce calls']:.1f})"

    for r in rows:
        lines.append(f"| {r['mode']} | {r['batch']} | {r['step ms']:.3f} | {cell(r['replay ms'], '.3f')} | "
                     f"{cell(r['busy'])} | {cell(r['compute'])} | {cell(r['all-reduce'])} "
                     f"({cell(r['all-reduce calls'])}) | {cell(r['all-gather'])} | {cell(r['gaps'])} | "
                     f"{cell(r['bare ms'], '.3f')} | {subtracted(r)} |")
    return lines + [""] + group_table(rows)


def group_table(rows: list[dict]) -> list[str]:
    """Kernel time a step by group, one column per profiled mode and batch: which parts of the
    step shrink with the ranks and which do not."""
    rows = [r for r in rows if r["groups"]]
    if not rows:
        return []
    names = sorted({g for r in rows for g in r["groups"]}, key=lambda g: -max(r["groups"].get(g, 0) for r in rows))
    lines = ["Kernel time a step by group (us, torch's profiler, summed over each group's kernels):", "",
             "| group | " + " | ".join(f"{r['mode']} b{r['batch']}" for r in rows) + " |",
             "| --- |" + " ---: |" * len(rows)]
    for name in names + ["all kernels"]:
        cells = [sum(r["groups"].values()) if name == "all kernels" else r["groups"].get(name, 0.0) for r in rows]
        lines.append(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return lines + [""]


# ---- main ----


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    add("--world-size", type=int, default=2)
    add("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES), help="message bytes ('': none)")
    add("--dtype", choices=sorted(DTYPES), default="bfloat16")
    add("--iters", type=int, default=50, help="eager calls timed per size; decode steps timed per batch")
    add("--graph-calls", type=int, default=10)
    add("--graph-replays", type=int, default=20)
    add("--seed", type=int, default=0)
    add("--norm-sizes", type=parse_sizes, default=parse_sizes(""),
        help="message bytes for the fused all-reduce + add + RMSNorm against the two apart (CUDA; '': none)")
    add("--hidden", type=int, default=4096, help="the rows' width for --norm-sizes")
    add("--fused-programs", type=lambda s: [int(p) for p in s.split(",")], default=[128])
    add("--profile-model", type=Path, default=None, help="model directory (dummy weights) for the decode profile")
    add("--profile-modes", default="tp1,nccl,unfused,symmetric")
    add("--profile-dtype", default="bfloat16")
    add("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64, 256])
    add("--context", type=int, default=1024)
    add("--profile-steps", type=int, default=5)
    add("--stacks-after", type=float, default=0, help="seconds: each rank then prints its threads' stacks (0: never)")
    add("--kernel-profile", action="store_true", help="torch's profiler at tp > 1 too (not yet seen to run there: see above)")
    add("--out-md", type=Path, default=None, help="also write the tables here")
    return parser


def spawn(fn, nprocs: int, *args) -> list:
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(fn, args=(*args, free_port(), results), nprocs=nprocs, join=True)
        return list(results)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; {torch.cuda.device_count()} here")
    lines, ok = [], True
    if args.sizes:
        rows = spawn(sizes_worker, args.world_size, args)
        ok = all(row["sums"] for row in rows)
        lines += sizes_table(rows, args)
    if args.norm_sizes and args.device != "cuda":
        raise SystemExit("--norm-sizes needs CUDA (the fused kernel's symmetric memory)")
    if args.norm_sizes:
        rows = spawn(norm_worker, args.world_size, args)
        ok &= all(row["same"] for row in rows)
        lines += norm_table(rows, args)
    if args.profile_model is not None:
        rows = []
        for mode in args.profile_modes.split(","):
            world = 1 if mode == "tp1" else args.world_size
            rows += spawn(profile_worker, world, args, mode, world)
        lines += profile_table(rows, args)
    text = "\n".join(lines)
    if args.out_md:
        args.out_md.write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
