"""fp8 against bf16 projection GEMMs at the engine's batch sizes: is `--quantization fp8` worth it?

    python test/benchmark/kernels/fp8_gemm_bench.py [--shapes 8b] [--ms 1,8,...] [--out-md fp8_gemm.md]

For each projection of the model shape (qkv, o, gate_up, down) and each M (tokens in the step):
bf16 `F.linear` (the column-parallel layers' call) and `x @ Wt` (the row-parallel layers'),
the fp8 path split into its two launches (per-token quantisation, `torch._scaled_mm` with
row-wise scales) and whole (`fp8_linear`); cuBLAS's GEMM again with fast accumulation
(`use_fast_accum`: Hopper's fp8 MMAs summed without promoting each K block to fp32) and with
one scale per tensor (with and without it), each timed in a CUDA graph of 20 calls (as decode
steps run) with static_benchmark.graph_call_us; achieved bandwidth against the weight bytes
and TFLOP/s; and the fp8 result's relative error against the bf16 GEMM on the same inputs.
CUDA only.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import graph_call_us  # noqa: E402

from lightllm.kernels.fp8_linear import (FAST_ACCUM, fp8_gemm_ref, fp8_gemm_small_m, fp8_linear_triton,
                                         quantize_fp8_rows_triton, quantize_fp8_weight, small_m_plan)

logger = logging.getLogger("fp8_gemm_bench")

SHAPES = {  # name -> [(projection, N, K)]
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "70b-tp8": [("qkv", 1280, 8192), ("o", 8192, 1024), ("gate_up", 7168, 8192), ("down", 8192, 3584)],
}


SMALL_M_TIMED = 128  # the small-M kernel is timed up to here (twice the M it serves); at 256 rows
# its one row block needs more shared memory than an H100 has


def one_row(name: str, n: int, k: int, m: int) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    w_t = w.t().contiguous()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_fp8_weight(w)
    xq, xs = quantize_fp8_rows_triton(x)
    ref = F.linear(x, w).float()
    got = fp8_linear_triton(x, wq, ws).float()
    one = torch.ones((), device="cuda")

    def scaled(fast: bool, rowwise: bool = True):
        return torch._scaled_mm(xq, wq.t(), scale_a=xs if rowwise else one, scale_b=ws if rowwise else one,
                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    def or_nan(fn):  # a variant this torch's _scaled_mm refuses is nan, not the row's end
        try:
            return fn()
        except RuntimeError as e:
            logger.info("%s M=%d: %s", name, m, str(e).splitlines()[0][:160])
            return float("nan")

    def err(out):
        return ((out.float() - exact).norm() / exact.norm()).item()

    exact = fp8_gemm_ref(xq, xs, wq, ws, torch.float32)  # the same fp8 operands summed in fp32
    row = {
        "proj": name, "M": m,
        "bf16 linear": graph_call_us(lambda: F.linear(x, w)),
        "bf16 x@Wt": graph_call_us(lambda: x @ w_t),
        "quant": graph_call_us(lambda: quantize_fp8_rows_triton(x)),
        "scaled_mm": graph_call_us(lambda: scaled(False)),
        "scaled_mm fast": or_nan(lambda: graph_call_us(lambda: scaled(True))),
        "tensorwise": or_nan(lambda: graph_call_us(lambda: scaled(False, rowwise=False))),
        "tensorwise fast": or_nan(lambda: graph_call_us(lambda: scaled(True, rowwise=False))),
        "small_m": (graph_call_us(lambda: fp8_gemm_small_m(xq, xs, wq, ws, torch.bfloat16)) if m <= SMALL_M_TIMED
                    else float("nan")),
        "fp8_linear": graph_call_us(lambda: fp8_linear_triton(x, wq, ws)),
        "rel err": ((got - ref).norm() / ref.norm()).item(),
        "slow err": err(scaled(False)),
        "fast err": or_nan(lambda: err(scaled(True))),
    }
    best_bf16 = min(row["bf16 linear"], row["bf16 x@Wt"])
    row["speedup"] = best_bf16 / row["fp8_linear"]
    cublas = row["scaled_mm fast" if FAST_ACCUM else "scaled_mm"]  # the setting fp8_linear runs
    gemm = min(cublas, row["small_m"]) if m <= SMALL_M_TIMED else cublas
    row["fp8 GB/s"] = n * k / (gemm * 1e3)
    row["fp8 TFLOP/s"] = 2 * m * n * k / (gemm * 1e6)
    row["bf16 TFLOP/s"] = 2 * m * n * k / (best_bf16 * 1e6)
    return row


COLUMNS = ["proj", "M", "bf16 linear", "bf16 x@Wt", "quant", "scaled_mm", "scaled_mm fast", "tensorwise",
           "tensorwise fast", "small_m", "fp8_linear", "speedup", "fp8 GB/s", "fp8 TFLOP/s", "bf16 TFLOP/s", "rel err",
           "slow err", "fast err"]


def format_table(rows: list[dict]) -> str:
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) and v < 1 else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def tune(shapes, ms: list[int]) -> list[str]:
    """Time small_m_plan's choices around the default for each shape and M; the best five each."""
    lines = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_fp8_weight(w)
        for m in ms:
            xq, xs = quantize_fp8_rows_triton(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            ref = fp8_gemm_small_m(xq, xs, wq, ws, torch.bfloat16).float()
            results = []
            for block_n in (32, 64, 128):
                for block_k in (128, 256, 512):
                    for waves in (1, 2, 4):
                        for warps, stages in ((4, 3), (4, 4), (8, 4)):
                            plan = small_m_plan(m, n, k, num_sms, block_n, block_k, waves)
                            run = functools.partial(fp8_gemm_small_m, xq, xs, wq, ws, torch.bfloat16, plan, warps,
                                                    stages)
                            try:
                                assert torch.allclose(run().float(), ref, rtol=1e-2, atol=1e-2)
                                results.append((graph_call_us(run), plan, waves, warps, stages))
                            except Exception as e:  # a config Triton cannot compile (shared memory)
                                logger.info("%s M=%d %s: %s", name, m, plan, str(e).splitlines()[0][:120])
            default = graph_call_us(lambda: fp8_gemm_small_m(xq, xs, wq, ws, torch.bfloat16))
            results.sort(key=lambda r: r[0])
            best = "; ".join(f"{t:.1f} us {p} waves {wv} warps {wp} stages {st}" for t, p, wv, wp, st in results[:5])
            lines.append(f"{name} M={m}: default {default:.1f} us ({n * k / default / 1e3:.0f} GB/s); best: {best}")
            logger.info(lines[-1])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--ms", default="1,8,32,64,128,256,512,1024,4096")
    parser.add_argument("--out-md", default=None)
    parser.add_argument("--tune", default="", help="M values to tune the small-M kernel at (e.g. 1,16,64)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("fp8_gemm_bench needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    tuned = tune(SHAPES[args.shapes], [int(m) for m in args.tune.split(",")]) if args.tune else []
    rows = []
    for name, n, k in SHAPES[args.shapes]:
        for m in map(int, args.ms.split(",")):
            try:
                rows.append(one_row(name, n, k, m))
            except Exception as e:  # a shape cuBLAS or Triton (shared memory) refuses: say so, time the rest
                logger.error("%s M=%d: %s", name, m, e)
                continue
            logger.info("%s M=%d: bf16 %.1f us, fp8 %.1f us", name, m, min(rows[-1]["bf16 linear"],
                        rows[-1]["bf16 x@Wt"]), rows[-1]["fp8_linear"])
    table = format_table(rows)
    text = "\n".join(tuned + [f"{torch.cuda.get_device_name()} torch {torch.__version__}, times in us "
                                f"(CUDA graph of 20 calls)", table])
    print(text)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
