"""Gated DeltaNet's prefill kernels at a model's shapes: the served path, the torch reference, and
flash-linear-attention's `chunk_gated_delta_rule` called bare.

    python test/benchmark/kernels/delta_rule_bench.py [--shape qwen3.5-27b] [--tp 1] [--iters 10]

One linear layer's step of prompt chunks (bf16 q/k/v, fp32 log decays, states in a pool of fp32
slots), for each case of CASES: the gated delta rule through kernels/gated_delta_rule.py's
`gated_delta_rule_chunks_fla` (what a CUDA step runs: fla's kernel over all of the step's tokens,
its sequences and block index built on the device, the states gathered from and scattered back to
the pool), its reference `gated_delta_rule_chunks_ref` (the CPU path, batched torch), and fla's
kernel bare (package fla-core) with `cu_seqlens` on the host too, made once, so that it builds its
chunk index once: the wrapper's cost is the difference; then the causal conv1d with its state, ours
and the reference. Times are the mean of --iters calls after a warm-up, between CUDA events (eager:
the reference reads its bounds to the host); errors are |x - reference| / |reference| over the
whole output. Prints one markdown table. CUDA only, with fla-core installed.

    python test/benchmark/kernels/delta_rule_bench.py --decode [--batches 64,256,512]

The decode step instead (`gated_delta_rule_step_triton`: one token of each request, its state
read from and written back to the pool), swept over its launches (value dims a program takes x
warps) for bf16 and fp32 states: time per call, the state bytes moved (read and write) a second,
that against a device copy of as many bytes, and the error against `gated_delta_rule_step_ref`;
per (states, batch) the fastest launches and the default's. No fla needed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: `import lightllm`
from lightllm.kernels.causal_conv1d import causal_conv1d_chunks_ref, causal_conv1d_chunks_triton  # noqa: E402
from lightllm.kernels.gated_delta_rule import (gated_delta_rule_chunks_fla, gated_delta_rule_chunks_ref,  # noqa: E402
                                               gated_delta_rule_step_ref, gated_delta_rule_step_triton, step_launch)

SHAPES = {  # name -> (key heads, value heads, key dim, value dim, conv kernel)
    "qwen3.5-27b": (16, 48, 128, 128, 4),
    "qwen3.5-35b-a3b": (16, 32, 128, 128, 4),
}
# (name, chunk lengths, whether the chunks continue their requests from a state)
CASES = [("prefill 1 x 8192", [8192], False), ("prefill 8 x 1024", [1024] * 8, False),
         ("burst 64 x 128", [128] * 64, False), ("extend 4 x 512", [512] * 4, True),
         ("mixed 1 x 2048", [2048], True)]
COLUMNS = ["case", "tokens", "chunks", "torch ms", "ours ms", "fla bare ms", "ours / bare", "ours err",
           "fla bare err", "conv torch ms", "conv ours ms", "conv err"]


def event_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x.float() - reference.float()).norm() / reference.float().norm()).item()


def fla_call(kernel, bounds, q, k, v, g, beta, cu, states, rows, fresh, out):
    """fla's varlen call over the same step (its GVA: the key heads as they are), the pool's states
    in and out; `bounds` (the chunks' bounds from 0, on the device and on the host) made once, so
    that fla's cached chunk index is built once, not read back at each call."""
    initial = torch.where(fresh.view(-1, 1, 1, 1), 0, states[rows])
    lo, hi, cu_seqlens, cu_seqlens_cpu = bounds
    o, final = kernel(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi],
                      scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True,
                      cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, use_qk_l2norm_in_kernel=True)
    out[lo:hi] = o[0]
    states[rows] = final.float()


def case_row(name, lengths, continued, shape, iters) -> dict:
    k_heads, v_heads, dk, dv, width = shape
    tokens, n = sum(lengths), len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(tokens + n)

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, device="cuda", dtype=dtype)

    q, k, v = randn(tokens, k_heads, dk), randn(tokens, k_heads, dk), randn(tokens, v_heads, dv)
    g = -torch.rand(tokens, v_heads, generator=gen, device="cuda") * 0.5
    beta = torch.rand(tokens, v_heads, generator=gen, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).int()
    rows, fresh = torch.arange(n, device="cuda"), torch.full((n,), not continued, device="cuda")
    pool = randn(n + 1, v_heads, dk, dv, dtype=torch.float32) * 0.05
    outputs, row = {}, {"case": name, "tokens": tokens, "chunks": n}

    def timed(label, fn, *args):
        out, states = torch.zeros_like(args[2]), pool.clone()
        fn(*args, cu, states, rows, fresh, out)
        outputs[label] = (out, states)
        row[f"{label} ms"] = event_ms(lambda: fn(*args, cu, states, rows, fresh, out), iters)  # states move on

    timed("torch", gated_delta_rule_chunks_ref, q, k, v, g, beta)
    timed("ours", gated_delta_rule_chunks_fla, q, k, v, g, beta)
    row["ours err"] = relative_error(outputs["ours"][0], outputs["torch"][0])
    lo, hi = int(cu[0]), int(cu[-1])
    bounds = (lo, hi, (cu - lo).long(), (cu - lo).long().cpu())
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    timed("fla bare", lambda *a: fla_call(chunk_gated_delta_rule, bounds, *a), q, k, v, g, beta)
    row["fla bare err"] = relative_error(outputs["fla bare"][0], outputs["torch"][0])
    row["ours / bare"] = row["ours ms"] / row["fla bare ms"]
    channels = 2 * k_heads * dk + v_heads * dv
    x, weight = randn(tokens, channels), randn(channels, width)
    conv_pool = randn(n + 1, channels, width - 1)
    conv = {}
    for label, fn in (("conv torch", causal_conv1d_chunks_ref), ("conv ours", causal_conv1d_chunks_triton)):
        out, states = torch.zeros_like(x), conv_pool.clone()
        fn(x, weight, cu, states, rows, fresh, out)
        conv[label] = out.clone()
        row[f"{label} ms"] = event_ms(lambda fn=fn, out=out, s=states: fn(x, weight, cu, s, rows, fresh, out), iters)
    row["conv err"] = relative_error(conv["conv ours"], conv["conv torch"])
    return row


STEP_LAUNCHES = [(bv, w) for bv in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8) if 128 * bv // (32 * w) <= 128]


def decode_rows(shape, batch: int, state_dtype: torch.dtype, iters: int, copy_gbs: float) -> list[dict]:
    """The decode step at `batch` requests (one padding row among them), each launch of STEP_LAUNCHES."""
    k_heads, v_heads, dk, dv, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(batch)

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, device="cuda", dtype=dtype)

    q, k, v = randn(batch, k_heads, dk), randn(batch, k_heads, dk), randn(batch, v_heads, dv)
    g = -torch.rand(batch, v_heads, generator=gen, device="cuda") * 0.5
    beta = torch.rand(batch, v_heads, generator=gen, device="cuda").to(torch.bfloat16)
    pool = (randn(batch + 8, v_heads, dk, dv, dtype=torch.float32) * 0.05).to(state_dtype)
    rows = torch.randperm(batch + 8, generator=gen, device="cuda")[:batch]
    rows[batch // 2] = -1  # a padded step's padding row
    want_states = pool.clone()
    want = gated_delta_rule_step_ref(q, k, v, g, beta, want_states, rows)
    moved = 2 * (batch - 1) * v_heads * dk * dv * pool.element_size()
    default = step_launch(dv)
    out = []
    for launch in STEP_LAUNCHES:
        states, o = pool.clone(), torch.empty_like(v)
        gated_delta_rule_step_triton(q, k, v, g, beta, states, rows, out=o, launch=launch)
        err = max(relative_error(o, want), relative_error(states, want_states))
        ms = event_ms(lambda: gated_delta_rule_step_triton(q, k, v, g, beta, states, rows, out=o, launch=launch), iters)
        gbs = moved / ms / 1e6
        out.append({"states": str(state_dtype).removeprefix("torch."), "batch": batch,
                    "launch": f"{launch[0]} x {launch[1]}" + (" (default)" if launch == default else ""),
                    "us": ms * 1000, "GB/s": gbs, "of copy": gbs / copy_gbs, "err": err})
    return out


def copy_gbs(nbytes: int, iters: int) -> float:
    """Bytes read and written a second by a device copy of `nbytes`."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / event_ms(lambda: dst.copy_(src), iters) / 1e6


def decode_main(shape, batches: list[int], iters: int) -> None:
    k_heads, v_heads, dk, dv, _ = shape
    columns = ["states", "batch", "launch", "us", "GB/s", "of copy", "err"]
    print(f"decode step, {v_heads} value heads of {dk} x {dv}, {torch.cuda.get_device_name()}, one layer; "
          "the five fastest launches (value dims a program takes x warps) and the default's")
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for state_dtype in (torch.bfloat16, torch.float32):
        for batch in batches:
            floor = copy_gbs(batch * v_heads * dk * dv * torch.finfo(state_dtype).bits // 8, iters)
            rows = sorted(decode_rows(shape, batch, state_dtype, iters, floor), key=lambda r: r["us"])
            for rank, row in enumerate(rows):
                if rank < 5 or "default" in row["launch"]:
                    print("| " + " | ".join(cell(row[c]) for c in columns) + " |")


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2e}" if value < 0.01 else f"{value:.3f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-27b")
    parser.add_argument("--tp", type=int, default=1, help="the heads one rank of this tensor-parallel size holds")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--decode", action="store_true", help="the decode step's launches instead of prefill")
    parser.add_argument("--batches", default="64,256,512", help="--decode: requests a step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("delta_rule_bench.py times CUDA kernels: no GPU here")
    k_heads, v_heads, dk, dv, width = SHAPES[args.shape]
    shape = (k_heads // args.tp, v_heads // args.tp, dk, dv, width)
    if args.decode:
        decode_main(shape, [int(b) for b in args.batches.split(",")], args.iters)
        return
    rows = [case_row(name, lengths, continued, shape, args.iters) for name, lengths, continued in CASES]
    print(f"{args.shape}, tp {args.tp} (one rank: {shape[0]} key heads, {shape[1]} value heads), "
          f"{torch.cuda.get_device_name()}, bf16 inputs, fp32 states; ms per call, one layer")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(cell(row.get(c)) for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
