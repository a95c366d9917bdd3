"""Launch settings of the decode-attention kernel on this GPU: every (BLOCK_N, num_warps,
num_stages) against the shipped ones, checked against the torch reference, timed against the
KV stream's floor.

    python test/benchmark/tune_decode_attention.py [--batches 1,64,256] [--context 1024]

The cases are the decode CUDA graphs' (split plan from the server's max_req_total_len, 3072 by
default), each request's slots a contiguous run of the token table as the allocator gives them,
Llama-3.1-8B's heads (32 query, 8 KV, 128 dims, bf16). Prints one markdown table: microseconds per
call (stage 1, and the merge where keys are split; CUDA-event timed) and the floor fraction (the K/V bytes over the measured
device-to-device copy bandwidth, divided by the time). GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from lightllm_kernels.decode_attention import decode_attention_ref, decode_attention_triton
from static_benchmark import copy_bandwidth

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def time_us(fn, iters: int = 50) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters * 1000


def case(batch: int, context: int, max_seqlen: int):
    torch.manual_seed(batch)
    slots = batch * max_seqlen
    k_cache = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    order = torch.randperm(batch, device="cuda")  # requests' runs in shuffled order, as after many steps
    req_to_token = (order[:, None] * max_seqlen + torch.arange(max_seqlen, device="cuda")[None, :]).int()
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, req_to_token, rows, seq_lens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-seqlen", type=int, default=3072, help="the graphs' bound: max_req_total_len")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3,4")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 1
    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30)
    scale = HEAD_DIM ** -0.5
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; context {args.context}, max_seqlen {args.max_seqlen}\n")
    print("| batch | BLOCK_N | warps | stages | us | floor fraction | max abs error |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    failed = 0
    for batch in map(int, args.batches.split(",")):
        q, k, v, table, rows, lens = case(batch, args.context, args.max_seqlen)
        ref = decode_attention_ref(q, k, v, table, rows, lens, args.context, scale).float()
        floor_us = batch * args.context * NUM_KV_HEADS * HEAD_DIM * 2 * 2 / bandwidth * 1e6
        shipped = time_us(lambda: decode_attention_triton(q, k, v, table, rows, lens, args.max_seqlen, scale))
        print(f"| {batch} | shipped | | | {shipped:.1f} | {floor_us / shipped:.2f} | - |")
        results = []
        for block_n, warps, stages in itertools.product(map(int, args.block_n.split(",")), map(int, args.warps.split(",")),
                                                        map(int, args.stages.split(","))):
            try:
                run = lambda: decode_attention_triton(q, k, v, table, rows, lens, args.max_seqlen, scale,  # noqa: E731
                                                      launch=(block_n, warps, stages))
                error = (run().float() - ref).abs().max().item()
                us = time_us(run)
            except Exception as exc:  # out of shared memory and the like: that setting is out
                print(f"| {batch} | {block_n} | {warps} | {stages} | failed: {type(exc).__name__} | | |")
                continue
            failed += error > 2e-2
            results.append((us, block_n, warps, stages, error))
        for us, block_n, warps, stages, error in sorted(results)[:6]:
            print(f"| {batch} | {block_n} | {warps} | {stages} | {us:.1f} | {floor_us / us:.2f} | {error:.4f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
