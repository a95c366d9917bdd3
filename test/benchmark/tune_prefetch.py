"""How many bytes of each projection's weight to pull into L2 ahead of its GEMM in a small decode
step (lightllm.models.layers.WeightPrefetch, kernels/l2_prefetch.py), measured on the real model.

    python test/benchmark/tune_prefetch.py --model DIR --batches 1,4,8,16 \\
        --plans none "o=16" "o=16,gate_up=8,down=8,qkv=8" --reps 2

For each batch (`--context` tokens cached per request) the decode step's graph is captured once
per plan (MB fetched ahead of each projection, by name: qkv, o, gate_up, down, lm_head; `normal`
in a plan picks WeightPrefetch's policy) and replayed `--iters` times, timed with CUDA
events; the plans are alternated `--reps` times. "chunk=" and "per=" in a plan set the prefetch
kernel's layout (kernels/l2_prefetch.py). Each plan's logits must equal the plan-less
graph's bit for bit (a prefetch changes no value). Prints one markdown table. CUDA only.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_benchmark import Bench, int_list, replay_us  # noqa: E402

from lightllm.engine import cuda_graph  # noqa: E402
from lightllm.engine.model_runner import ModelRunner, run_step  # noqa: E402
from lightllm.models import WeightPrefetch  # noqa: E402
from lightllm_kernels import l2_prefetch  # noqa: E402

DEFAULT_LAYOUT = (l2_prefetch.CHUNK, l2_prefetch.PER_PROGRAM)
logger = logging.getLogger("tune_prefetch")
MB = 1 << 20


def parse_plan(text: str) -> WeightPrefetch | None:
    """"none", or "name=MB,..." with an optional policy ("normal"; "last" by default) and the
    kernel's layout ("chunk=bytes", "per=instructions a program", kernels/l2_prefetch.py), which
    this sets as the kernel's defaults until the next plan."""
    if text == "none":
        return None
    parts = [p for p in text.split(",") if p]
    policies = [p for p in parts if "=" not in p] or ["last"]
    pairs = dict(p.split("=") for p in parts if "=" in p)
    l2_prefetch.CHUNK = int(pairs.pop("chunk", DEFAULT_LAYOUT[0]))
    l2_prefetch.PER_PROGRAM = int(pairs.pop("per", DEFAULT_LAYOUT[1]))
    return WeightPrefetch({name: int(float(mb) * MB) for name, mb in pairs.items()}, policies[0])





def capture(runner: ModelRunner, bucket: int, prefetch: WeightPrefetch | None):
    """The decode step of `bucket` captured with `prefetch`: (graph, its static logits)."""
    graphs = runner.graphs
    graphs.prefetch = prefetch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(stream):
            graphs._forward(bucket, graphs.max_seqlen)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            logits = graphs._forward(bucket, graphs.max_seqlen)
    return graph, logits


def measure(runner: ModelRunner, bench: Bench, batch: int, args) -> list[str]:
    reqs = bench.new_reqs(batch, args.context)
    for start in range(0, batch, max(1, 16384 // args.context)):
        run_step(runner, prompts=reqs[start: start + max(1, 16384 // args.context)])
    ids = [r[0] for r in reqs]
    run_step(runner, ids)  # the graphs' static metadata now holds this batch's step
    bucket = runner.graphs.bucket(batch)
    times: dict[str, list[float]] = {plan: [] for plan in args.plans}
    reference = None
    for _ in range(args.reps):
        for plan in args.plans:
            graph, logits = capture(runner, bucket, parse_plan(plan))
            times[plan].append(replay_us(graph, args.iters) / 1000)
            if reference is None:
                reference = logits[:batch].clone()
            elif not torch.equal(logits[:batch], reference):
                raise SystemExit(f"batch {batch}, plan {plan}: logits differ from the first plan's")
            del graph, logits
    runner.free(ids)
    base = statistics.median(times[args.plans[0]])
    return [f"| {batch} | `{plan}` | {', '.join(f'{t:.3f}' for t in ts)} | {statistics.median(ts) / base:.4f} |"
            for plan, ts in times.items()]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, required=True)
    add("--load-format", default="dummy")
    add("--quantization", choices=("fp8",), default=None)
    add("--batches", type=int_list, default=[1, 4, 8, 16])
    add("--context", type=int, default=1024)
    add("--plans", nargs="+", default=["none", "o=16", "o=32", "o=16,gate_up=8,down=8,qkv=8"],
        help="the first is the baseline of the ratio column")
    add("--reps", type=int, default=2)
    add("--iters", type=int, default=40)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_prefetch.py needs a CUDA device")
    for plan in args.plans:
        parse_plan(plan)  # a typo fails before the model loads
    cuda_graph.PREFETCH_MAX_BATCH = max(args.batches)  # every batch measured takes the plan
    runner = ModelRunner(str(args.model), max_total_token_num=max(args.batches) * (args.context + 64) + 20000,
                         max_req_total_len=3072, running_max_req_size=max(args.batches), load_format=args.load_format,
                         data_type="bfloat16", quantization=args.quantization, cuda_graph=True)
    bench = Bench(runner, seed=0)
    lines = [f"## L2 prefetch plans: {torch.cuda.get_device_name()}, {args.model.name}, context {args.context}, "
             f"{args.quantization or 'bf16'}", "",
             "| batch | plan (MB ahead of each projection) | graph replay ms (each rep) | median / first plan's |",
             "| ---: | --- | --- | ---: |"]
    for batch in args.batches:
        rows = measure(runner, bench, batch, args)
        print("\n".join(rows), flush=True)
        lines += rows
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
