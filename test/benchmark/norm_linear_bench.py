"""Time kernels/norm_linear.py (RMSNorm + projection (+ SiLU-and-mul) in one launch) against the
kernels it replaces in a decode step of a few tokens: add_rms_norm, cuBLAS's GEMM (F.linear), and
for gate/up silu_and_mul. H100 only; 8B shapes (hidden 4096: q/k/v 6144 rows, gate/up 2 x 14336;
`--tp 2` halves the rows).

    python test/benchmark/norm_linear_bench.py [--tune]

Each case runs in a CUDA graph that cycles through enough copies of the weight to overflow the
L2 cache, as a step's layers do, and reports us per call. --tune times a grid of plans at the
first M and prints the best beside the default. A correctness line compares the fused output with
the unfused one (bf16: a rounding or two apart).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from lightllm_kernels.norm_linear import norm_linear_plan, norm_linear_triton
from lightllm_kernels.rms_norm import add_rms_norm_triton
from lightllm_kernels.silu_and_mul import silu_and_mul_triton

HIDDEN = 4096
L2_BYTES = 50 << 20


def graph_us(fn, copies: int, iters: int) -> float:
    """us per call of fn(i) for i over the copies, replayed from one CUDA graph."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * copies)


def plans(gated: bool):
    for block_n, block_k, waves, (warps, stages) in itertools.product(
            (8, 16, 32) if gated else (16, 32, 64), (64, 128, 256), (1, 2, 4), ((4, 1), (4, 3), (8, 3))):
        yield (block_n, block_k, waves), warps, stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1", help="tokens, comma-separated (the fused kernel takes one)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("norm_linear_bench.py needs a GPU")
        return 0
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ms = [int(v) for v in args.m.split(",")]
    shapes = {"qkv": (6144 // args.tp, False), "gate_up": (14336 // args.tp, True)}
    print(f"## norm_linear against add_rms_norm + cuBLAS (+ silu_and_mul), {torch.cuda.get_device_name(dev)}, "
          f"tp {args.tp}, us per call, weights cold (cycled past L2)\n")
    print("| projection | M | unfused us | fused us (default plan) | fused / unfused | max rel. diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    tuned = []
    for name, (n, gated) in shapes.items():
        rows = 2 * n if gated else n
        copies = max(2, -(-2 * L2_BYTES // (rows * HIDDEN * 2)))
        weights = [torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        g = torch.rand(HIDDEN, device=dev, dtype=torch.bfloat16) + 0.5
        for m in ms:
            x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16) * 1e-3
            res = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)

            def unfused(i, x=x, res=res):
                y = F.linear(add_rms_norm_triton(x, res, g, 1e-5), weights[i])
                return silu_and_mul_triton(y) if gated else y

            def fused(i, x=x, res=res, plan=None, warps=4, stages=3):
                return norm_linear_triton(x, res, g, 1e-5, weights[i], gated=gated, plan=plan, num_warps=warps,
                                          num_stages=stages)[0]

            ref_res = res.clone()
            want = F.linear(add_rms_norm_triton(x, ref_res, g, 1e-5), weights[0])
            want = silu_and_mul_triton(want) if gated else want
            got = fused(0, res=res.clone())
            diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            t_unfused = graph_us(unfused, copies, args.iters)
            t_fused = graph_us(fused, copies, args.iters)
            print(f"| {name} | {m} | {t_unfused:.1f} | {t_fused:.1f} | {t_fused / t_unfused:.3f} | {diff:.1e} |",
                  flush=True)
            if args.tune and m == ms[0]:
                best = None
                for (block_n, block_k, waves), warps, stages in plans(gated):
                    plan = norm_linear_plan(m, n, HIDDEN, gated, sms, block_n, block_k, waves)
                    try:
                        t = graph_us(lambda i: fused(i, plan=plan, warps=warps, stages=stages), copies, args.iters)
                    except Exception as e:  # noqa: BLE001 - a plan that does not fit (shared memory)
                        print(f"  plan {plan} warps {warps} stages {stages}: {type(e).__name__}", file=sys.stderr)
                        continue
                    if best is None or t < best[0]:
                        best = (t, plan, warps, stages, waves)
                tuned.append((name, m, t_unfused, t_fused, best))
        del weights
    if tuned:
        print("\n| projection | M | unfused us | default us | best us | best (BLOCK_N, BLOCK_K, splits), waves, warps, stages |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for name, m, t_unfused, t_fused, (t, plan, warps, stages, waves) in tuned:
            print(f"| {name} | {m} | {t_unfused:.1f} | {t_fused:.1f} | {t:.1f} | {plan}, {waves}, {warps}, {stages} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
