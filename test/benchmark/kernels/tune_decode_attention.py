"""Launch settings of the decode-attention kernel on this GPU: every (BLOCK_N, num_warps,
num_stages) against the shipped ones, checked against the torch reference, timed against the
KV stream's floor.

    python test/benchmark/kernels/tune_decode_attention.py [--batches 1,64,256] [--context 1024] [--min-chunk 64,256]
    python test/benchmark/kernels/tune_decode_attention.py --drafts 4 --rows 1,auto,8   (a verify step's rows)

The cases are the decode CUDA graphs' (split plan from the server's max_req_total_len, 3072 by
default), each request's slots a contiguous run of the token table as the allocator gives them,
Llama-3.1-8B's heads (32 query, 8 KV, 128 dims, bf16; --heads others). Prints one markdown table: microseconds per
call (timed in a CUDA graph of 20 calls, as a decode step runs them, the KV warm in L2 where it
fits: a step's layers read it from memory) and the floor fraction (the K/V bytes over the measured
device-to-device copy bandwidth, divided by the time). GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.engine.static_benchmark import copy_bandwidth, graph_call_us  # noqa: E402
from lightllm.kernels.decode_attention import decode_attention_ref, decode_attention_triton  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def case(batch: int, context: int, max_seqlen: int, drafts: int = 0):
    """Decode rows of `batch` requests of `context` keys; with drafts, each request's 1 + drafts
    rows one position apart, as a verify step lays them out."""
    torch.manual_seed(batch)
    slots = batch * max_seqlen
    k_cache = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    order = torch.randperm(batch, device="cuda")  # requests' runs in shuffled order, as after many steps
    req_to_token = (order[:, None] * max_seqlen + torch.arange(max_seqlen, device="cuda")[None, :]).int()
    n = 1 + drafts
    q = torch.randn(batch * n, NUM_Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32).repeat_interleave(n)
    seq_lens = (context - drafts + torch.arange(n, device="cuda", dtype=torch.int32)).repeat(batch)
    return q, k_cache, v_cache, req_to_token, rows, seq_lens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", default="1024", help="keys per request, comma-separated")
    parser.add_argument("--max-seqlen", type=int, default=3072, help="the graphs' bound: max_req_total_len")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3,4")
    parser.add_argument("--min-chunk", default="auto", help="the fewest keys a chunk takes, comma-separated; auto: the "
                        "kernel's own choice (what an older kernel, without the argument, takes)")
    parser.add_argument("--top", type=int, default=6, help="settings shown per case, fastest first")
    parser.add_argument("--drafts", type=int, default=0, help="rows past each request's last token (a verify "
                        "step's drafts); its last row sees `context` keys")
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size (Gemma 3's 16,8,256; "
                        "Gemma 4's global 16,2,512); settings past the GPU's shared memory are shrunk by the kernel")
    parser.add_argument("--rows", default="", help="rows of a request a program takes, comma-separated, each timed "
                        "with the shipped launch (1: each row alone); with it the launch grid is skipped")
    args = parser.parse_args(argv)
    global NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = map(int, args.heads.split(","))
    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 1
    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30)
    scale = HEAD_DIM ** -0.5
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; max_seqlen {args.max_seqlen}; us a call in a CUDA graph of 20\n")
    print("| batch | context | min chunk | BLOCK_N | warps | stages | us | floor fraction | max abs error |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    failed = 0
    chunks = [None if c == "auto" else int(c) for c in args.min_chunk.split(",")]
    grid = list(itertools.product(chunks, map(int, args.block_n.split(",")),
                                  map(int, args.warps.split(",")), map(int, args.stages.split(","))))
    for batch, context in itertools.product(map(int, args.batches.split(",")), map(int, args.context.split(","))):
        q, k, v, table, rows, lens = case(batch, context, args.max_seqlen, args.drafts)
        ref = decode_attention_ref(q, k, v, table, rows, lens, context, scale).float()
        if args.rows:
            failed += time_rows(args, batch, context, (q, k, v, table, rows, lens), ref, bandwidth)
            continue
        floor_us = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * 2 / bandwidth * 1e6
        shipped = graph_call_us(lambda: decode_attention_triton(q, k, v, table, rows, lens, args.max_seqlen, scale))
        error = (decode_attention_triton(q, k, v, table, rows, lens, args.max_seqlen, scale).float() - ref).abs().max()
        failed += error.item() > 2e-2
        print(f"| {batch} | {context} | shipped | | | | {shipped:.1f} | {floor_us / shipped:.2f} | "
              f"{error.item():.4f} |")
        results = []
        for min_chunk, block_n, warps, stages in grid:
            extra = {} if min_chunk is None else {"min_chunk": min_chunk}
            try:
                run = lambda: decode_attention_triton(q, k, v, table, rows, lens, args.max_seqlen, scale,  # noqa: E731
                                                      launch=(block_n, warps, stages), **extra)
                error = (run().float() - ref).abs().max().item()
                us = graph_call_us(run)
            except Exception as exc:  # out of shared memory and the like: that setting is out
                print(f"| {batch} | {context} | {min_chunk or 'auto'} | {block_n} | {warps} | {stages} | failed: "
                      f"{type(exc).__name__} | | |")
                continue
            failed += error > 2e-2
            results.append((us, min_chunk, block_n, warps, stages, error))
        for us, min_chunk, block_n, warps, stages, error in sorted(results, key=lambda r: r[0])[:args.top]:
            print(f"| {batch} | {context} | {min_chunk or 'auto'} | {block_n} | {warps} | {stages} | {us:.1f} | "
                  f"{floor_us / us:.2f} | {error:.4f} |")
    return 1 if failed else 0


def time_rows(args, batch: int, context: int, call: tuple, ref: torch.Tensor, bandwidth: float) -> int:
    """The shipped launch with each `--rows` setting: one table row each; the floor is each
    request's keys read once."""
    q, k, v, table, rows, lens = call
    floor_us = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * 2 / bandwidth * 1e6
    failed = 0
    for setting in args.rows.split(","):
        extra = {} if setting == "auto" else {"rows": int(setting)}
        run = lambda: decode_attention_triton(q, k, v, table, rows, lens, args.max_seqlen, HEAD_DIM ** -0.5,  # noqa: E731
                                              **extra)
        error = (run().float() - ref).abs().max().item()
        failed += error > 2e-2
        us = graph_call_us(run)
        print(f"| {batch} x {1 + args.drafts} rows | {context} | rows={setting} | | | | {us:.1f} | "
              f"{floor_us / us:.2f} | {error:.4f} |")
    return failed


if __name__ == "__main__":
    sys.exit(main())
