"""Decode attention over a bf16 against an fp8 (e4m3) KV cache, on the GPU: time per call inside a
CUDA graph, the fp8 cache widened to fp16 (`fp8`, the kernels' way: fp8_dot_dtype) and to the
queries' bf16 (`fp8->bf16`, before 2026-11-27), each checked against the torch reference (10 calls a replay, as a decode step runs it), the K/V bytes streamed per second and
their share of the copy bandwidth (read + write), at bench-8b's heads (Hq 32, Hk 8, D 128),
random slots, with the exact length and with the graphs' bound (max_req_total_len 3072) as
max_seqlen. Prints one markdown table.

    python test/benchmark/kernels/decode_attention_kv_dtype.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)
from benchmark.engine.static_benchmark import copy_bandwidth, graph_call_us, int_list  # noqa: E402

from lightllm.kernels.decode_attention import _split_plan, decode_attention_ref, decode_attention_triton  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, GRAPH_BOUND = 32, 8, 128, 3072
FP8 = torch.float8_e4m3fn


def rows(batch: int, context: int, bandwidth: float) -> list[str]:
    device = torch.device("cuda")
    slots = batch * context
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rows_ = torch.arange(batch, device=device, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lines = []
    for bound in (context, GRAPH_BOUND):
        table = torch.zeros(batch, bound, dtype=torch.int32, device=device)
        table[:, :context] = torch.randperm(slots, device=device).to(torch.int32).view(batch, context)
        for name, (kc, vc, f16) in {"bf16": (k, v, True), "fp8": (k.to(FP8), v.to(FP8), True),
                                    "fp8->bf16": (k.to(FP8), v.to(FP8), False)}.items():
            call = (q, kc, vc, table, rows_, lens, bound, HEAD_DIM ** -0.5)
            error = (decode_attention_triton(*call, fp8_as_f16=f16).float() - decode_attention_ref(*call).float()).abs()
            us = graph_call_us(lambda: decode_attention_triton(*call, out=out, fp8_as_f16=f16), calls=10, replays=5)
            per_second = 2 * slots * KV_HEADS * HEAD_DIM * kc.element_size() / us * 1e6
            splits = _split_plan(batch, KV_HEADS, bound, device)[0]
            lines.append(f"| {batch} | {context} | {bound} | {name} | {splits} | {us:.1f} | {per_second / 1e9:.0f} | "
                         f"{per_second / bandwidth:.2f} | {error.mean():.1e} / {error.max():.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int_list, default=[64, 256, 512])
    parser.add_argument("--contexts", type=int_list, default=[512, 1024])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_attention_kv_dtype.py needs a CUDA GPU")
    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30)
    table = [f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", "",
             "| batch | context | max_seqlen | KV cache | splits | us | KV GB/s | of copy | error vs ref, mean / max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch in args.batches:
        for context in args.contexts:
            table += rows(batch, context, bandwidth)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
