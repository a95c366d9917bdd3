"""What an L2 prefetch buys a batch-1 GEMM (GPU): kernels/l2_prefetch.py against a cold read.

    python test/benchmark/l2_prefetch_bench.py [--shapes o,qkv,down] [--gap-us 10]

For each projection shape of bench-8b (weights [in, out] as the model keeps o and down, [out, in]
for qkv), 32 distinct weights (as 32 layers: each cold in L2 when its turn comes), in a CUDA
graph of 32 calls, one row per case:
- cold: the GEMM alone (M = 1);
- hot: the same weight 32 times (read from L2 from the second call on: the bound);
- gap: a spin kernel of --gap-us (the stand-in for rotary and attention), alone;
- bulk / load: prefetch (kernels/l2_prefetch.py), the gap, the GEMM; "load" prefetches on a second
  stream beside the gap and is joined before the GEMM. Their "GEMM us" is the row's time less the
  gap's: what the GEMM costs once the prefetch ran beside the gap.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_benchmark import replay_us  # noqa: E402

from lightllm_kernels.l2_prefetch import prefetch_l2_triton  # noqa: E402

SHAPES = {"o": (4096, 4096, True), "qkv": (4096, 6144, False), "down": (14336, 4096, True),
          "gate_up": (4096, 28672, False)}  # name -> (in, out, stored [in, out])
LAYERS = 32


def graph_us(body, calls: int = LAYERS, replays: int = 20) -> float:
    """Microseconds of one graph of body(0..calls-1), after one eager run."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            body(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            body(i)
    return replay_us(graph, replays)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="o,qkv,down")
    parser.add_argument("--gap-us", type=float, default=10.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("l2_prefetch_bench needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    clock_khz = torch.cuda.get_device_properties(device).clock_rate if hasattr(
        torch.cuda.get_device_properties(device), "clock_rate") else 1_980_000
    cycles = int(args.gap_us * clock_khz / 1000)
    x = torch.randn(1, max(s[0] for s in SHAPES.values()), device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name()}: L2 {torch.cuda.get_device_properties(device).L2_cache_size >> 20} MiB; "
          f"gap {args.gap_us} us ({cycles} cycles at {clock_khz / 1e6:.2f} GHz); us a call, graph of {LAYERS} calls")
    print("| shape | MB | cold | hot | gap | bulk: gap + GEMM | bulk: GEMM | load: gap + GEMM | load: GEMM |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    gap = graph_us(lambda i: torch.cuda._sleep(cycles)) / LAYERS
    for name in args.shapes.split(","):
        k, n, transposed = SHAPES[name]
        weights = [torch.randn(k, n, device=device).bfloat16() if transposed else
                   torch.randn(n, k, device=device).bfloat16() for _ in range(LAYERS)]
        a = x[:, :k]
        gemm = (lambda i: a @ weights[i]) if transposed else (lambda i: F.linear(a, weights[i]))
        cold = graph_us(gemm) / LAYERS
        hot = graph_us(lambda i: gemm(0)) / LAYERS

        def bulk(i):
            prefetch_l2_triton(weights[i], "bulk")
            torch.cuda._sleep(cycles)
            gemm(i)

        def load(i):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch_l2_triton(weights[i], "load")
            torch.cuda._sleep(cycles)
            torch.cuda.current_stream().wait_stream(side)
            gemm(i)

        with_bulk = graph_us(bulk) / LAYERS
        with_load = graph_us(load) / LAYERS
        mb = k * n * 2 / 1e6
        print(f"| {name} | {mb:.1f} | {cold:.1f} | {hot:.1f} | {gap:.1f} | {with_bulk:.1f} | {with_bulk - gap:.1f} | "
              f"{with_load:.1f} | {with_load - gap:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
