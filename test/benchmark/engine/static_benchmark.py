"""Static (serverless) benchmark of the engine: prefill and decode step times of ModelRunner.

    python test/benchmark/engine/static_benchmark.py --model DIR --load-format dummy \\
        --decode-batch 1,8,64,256 --decode-context 128,1024,4096 --out-json static.json

Prefill: time of one `prefill` call for each (batch, prompt length). Decode: median time of
one `decode` step of `batch` requests whose context is `context` tokens. Every timing is
taken between two device synchronisations. A decode step must at least read every weight
and the batch's whole KV cache once; `floor_ms` is that many bytes over the measured
device-to-device copy bandwidth, and `floor_fraction` = floor_ms / step_ms (1.0 would be a
step that does nothing but stream memory at copy speed). Grid points whose KV cache does not
fit in the token budget are skipped and listed.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from lightllm.engine.request import SamplingParams
from lightllm.engine.config import EngineConfig
from lightllm.engine.model_runner import ModelRunner
from benchmark.lib.direct_step import run_step

logger = logging.getLogger("static_benchmark")

PREFILL_CHUNK_TOKENS = 16384  # decode set-up prefills in chunks this big: bounded activations


@dataclass
class Point:
    phase: str  # "prefill" or "decode"
    batch: int
    context: int  # prompt length (prefill) or tokens already cached (decode)
    ms: float
    tokens_per_s: float
    floor_ms: float | None = None
    floor_fraction: float | None = None


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    """Seconds `fn` takes, between two device synchronisations."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def replay_us(graph, replays: int) -> float:
    """Mean microseconds of one replay of a captured CUDA graph, timed with CUDA events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / replays


def capture(fn, calls: int = 1):
    """(a CUDA graph of `calls` calls of fn(), the last call's static output). The first call runs
    outside the capture, on a side stream: compiles, NCCL's communicator."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_call_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Mean microseconds of one call of `fn` within a CUDA graph of `calls` (as a decode step's
    kernels run)."""
    return replay_us(capture(fn, calls)[0], replays) / calls


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = timed(device, lambda: [dst.copy_(src) for _ in range(iters)])
    return 2 * nbytes * iters / seconds


def projection_params(cfg) -> int:
    """Parameters of every layer's projections (`cfg`: a lightllm ModelConfig): q/k/v and o, or a
    hybrid model's Gated DeltaNet in/out projections on its linear layers and the gated attention's
    doubled q (its output gate) on the others, then gate/up and down; a token's projections cost two
    FLOPs each. Dense MLPs only: an MoE's experts are timed by kernels/moe_bench.py."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    lin = getattr(cfg, "linear_attn", None)
    gated = 2 if lin else 1
    attention = cfg.hidden_size * (gated * q_out + 2 * kv_out) + q_out * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    if not lin:
        return cfg.num_layers * (attention + mlp)
    kd, vd = lin.num_k_heads * lin.k_head_dim, lin.num_v_heads * lin.v_head_dim
    linear = cfg.hidden_size * (2 * kd + 2 * vd + 2 * lin.num_v_heads) + vd * cfg.hidden_size
    return len(lin.layers) * linear + (cfg.num_layers - len(lin.layers)) * attention + cfg.num_layers * mlp


def weight_bytes(cfg, itemsize: int) -> int:
    """Bytes of weights a decode step reads: all but the embedding table (one row per token),
    which the LM head reads in full when it is tied. `cfg` is a lightllm ModelConfig; with
    `quantization` fp8 the projections take one byte a parameter."""
    projection_itemsize = 1 if getattr(cfg, "quantization", None) == "fp8" else itemsize
    rest = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    return projection_params(cfg) * projection_itemsize + rest * itemsize


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    """K and V of a token over the layers that keep them (a hybrid model's attention layers only)."""
    return 2 * cfg.num_kv_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


class Bench:
    def __init__(self, runner: ModelRunner, seed: int):
        self.runner = runner
        self.device = runner.device
        self.generator = torch.Generator().manual_seed(seed)
        self.next_id = 0

    def new_reqs(self, batch: int, length: int) -> list[tuple[int, list[int], SamplingParams]]:
        vocab = self.runner.config.vocab_size
        reqs = []
        for _ in range(batch):
            prompt = torch.randint(vocab, (length,), generator=self.generator).tolist()
            reqs.append((self.next_id, prompt, SamplingParams(max_new_tokens=1 << 20)))
            self.next_id += 1
        return reqs

    def prefill_ms(self, batch: int, length: int, warmup: int, iters: int) -> float:
        times = []
        for i in range(warmup + iters):
            reqs = self.new_reqs(batch, length)
            seconds = timed(self.device, lambda: run_step(self.runner, prompts=reqs))
            self.runner.free([r[0] for r in reqs])
            if i >= warmup:
                times.append(seconds)
        return 1000 * statistics.median(times)

    def decode_ms(self, batch: int, context: int, warmup: int, iters: int) -> float:
        reqs = self.new_reqs(batch, context)
        per_chunk = max(1, PREFILL_CHUNK_TOKENS // context)
        for start in range(0, batch, per_chunk):
            run_step(self.runner, prompts=reqs[start : start + per_chunk])
        ids = [r[0] for r in reqs]
        times = [timed(self.device, lambda: run_step(self.runner, ids)) for _ in range(warmup + iters)]
        self.runner.free(ids)
        return 1000 * statistics.median(times[warmup:])


def run_grid(bench: Bench, args, bandwidth: float) -> tuple[list[Point], list[str]]:
    points, skipped = [], []
    budget = bench.runner.max_total_token_num
    cfg, itemsize = bench.runner.config, bench.runner.model.dtype.itemsize
    weights, per_token = weight_bytes(cfg, itemsize), kv_bytes_per_token(cfg, bench.runner.kv_dtype.itemsize)
    prefill_grid = [(b, n) for b in args.prefill_batch for n in args.prefill_len]
    decode_grid = [(b, c) for b in args.decode_batch for c in args.decode_context]
    with tqdm(total=len(prefill_grid) + len(decode_grid), desc="grid points") as bar:
        for batch, length in prefill_grid:
            if batch * length > budget:
                skipped.append(f"prefill batch {batch} x {length}: {batch * length} tokens > budget {budget}")
            else:
                ms = bench.prefill_ms(batch, length, args.warmup, args.iters)
                points.append(Point("prefill", batch, length, ms, batch * length / ms * 1000))
            bar.update(1)
        for batch, context in decode_grid:
            needed = batch * (context + args.warmup + args.iters)
            if needed > budget or batch > bench.runner.req_table.free_count:
                skipped.append(f"decode batch {batch} x context {context}: {needed} tokens > budget {budget}")
            else:
                ms = bench.decode_ms(batch, context, args.warmup, args.iters)
                floor = 1000 * (weights + batch * context * per_token) / bandwidth
                points.append(Point("decode", batch, context, ms, batch / ms * 1000, floor, floor / ms))
            bar.update(1)
    return points, skipped


def format_table(points: list[Point]) -> str:
    rows = ["| phase | batch | context | ms | tokens/s | floor ms | floor fraction |", "|" + " --- |" * 7]
    for p in points:
        floor = f"{p.floor_ms:.3f} | {p.floor_fraction:.2f}" if p.floor_ms is not None else "- | -"
        rows.append(f"| {p.phase} | {p.batch} | {p.context} | {p.ms:.3f} | {p.tokens_per_s:.1f} | {floor} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, required=True, help="model directory (e.g. from lightllm.tools.bench_model)")
    add("--load-format", default="dummy", help="dummy: random weights; auto: the checkpoint's")
    add("--dtype", default="bfloat16", help="weight and activation dtype")
    add("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when there is one)")
    add("--max-total-token-num", type=int, default=None, help="KV budget (default: the runner sizes it)")
    add("--prefill-batch", type=int_list, default=[1, 8], help="comma-separated batch sizes")
    add("--prefill-len", type=int_list, default=[128, 512, 2048], help="comma-separated prompt lengths")
    add("--decode-batch", type=int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    add("--decode-context", type=int_list, default=[128, 512, 1024, 2048, 4096])
    add("--warmup", type=int, default=3, help="untimed repetitions before each measurement")
    add("--iters", type=int, default=10, help="timed repetitions; the median is reported")
    add("--bandwidth-bytes", type=int, default=1 << 30, help="buffer size of the copy-bandwidth probe")
    add("--no-cuda-graph", action="store_true", help="decode eagerly at the batch's own size (no CUDA graphs)")
    add("--seed", type=int, default=0)
    add("--out-json", type=Path, default=None)
    return parser


def make_runner(args) -> ModelRunner:
    longest = max(args.decode_context + args.prefill_len) + args.warmup + args.iters + 1
    config = EngineConfig(
        model_dir=str(args.model),
        max_total_token_num=args.max_total_token_num,
        max_req_total_len=longest,
        running_max_req_size=max(args.decode_batch + args.prefill_batch),
        data_type=args.dtype,
        load_format=args.load_format,
        disable_cuda_graph=args.no_cuda_graph,
    )
    return ModelRunner(config, device=args.device, check_budget=False)  # a given budget is taken as given


def write_json(path: Path, args, runner: ModelRunner, bandwidth: float, points, skipped) -> None:
    cfg, itemsize = runner.config, runner.model.dtype.itemsize
    info = {
        "model": str(args.model),
        "device": str(runner.device),
        "dtype": args.dtype,
        "max_total_token_num": runner.max_total_token_num,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "weight_bytes": weight_bytes(cfg, itemsize),
        "kv_bytes_per_token": kv_bytes_per_token(cfg, runner.kv_dtype.itemsize),
    }
    path.write_text(json.dumps({**info, "points": [asdict(p) for p in points], "skipped": skipped}, indent=2))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    runner = make_runner(args)
    bandwidth = copy_bandwidth(runner.device, args.bandwidth_bytes)
    logger.info("device-to-device copy bandwidth: %.1f GB/s", bandwidth / 1e9)
    points, skipped = run_grid(Bench(runner, args.seed), args, bandwidth)
    print(format_table(points), flush=True)
    for reason in skipped:
        logger.warning("skipped %s", reason)
    if args.out_json:
        write_json(args.out_json, args, runner, bandwidth, points, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
