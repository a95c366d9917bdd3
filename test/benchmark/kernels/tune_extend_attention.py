"""Launch settings of the extend-attention kernel (prompt chunks) on this GPU: every (BLOCK_M,
BLOCK_N, stages, warps), with and without the causal split (key blocks wholly before a query
block's first position run without the mask), against the shipped launch and torch's own
flash attention on the same prompts laid out contiguously (a library's rate on the same FLOPs).

    python test/benchmark/kernels/tune_extend_attention.py [--cases 8x1024+0,1x8192+0,4x512+1024]

A case `CxN+K` is C chunks of N new tokens, each after K cached tokens of its request, every
request's slots a contiguous run of the token table (as the allocator gives a prompt), Llama-3.1-
8B's heads (32 query, 8 KV, 128 dims, bf16; --heads others). Prints one markdown table: ms a call
(CUDA events over --iters calls), TFLOP/s (4 FLOPs a head dimension a visible query-key pair)
and the fraction of --peak-tflops. Each setting is checked against the shipped launch's output,
which is checked against the torch reference on the first chunk. GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # test/: `import benchmark.*` (README.md)

from benchmark.engine.static_benchmark import timed  # noqa: E402
import lightllm.kernels.extend_attention  # noqa: E402

ea = sys.modules["lightllm.kernels.extend_attention"]

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def parse_case(text: str) -> tuple[int, int, int]:
    chunks, rest = text.split("x")
    new, cached = rest.split("+") if "+" in rest else (rest, "0")
    return int(chunks), int(new), int(cached)


def make_case(chunks: int, new: int, cached: int):
    torch.manual_seed(chunks * new + cached)
    total = new + cached
    k_cache = torch.randn(chunks * total, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(chunks * total, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    order = torch.randperm(chunks, device="cuda")
    req_to_token = (order[:, None] * total + torch.arange(total, device="cuda")[None, :]).int()
    q = torch.randn(chunks * new, NUM_Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    rows = torch.arange(chunks, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(chunks + 1, device="cuda", dtype=torch.int32) * new
    kv_lens = torch.full((chunks,), total, dtype=torch.int32, device="cuda")
    blocks = torch.tensor(ea.extend_q_blocks([new] * chunks, HEAD_DIM), dtype=torch.int32, device="cuda").view(2, -1)
    return q, k_cache, v_cache, req_to_token, rows, cu_q, kv_lens, blocks, HEAD_DIM ** -0.5


def flops(chunks: int, new: int, cached: int) -> float:
    return 4.0 * NUM_Q_HEADS * HEAD_DIM * chunks * new * (cached + (new + 1) / 2)


def sdpa_call(args, chunks: int, new: int, cached: int):
    """torch's flash attention over the same queries, keys and values, each request contiguous."""
    q, k_cache, v_cache, table = args[0], args[1], args[2], args[3]
    qs = q.view(chunks, new, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    slots = table.long()
    if cached:  # bottom-right causal: SDPA's is_causal is top-left, so only fresh prompts run it
        return None
    group = NUM_Q_HEADS // NUM_KV_HEADS  # K/V repeated per query head: the flash backend's own layout
    ks = k_cache[slots].repeat_interleave(group, dim=2).transpose(1, 2).contiguous()  # [chunks, Hq, total, D]
    vs = v_cache[slots].repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="8x1024+0,1x8192+0,4x512+1024,64x128+0")
    parser.add_argument("--block-m", default="64,128")
    parser.add_argument("--block-n", default="64,128")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--split-from", default="0,128,256,1073741824",
                        help="the fewest unmasked keys that take the unmasked loop (0: always; huge: never)")
    parser.add_argument("--also", default="128,64,2,8,1073741824",
                        help="a setting always shown (BLOCK_M,BLOCK_N,stages,warps,split from): the launch before")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--heads", default="32,8,128")
    args = parser.parse_args(argv)
    global NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = map(int, args.heads.split(","))
    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    shipped_split = ea.SPLIT_FROM_KEYS
    shipped_launch = ea.extend_launch(HEAD_DIM, torch.bfloat16, torch.bfloat16, ea.shared_memory_limit(device))
    print(f"shipped: launch {shipped_launch},"
          f" split from {shipped_split} keys; ms a call over {args.iters} calls\n")
    print("| case | setting (BLOCK_M, BLOCK_N, stages, warps, split from) | ms | TFLOP/s | of peak | max abs diff |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    failed = 0

    def ms_of(fn) -> float:
        fn()
        return 1000 * timed(device, lambda: [fn() for _ in range(args.iters)]) / args.iters

    for text in args.cases.split(","):
        chunks, new, cached = parse_case(text)
        call = make_case(chunks, new, cached)
        work = flops(chunks, new, cached)
        shipped = ea.extend_attention_triton(*call).float()
        # the reference on the first chunk only (the torch path is slow on long prompts)
        one = (call[0][:new], *call[1:4], call[4][:1], call[5][:2], call[6][:1], call[7], call[8])
        ref = ea.extend_attention_ref(*one).float()
        error = (shipped[:new] - ref).abs().max().item()
        failed += error > 2e-2

        def line(setting: str, ms: float, diff: float) -> str:
            rate = work / ms / 1e9
            return f"| {text} | {setting} | {ms:.3f} | {rate:.0f} | {100 * rate / args.peak_tflops:.0f}% | {diff:.4f} |"

        print(line("shipped", ms_of(lambda: ea.extend_attention_triton(*call)), error))
        sdpa = sdpa_call(call, chunks, new, cached)
        if sdpa is not None:
            print(line("torch SDPA (flash), contiguous", ms_of(sdpa), 0.0))
        results = []
        also = tuple(map(int, args.also.split(",")))
        grid = list(itertools.product(*(map(int, a.split(",")) for a in (
            args.block_m, args.block_n, args.stages, args.warps, args.split_from))))
        for bm, bn, stages, warps, split in grid + ([also] if also not in grid else []):
            ea.SPLIT_FROM_KEYS = split
            try:
                run = lambda: ea.extend_attention_triton(*call, launch=(bm, bn, stages, warps))  # noqa: E731
                diff = (run().float() - shipped).abs().max().item()
                ms = ms_of(run)
            except Exception as exc:  # out of shared memory or registers: that setting is out
                print(f"| {text} | {bm}, {bn}, {stages}, {warps}, {split} | failed: {type(exc).__name__} | | | |")
                continue
            finally:
                ea.SPLIT_FROM_KEYS = shipped_split
            failed += diff > 2e-2
            results.append((ms, f"{bm}, {bn}, {stages}, {warps}, {split}", diff))
        named = ", ".join(map(str, also))
        for ms, setting, diff in sorted(results)[:args.top] + [r for r in results if r[1] == named]:
            print(line(setting if setting != named else f"{setting} (--also)", ms, diff))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
