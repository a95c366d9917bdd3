"""GPU check and benchmark of every Triton kernel against its torch reference.

    python test/benchmark/kernels/bench_kernels.py [--out results.json]

Checks each kernel at Llama-3.1-8B shapes (bf16) with the stated tolerances (PASS/FAIL), times
Triton and the reference with triton.testing.do_bench, and measures decode attention against
the memory-bandwidth floor: the bytes of K/V it must read divided by the device-to-device copy
bandwidth measured in the same run. Exits non-zero without a GPU or when any check fails.
"""
import argparse
import json
import sys

import torch

# Names come from the submodules: the package's public functions shadow the module names.
from lightllm.kernels.apply_penalties import apply_penalties_ref, apply_penalties_triton
from lightllm.kernels.decode_attention import _split_plan, decode_attention_ref, decode_attention_triton
from lightllm.kernels.extend_attention import extend_attention_ref, extend_attention_triton, extend_q_blocks
from lightllm.kernels.random_uniform import random_uniform_ref, random_uniform_triton
from lightllm.kernels.rms_norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from lightllm.kernels.rotary_kv import rotary_kv_ref, rotary_kv_triton
from lightllm.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton

DEVICE = "cuda"
TOKENS, HIDDEN, INTER = 4096, 4096, 14336
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
VOCAB = 128256
DTYPE = torch.bfloat16
# bf16 outputs: one rounding of the result (2^-8 relative) plus fp32 summation-order effects;
# attention also rounds the probabilities to bf16 before P @ V.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
EXACT = dict(atol=0.0, rtol=0.0)
DECODE_BATCHES, DECODE_CONTEXT = (1, 64, 256), 1024


def randn(*shape, dtype=DTYPE):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def case_rms_norm():
    x, weight = randn(TOKENS, HIDDEN), randn(HIDDEN)
    return rms_norm_ref, rms_norm_triton, (x, weight, 1e-5), BF16_TOL


def case_add_rms_norm():
    x, residual, weight = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN), randn(HIDDEN)
    return add_rms_norm_ref, add_rms_norm_triton, (x, residual, weight, 1e-5), BF16_TOL


def case_rotary_kv():
    q, k, v = (randn(TOKENS, heads, HEAD_DIM) for heads in (NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    angles = torch.rand(TOKENS, HEAD_DIM // 2, device=DEVICE) * 4096
    k_cache, v_cache = randn(65536, NUM_KV_HEADS, HEAD_DIM), randn(65536, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.randperm(65536, device=DEVICE)[:TOKENS].to(torch.int32)
    return rotary_kv_ref, rotary_kv_triton, (q, k, v, angles.cos(), angles.sin(), k_cache, v_cache, slots), BF16_TOL


def case_silu_and_mul():
    return silu_and_mul_ref, silu_and_mul_triton, (randn(TOKENS, 2 * INTER),), BF16_TOL


def case_extend():
    """8 chunks of 512 new tokens (4096 in all), each after 512 cached tokens, in scattered slots."""
    chunks, new, cached = 8, 512, 512
    num_slots = chunks * (new + cached)
    k_cache, v_cache = randn(num_slots, NUM_KV_HEADS, HEAD_DIM), randn(num_slots, NUM_KV_HEADS, HEAD_DIM)
    req_to_token = torch.randperm(num_slots, device=DEVICE).to(torch.int32).view(chunks, new + cached)
    req_rows = torch.randperm(chunks, device=DEVICE).to(torch.int32)
    cu_q = torch.arange(chunks + 1, device=DEVICE, dtype=torch.int32) * new
    kv_lens = torch.full((chunks,), new + cached, dtype=torch.int32, device=DEVICE)
    q = randn(chunks * new, NUM_Q_HEADS, HEAD_DIM)
    blocks = torch.tensor(extend_q_blocks([new] * chunks, HEAD_DIM), dtype=torch.int32, device=DEVICE).view(2, -1)
    args = (q, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, blocks, HEAD_DIM ** -0.5)
    return extend_attention_ref, extend_attention_triton, args, BF16_TOL


def decode_args(batch: int, context: int = DECODE_CONTEXT):
    num_slots = batch * context
    k_cache = randn(num_slots, NUM_KV_HEADS, HEAD_DIM)
    v_cache = randn(num_slots, NUM_KV_HEADS, HEAD_DIM)
    req_to_token = torch.randperm(num_slots, device=DEVICE).to(torch.int32).view(batch, context)
    req_rows = torch.randperm(batch, device=DEVICE).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = randn(batch, NUM_Q_HEADS, HEAD_DIM)
    return (q, k_cache, v_cache, req_to_token, req_rows, seq_lens, context, HEAD_DIM ** -0.5)


def case_decode():
    args = list(decode_args(64))
    args[5] = torch.randint(1, DECODE_CONTEXT + 1, (64,), dtype=torch.int32, device=DEVICE)  # ragged lengths
    return decode_attention_ref, decode_attention_triton, tuple(args), BF16_TOL


def case_penalties():
    batch, per_request = 256, 200
    token_ids = torch.cat([torch.randperm(VOCAB, device=DEVICE)[:per_request] for _ in range(batch)]).to(torch.int32)
    token_counts = torch.randint(1, 10, (batch * per_request,), dtype=torch.int32, device=DEVICE)
    cu_offsets = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * per_request
    penalties = (torch.rand(batch, device=DEVICE), torch.rand(batch, device=DEVICE),
                 torch.rand(batch, device=DEVICE) + 0.5)
    args = (randn(batch, VOCAB, dtype=torch.float32), *penalties, token_ids, token_counts, cu_offsets)
    return apply_penalties_ref, apply_penalties_triton, args, FP32_TOL


def case_random_uniform():
    seeds = torch.randint(-2**63, 2**63 - 1, (256,), dtype=torch.int64, device=DEVICE)
    steps = torch.randint(0, 2**20, (256,), dtype=torch.int64, device=DEVICE)
    return random_uniform_ref, random_uniform_triton, (seeds, steps, VOCAB), EXACT


CASES = {
    "rms_norm": case_rms_norm, "add_rms_norm": case_add_rms_norm, "rotary_kv_": case_rotary_kv,
    "silu_and_mul": case_silu_and_mul, "extend_attention": case_extend,
    "decode_attention": case_decode, "apply_penalties_": case_penalties, "random_uniform": case_random_uniform,
}


def clone_args(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def check(name, ref, triton_fn, args, tol) -> dict:
    """Run both on copies of the same inputs; compare the outputs and every tensor argument
    (in-place ops return None and mutate their arguments; untouched ones compare equal)."""
    ref_args, triton_args = clone_args(args), clone_args(args)
    expected, actual = ref(*ref_args), triton_fn(*triton_args)
    pairs = [(actual, expected)] if expected is not None else []
    pairs += [(a, e) for a, e in zip(triton_args, ref_args) if isinstance(a, torch.Tensor)]
    max_err, ok = 0.0, True
    for got, want in pairs:
        max_err = max(max_err, (got.float() - want.float()).abs().max().item())
        ok &= torch.allclose(got.float(), want.float(), **tol)
    if name == "random_uniform":  # the stream must also be the CPU reference's, bit for bit
        ok &= torch.equal(actual.cpu(), ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)))
    return dict(kernel=name, ok=bool(ok), max_abs_err=max_err, atol=tol["atol"], rtol=tol["rtol"])


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def decode_table(bandwidth_gbps: float) -> list[dict]:
    rows = []
    for batch in DECODE_BATCHES:
        args = decode_args(batch)
        kv_bytes = 2 * batch * DECODE_CONTEXT * NUM_KV_HEADS * HEAD_DIM * args[1].element_size()
        floor_ms = kv_bytes / (bandwidth_gbps * 1e9) * 1e3
        triton_ms = bench_ms(lambda: decode_attention_triton(*args))
        ref_ms = bench_ms(lambda: decode_attention_ref(*args))
        splits = _split_plan(batch, NUM_KV_HEADS, DECODE_CONTEXT, args[0].device)[0]
        rows.append(dict(batch=batch, context=DECODE_CONTEXT, num_splits=splits, triton_ms=triton_ms, ref_ms=ref_ms,
                         kv_bytes=kv_bytes, floor_ms=floor_ms, fraction_of_floor=floor_ms / triton_ms))
        del args
        torch.cuda.empty_cache()
    return rows


def markdown(checks, timings, bandwidth, decode_rows) -> str:
    lines = ["| kernel | check | max abs err | triton ms | torch ref ms | speedup |", "|---|---|---|---|---|---|"]
    for c, t in zip(checks, timings):
        lines.append(f"| {c['kernel']} | {'PASS' if c['ok'] else 'FAIL'} | {c['max_abs_err']:.2e} | "
                     f"{t['triton_ms']:.4f} | {t['ref_ms']:.4f} | {t['ref_ms'] / t['triton_ms']:.1f}x |")
    lines += ["", f"Decode attention, Hq {NUM_Q_HEADS}, Hk {NUM_KV_HEADS}, D {HEAD_DIM}, bf16; "
              f"copy bandwidth {bandwidth:.0f} GB/s (read + write)", "",
              "| batch | context | splits | triton ms | torch ref ms | K/V MB read | floor ms | of floor |",
              "|---|---|---|---|---|---|---|---|"]
    for r in decode_rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['num_splits']} | {r['triton_ms']:.4f} | "
                     f"{r['ref_ms']:.4f} | {r['kv_bytes'] / 1e6:.1f} | {r['floor_ms']:.4f} | "
                     f"{100 * r['fraction_of_floor']:.0f}% |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    out_path = parser.parse_args().out
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False")
    torch.manual_seed(0)
    checks, timings = [], []
    for name, make in CASES.items():
        ref, triton_fn, args, tol = make()
        checks.append(check(name, ref, triton_fn, args, tol))
        print(f"{'PASS' if checks[-1]['ok'] else 'FAIL'} {name}: max abs err {checks[-1]['max_abs_err']:.3e}", flush=True)
        timings.append(dict(kernel=name, triton_ms=bench_ms(lambda: triton_fn(*args)), ref_ms=bench_ms(lambda: ref(*args))))
        del args
        torch.cuda.empty_cache()
    bandwidth = copy_bandwidth_gbps()
    decode_rows = decode_table(bandwidth)
    print(markdown(checks, timings, bandwidth, decode_rows))
    results = dict(device=torch.cuda.get_device_name(), checks=checks, timings=timings,
                   copy_bandwidth_gbps=bandwidth, decode=decode_rows)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
