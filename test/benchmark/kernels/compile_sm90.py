"""Compile every Triton kernel the layers and the sampler launch for the H100 (sm90) on a machine
without a GPU, through Triton's own compiler and the ptxas its wheel bundles.

    python test/benchmark/kernels/compile_sm90.py

The CPU tests run the kernels in Triton's interpreter, which executes Python and so accepts code
the GPU compiler may refuse (an fp8 conversion, a pointer of the wrong type in a branch not taken);
this is the check that the GPU path at least builds. Each kernel is compiled with the argument
types of a real call (the Python wrappers are called with bench-8b's head shapes and a few tokens,
and each launch is captured instead of run) and the constexprs that call chose, DOT_UPCAST and PDL
(with Triton's launch_pdl option) set as on an H100. Prints one line a launch (OK or FAIL with
the compiler's message), in launch order, compiled by `--jobs` processes at once (every core by
default); exits 1 on any FAIL.
Not under TRITON_INTERPRET=1: the interpreter's kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_sm90.py compiles real kernels: run it without TRITON_INTERPRET=1")

import importlib  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightllm.kernels import _triton  # noqa: E402
from lightllm.kernels.allreduce_norm import one_shot_add_rms_norm_triton  # noqa: E402
from lightllm.kernels.apply_penalties import apply_penalties_triton  # noqa: E402
from lightllm.kernels.causal_conv1d import (causal_conv1d_chunks_triton, causal_conv1d_runs_triton,  # noqa: E402
                                            causal_conv1d_step_triton)
from lightllm.kernels.decode_attention import decode_attention_triton  # noqa: E402
from lightllm.kernels.extend_attention import extend_attention_triton, extend_q_blocks  # noqa: E402
from lightllm.kernels.fp8_linear import (fp8_gemm_small_m, quantize_fp8_rows_triton, quantize_fp8_weight,  # noqa: E402
                                         small_m_plan)
from lightllm.kernels.fused_moe import (DECODE_PLAN, FP8_PREFILL_PLAN, LARGE_PLAN, LARGE_PLANS,  # noqa: E402
                                        PREFILL_PLAN, MoEPlan, align_by_expert_triton, fused_moe_triton,
                                        quantize_experts_fp8)
from lightllm.kernels.gated_delta_rule import (chunk_states_in_triton, chunk_states_out_triton,  # noqa: E402
                                               gated_delta_rule_runs_triton, gated_delta_rule_step_triton,
                                               l2norm_heads_triton, linear_gates_triton)
from lightllm.kernels.greedy_sample import greedy_sample_triton  # noqa: E402
from lightllm.kernels.lora import lora_expand_triton, lora_segments, lora_shrink_triton  # noqa: E402
from lightllm.kernels.random_uniform import random_uniform_triton  # noqa: E402
from lightllm.kernels.rms_norm import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton  # noqa: E402
from lightllm.kernels.rotary_kv import rotary_kv_triton  # noqa: E402
from lightllm.kernels.silu_and_mul import gelu_tanh_and_mul_triton, silu_and_mul_triton  # noqa: E402

# The package's public `decode_attention` function shadows the submodule of the same name.
decode_module = importlib.import_module("lightllm.kernels.decode_attention")
extend_module = importlib.import_module("lightllm.kernels.extend_attention")

POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                 torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8", torch.bool: "*i1"}
OPTIONS = ("num_warps", "num_stages", "launch_pdl")
Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 32, 8, 128, 4096, 14336
H100_SMS = 132
H100_SHARED_BYTES = 232448  # a block's most shared memory, opted in (the H200's too)
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
    assert isinstance(value, float), type(value)
    return "fp32"


def divisible_by_16(value) -> bool:
    """What Triton's launch specialises on (`tt.divisibility` 16): a pointer's 16-byte alignment, an
    integer's divisibility by 16. It decides whether loads vectorise and are pipelined (copied to
    shared memory ahead, which takes shared memory per stage), so a compile without it is not the GPU's."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def captured_launches() -> list[tuple]:
    """(kernel, argument types, constexprs, options, divisibility attributes) of each distinct
    launch the wrappers make."""
    launches = {}

    def capture(kernel, grid, args, kwargs):
        names = kernel.fn.arg_names
        types = {name: POINTER_TYPES[a.dtype] if isinstance(a, torch.Tensor) else scalar_type(a)
                 for name, a in zip(names, args)}
        # as on the H100: DOT_UPCAST off, programmatic dependent launch on where the kernel takes it
        gpu = {"DOT_UPCAST": False, "PDL": True}
        constexprs = {k: gpu.get(k, v) for k, v in kwargs.items() if k not in OPTIONS}
        options = {k: v for k, v in kwargs.items() if k in OPTIONS}
        if "PDL" in constexprs:
            options["launch_pdl"] = True
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args) if divisible_by_16(a)}
        key = (kernel.fn.__name__, tuple(types.items()), tuple(constexprs.items()), tuple(options.items()),
               tuple(attrs))
        launches[key] = (kernel, types, constexprs, options, attrs)

    saved = _triton._FastKernel._launch
    _triton._FastKernel._launch = capture
    try:
        call_every_kernel()
    finally:
        _triton._FastKernel._launch = saved
    return list(launches.values())


def call_every_kernel() -> None:
    """Each wrapper once per path the server takes; nothing runs (the launches are captured)."""
    tokens = 4
    x, weight = torch.randn(tokens, HIDDEN, dtype=BF16), torch.randn(HIDDEN, dtype=BF16)
    for fp8_out in (False, True):
        rms_norm_triton(x, weight, 1e-5, fp8_out)
        add_rms_norm_triton(x, x.clone(), weight, 1e-5, fp8_out)
    add_rms_norm_triton(torch.randn(2, tokens, HIDDEN), x.clone(), weight, 1e-5)  # a split projection's partial sums
    share = torch.randn(tokens, HIDDEN)  # a row-parallel projection's LoRA share, alone and with partial sums
    add_rms_norm_triton(x, x.clone(), weight, 1e-5, extra=share)
    add_rms_norm_triton(torch.randn(2, tokens, HIDDEN), x.clone(), weight, 1e-5, extra=share)
    for fp8_out in (False, True):
        silu_and_mul_triton(torch.randn(tokens, 2 * INTER, dtype=BF16), fp8_out)
        gelu_tanh_and_mul_triton(torch.randn(tokens, 2 * INTER, dtype=BF16), fp8_out)
    silu_and_mul_triton(torch.randn(tokens, 2 * INTER, dtype=BF16), extra=torch.randn(tokens, 2 * INTER))  # gate/up's
    q8, scale = quantize_fp8_rows_triton(x)
    w8, w_scale = quantize_fp8_weight(torch.randn(1024, HIDDEN))
    for sms in (4, H100_SMS):  # K whole, and split (each column block's last slice adds the slices up)
        fp8_gemm_small_m(q8, scale, w8, w_scale, BF16, plan=small_m_plan(tokens, 1024, HIDDEN, sms))
    qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=BF16)
    q, k, v = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in (q, k, v))
    cos, sin = torch.randn(tokens, HEAD_DIM // 2), torch.randn(tokens, HEAD_DIM // 2)
    slots = torch.arange(tokens)
    table = torch.arange(1024, dtype=torch.int32).view(2, 512)
    rows, lens = torch.arange(2, dtype=torch.int32), torch.tensor([512, 300], dtype=torch.int32)
    for kv_dtype in (BF16, FP8):
        k_cache, v_cache = (torch.zeros(1024, KV_HEADS, HEAD_DIM, dtype=kv_dtype) for _ in range(2))
        rotary_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
        if kv_dtype == BF16:  # with q/k/v's LoRA share
            rotary_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, extra=torch.randn(qkv.shape))
        # the plans as on the H100 (keys split, then merged: two requests, then four) and as for a large
        # batch (one split, no merge)
        per_wave = decode_module._programs_per_wave
        for sms in (H100_SMS, 0):
            decode_module._programs_per_wave = lambda device, sms=sms: sms
            decode_attention_triton(q[:2], k_cache, v_cache, table, rows, lens, 512, 0.1)
        decode_module._programs_per_wave = lambda device: H100_SMS
        decode_attention_triton(q, k_cache, v_cache, table, rows.repeat(2), lens.repeat(2), 512, 0.1)
        decode_module._programs_per_wave = per_wave
        cu_q = torch.tensor([0, 1, 4], dtype=torch.int32)
        blocks = torch.tensor(extend_q_blocks([1, 3], HEAD_DIM, 4), dtype=torch.int32).view(2, -1)
        extend_attention_triton(q[:4], k_cache, v_cache, table, rows, cu_q, lens, blocks, 0.1)
    # a sliding-window layer with soft-capped scores (Gemma 2), on the last pass's (fp8) cache
    decode_attention_triton(q[:2], k_cache, v_cache, table, rows, lens, 512, 0.1, window=256, softcap=50.0)
    extend_attention_triton(q[:4], k_cache, v_cache, table, rows, cu_q, lens, blocks, 0.1, window=256, softcap=50.0)
    call_wide_head_kernels(table, rows, lens, cu_q)
    logits = torch.randn(2, 1000)
    counts = torch.ones(3, dtype=torch.int32)
    apply_penalties_triton(logits, *(torch.rand(2) for _ in range(3)), torch.tensor([1, 5, 7], dtype=torch.int32),
                           counts, torch.tensor([0, 2, 3], dtype=torch.int32))
    random_uniform_triton(torch.tensor([1, 2]), torch.tensor([0, 3]), 1000)
    greedy_sample_triton(logits)
    # the all-reduce fused with the residual add and RMSNorm, two ranks (its pointers are never read here)
    pointers = torch.zeros(2, dtype=torch.int64)
    one_shot_add_rms_norm_triton(x, x.clone(), weight, 1e-5, data_ptrs=pointers, flags_ptrs=pointers,
                                 counters=torch.zeros(256, dtype=torch.int64), rank=0, region_bytes=80 << 20)
    call_moe_kernels()
    call_lora_kernels()
    call_linear_attention_kernels()


def call_wide_head_kernels(table, rows, lens, cu_q) -> None:
    """Gemma 4's global layers (heads of 512, 8 query heads a kv head): rotary and the attention
    launches (every decode plan over a bf16 cache, a split one over fp8), bounded by an H100's
    shared memory as on the GPU (the wrappers see no limit for CPU tensors)."""
    limit = decode_module.shared_memory_limit, extend_module.shared_memory_limit
    decode_module.shared_memory_limit = extend_module.shared_memory_limit = lambda device: H100_SHARED_BYTES
    per_wave = decode_module._programs_per_wave
    head_dim = 512
    q, k, v = (torch.randn(4, heads, head_dim, dtype=BF16) for heads in (16, 2, 2))
    blocks = torch.tensor(extend_q_blocks([1, 3], head_dim, 4), dtype=torch.int32).view(2, -1)
    try:
        for kv_dtype, plans in ((BF16, ((H100_SMS, 2), (H100_SMS, 4), (0, 4))), (FP8, ((H100_SMS, 4),))):
            k_cache, v_cache = (torch.zeros(1024, 2, head_dim, dtype=kv_dtype) for _ in range(2))
            if kv_dtype == BF16:
                rotary_kv_triton(q, k, v, *(torch.randn(4, head_dim // 2) for _ in range(2)), k_cache, v_cache,
                                 torch.arange(4))
            for sms, batch in plans:
                decode_module._programs_per_wave = lambda device, sms=sms: sms
                decode_attention_triton(q[:batch], k_cache, v_cache, table, rows.repeat(2)[:batch],
                                        lens.repeat(2)[:batch], 512, 0.1)
            extend_attention_triton(q, k_cache, v_cache, table, rows, cu_q, lens, blocks, 0.1)
    finally:
        decode_module.shared_memory_limit, extend_module.shared_memory_limit = limit
        decode_module._programs_per_wave = per_wave


def call_lora_kernels() -> None:
    """LoRA on bench-8b's merged q/k/v projection (three parts of rank 16) and its down projection,
    16 slots, bf16; the down projection's also into a split projection's fp32 partial sum."""
    tokens, slots, rank = 4, 16, 16
    seg = lora_segments(torch.tensor([0, -1, 15, 0]), slots)
    for k, n, parts in ((HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, 3), (INTER, HIDDEN, 1)):
        x, y = torch.randn(tokens, k, dtype=BF16), torch.randn(tokens, n, dtype=BF16)
        a, b = torch.randn(slots, parts * rank, k, dtype=BF16), torch.randn(slots, n, parts * rank, dtype=BF16)
        s = lora_shrink_triton(x, a, seg)
        lora_expand_triton(y, s, b, seg)
    lora_expand_triton(torch.randn(2, tokens, HIDDEN)[0], s, b, seg)


def call_linear_attention_kernels() -> None:
    """Gated DeltaNet (decode steps, prompt chunks, a verify step's runs and their commit) at the
    qwen3.5-27b's shapes (16 key heads and 48 value heads of 128, the conv over 10240 channels) in
    bf16, and at the GPU tests' tiny fp32 ones (16 and 8 dimensions). (The chunked delta rule is
    flash-linear-attention's, not ours: not compiled here.)"""
    tokens = 4
    for dtype, k_heads, v_heads, dk, dv in ((BF16, 16, 48, 128, 128), (torch.float32, 2, 4, 16, 8)):
        q, k = (torch.randn(tokens, k_heads, dk, dtype=dtype) for _ in range(2))
        v = torch.randn(tokens, v_heads, dv, dtype=dtype)
        g, beta = torch.randn(tokens, v_heads), torch.rand(tokens, v_heads, dtype=dtype)
        states, rows = torch.zeros(3, v_heads, dk, dv), torch.tensor([0, 1])
        gated_delta_rule_step_triton(q[:2], k[:2], v[:2], g[:2], beta[:2], states, rows)
        cu, fresh = torch.tensor([2, 3, 4], dtype=torch.int32), torch.tensor([True, False])
        for pool in (states, states.to(BF16)):  # the fla path's states in and out, fp32 and bf16 pools
            filled, initial = torch.tensor([True, False]), torch.empty(5, *pool.shape[1:], dtype=pool.dtype)
            chunk_states_in_triton(pool, rows, fresh, filled, initial)
            chunk_states_out_triton(torch.zeros(5, *pool.shape[1:]), rows, filled, pool)
        channels = 2 * k_heads * dk + v_heads * dv
        x, weight = torch.randn(tokens, channels, dtype=dtype), torch.randn(channels, 4, dtype=dtype)
        conv_states = torch.zeros(3, channels, 3, dtype=dtype)
        causal_conv1d_step_triton(x[:2], weight, conv_states, rows)
        causal_conv1d_chunks_triton(x, weight, cu, conv_states, rows, fresh, torch.empty_like(x))
        starts, lengths = torch.tensor([0, 3]), torch.tensor([3, 1])  # a verify step's runs, then a commit's
        for update in (False, True):
            gated_delta_rule_runs_triton(q, k, v, g, beta, states, rows, starts, lengths, update)
            causal_conv1d_runs_triton(x, weight, conv_states, rows, starts, lengths, update)
        z = torch.randn(tokens, 2 * v_heads * dv, dtype=dtype)[:, :v_heads * dv].view(tokens, v_heads, dv)
        gated_rms_norm_triton(v, z, torch.randn(dv, dtype=dtype), 1e-6)  # the linear layers' gated norm
        l2norm_heads_triton(x[:, k_heads * dk: 2 * k_heads * dk].view(tokens, k_heads, dk))  # k's norm before fla
        ab = torch.randn(tokens, 2 * v_heads, dtype=dtype)
        linear_gates_triton(ab[:, v_heads:], ab[:, :v_heads], -torch.rand(v_heads), torch.randn(v_heads))


def call_moe_kernels() -> None:
    """Qwen3-30B-A3B's expert shapes (hidden 2048, experts of 768, 8 active; 16 experts, not 128:
    nothing runs), with the decode and the prefill plan, bf16 and fp8 experts."""
    experts, hidden, inter, top_k, tokens = 16, 2048, 768, 8, 4
    x = torch.randn(tokens, hidden, dtype=BF16)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, dtype=BF16)
    w_down = torch.randn(experts, hidden, inter, dtype=BF16)
    weights, ids = torch.rand(tokens, top_k), torch.randint(0, experts, (tokens, top_k), dtype=torch.int32)
    fp8_experts = (*quantize_experts_fp8(w_gate_up), *quantize_experts_fp8(w_down))
    w_gate_up8, gate_up_scale, w_down8, down_scale = fp8_experts
    for plan, down_plan in ((DECODE_PLAN, DECODE_PLAN), (PREFILL_PLAN, PREFILL_PLAN), LARGE_PLANS[False]):
        fused_moe_triton(x, w_gate_up, w_down, weights, ids, plan=plan, down_plan=down_plan)
    for plan, down_plan in ((DECODE_PLAN, DECODE_PLAN), (FP8_PREFILL_PLAN, FP8_PREFILL_PLAN), LARGE_PLANS[True]):
        fused_moe_triton(x, w_gate_up8, w_down8, weights, ids, gate_up_scale, down_scale, plan=plan,
                         down_plan=down_plan)
    # fp32 experts (the GPU tests' tiny models) with the plan a large step picks: their tiles must fit
    tokens32, hidden32, inter32 = 2048, 256, 128
    fused_moe_triton(torch.randn(tokens32, hidden32), torch.randn(experts, 2 * inter32, hidden32),
                     torch.randn(experts, hidden32, inter32), torch.rand(tokens32, top_k),
                     torch.randint(0, experts, (tokens32, top_k), dtype=torch.int32))
    # fp8 experts under fp32 activations (the GPU tests' tiny models with --quantization fp8): fp8 tiles
    fused_moe_triton(x.float(), w_gate_up8, w_down8, weights, ids, gate_up_scale, down_scale,
                     plan=MoEPlan(32, 32, 32, 4, 2))
    # MXFP4 experts at gpt-oss's shapes (hidden and intermediate 2880, biases, its clamped SwiGLU): a
    # decode step's plans and a prefill's
    gpt_oss = 2880
    mxfp4 = [torch.zeros(experts, rows, cols, dtype=torch.uint8) for rows, cols in
             ((2 * gpt_oss, gpt_oss // 2), (gpt_oss, gpt_oss // 2), (2 * gpt_oss, gpt_oss // 32), (gpt_oss, gpt_oss // 32))]
    biases = dict(gate_up_bias=torch.zeros(experts, 2 * gpt_oss, dtype=BF16), down_bias=torch.zeros(experts, gpt_oss,
                                                                                                   dtype=BF16))
    for mxfp4_tokens in (1, 256, 4096):
        fused_moe_triton(torch.randn(mxfp4_tokens, gpt_oss, dtype=BF16), mxfp4[0], mxfp4[1],
                         torch.rand(mxfp4_tokens, 4), torch.randint(0, experts, (mxfp4_tokens, 4), dtype=torch.int32),
                         mxfp4[2], mxfp4[3], **biases, swiglu=(1.702, 7.0))
    # a prefill's alignment: the ids cut into chunks (counts, runs, placement)
    align_by_expert_triton(torch.randint(0, experts, (1024, top_k), dtype=torch.int32), experts, LARGE_PLAN.block_m)


def compile_for_sm90(kernel, types: dict, constexprs: dict, options: dict, attrs: dict):
    fn = kernel.fn
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


_LAUNCHES: list[tuple] = []  # what the forked compiling processes read


def check_one(index: int) -> str:
    """Compile launch `index` of _LAUNCHES: its line, OK or FAIL with the compiler's message."""
    kernel, types, constexprs, options, attrs = _LAUNCHES[index]
    shown = ", ".join(f"{k}={v}" for k, v in {**constexprs, **options}.items())
    try:
        compiled = compile_for_sm90(kernel, types, constexprs, options, attrs)
        assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]
        shared = compiled.metadata.shared
        assert shared <= H100_SHARED_BYTES, f"{shared} bytes of shared memory, the H100 has {H100_SHARED_BYTES}"
        # a kernel that may start before the one ahead has finished must wait for it before it reads
        assert not options.get("launch_pdl") or "griddepcontrol.wait" in compiled.asm["ptx"], \
            "launched with PDL but never waits (grid_dependency_wait) for the kernel ahead"
        return f"OK   {kernel.fn.__name__}({shown})"
    except Exception as exc:  # the compiler's own errors, shown per kernel
        return f"FAIL {kernel.fn.__name__}({shown}): {type(exc).__name__}: {exc}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes compiling at once (forked; each compile is Python and ptxas)")
    args = parser.parse_args()
    _LAUNCHES[:] = captured_launches()
    if args.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            lines = list(pool.map(check_one, range(len(_LAUNCHES))))
    else:
        lines = [check_one(i) for i in range(len(_LAUNCHES))]
    for line in lines:
        print(line, flush=True)
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
