"""Mixture-of-experts MLP: each token runs through its top-k experts' gated MLPs and the outputs
are summed, weighted by the router.

    y[t] = sum_j weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert[t, j]

Shapes: x [T, H]; w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows); w_down
[E, H, I]; the router's choice topk_weights [T, K] (fp32) and topk_ids [T, K]. A "pair" is one
(token, choice) of the T * K, numbered t * K + j.

The Triton path (fused_moe_triton) never copies activations per expert. `align_by_expert_*`
sorts the pairs by expert and pads each expert's run to a multiple of the kernel's BLOCK_M, so
that one program's rows all belong to one expert; the gate/up kernel gathers those tokens' rows
of x itself, applies SiLU-and-mul and writes the [T * K, I] intermediate by pair; the down kernel
reads it back by pair, scales by the routing weight and writes [T * K, H], which a sum over K
reduces to [T, H]. Every size is fixed by T, K, E and BLOCK_M (the padding is bounded, the
programs past the last expert's blocks exit), so a decode step can be captured in a CUDA graph:
nothing is read back to the host.

With fp8 experts (`--quantization fp8`: weights e4m3 with one scale per output row of each
expert, `quantize_experts_fp8`) both GEMMs take fp8 inputs as fp8_linear does: x is quantised per
token, the SiLU-and-mul output per pair (quantize_fp8_rows, one launch each), and the products
are scaled back in fp32 (fp8 tensor cores; half the weight bytes of bf16 for the decode steps).

The reference (fused_moe_ref) loops over the experts that have tokens, as transformers does: the
CPU path and the test oracle.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._triton import cdiv, dot, fast_launch, next_power_of_2, tl, triton
from .fp8_linear import fp8_linear_ref, quantize_fp8_rows_triton, quantize_fp8_weight


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, K], expert ids int32 [T, K]): softmax over all experts (fp32), the top k.
    renormalize: the k weights are divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob),
    which is exactly a softmax over the k chosen logits (Mixtral's "top-k then softmax"): softmax
    is monotonic, so both choose the same experts. Otherwise they keep their share of all E."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def quantize_experts_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (fp8 [E, N, K], fp32 scales [E, N]): each expert's rows as quantize_fp8_weight."""
    experts, rows, cols = weight.shape
    q, scale = quantize_fp8_weight(weight.reshape(experts * rows, cols))
    return q.view(experts, rows, cols), scale.view(experts, rows)


def _expert_linear(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    if scale is None:
        return F.linear(a, weight[expert])
    return fp8_linear_ref(a, weight[expert], scale[expert][None, :])


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                  w_down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] in x's dtype; each expert's projections in x's dtype, as transformers computes them.
    With the scales (fp8 weights, quantize_experts_fp8's) each projection is fp8_linear's."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten().long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()  # host sync: the CPU path
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    inter = w_down.shape[2]
    for expert, pairs in enumerate(torch.split(order, counts)):
        if not len(pairs):
            continue
        tokens = pairs // top_k
        gate_up = _expert_linear(x[tokens], w_gate_up, w_gate_up_scale, expert)
        hidden = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(x.dtype)
        y = _expert_linear(hidden, w_down, w_down_scale, expert).float() * topk_weights.flatten()[pairs, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


class MoEPlan(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Decode-sized groups (a few pairs per expert) stream the experts' weights: short row blocks,
# long K blocks. Prefill-sized groups are GEMMs: larger tiles. LARGE_PLAN is moe_bench.py --tune's
# best on the H100 for qwen3-30b-a3b at 2048, 4096 and 8192 tokens (192-768 pairs an expert):
# 728 / 1147 / 1999 us against 804 / 1287 / 2305 us with PREFILL_PLAN's 64 rows; the others are
# untuned guesses (--tune and --plan time any other).
DECODE_PLAN = MoEPlan(16, 64, 128, 4, 3)
MID_PLAN = MoEPlan(32, 64, 128, 4, 3)
PREFILL_PLAN = MoEPlan(64, 128, 64, 8, 3)
LARGE_PLAN = MoEPlan(128, 128, 64, 8, 3)


def moe_plan(num_pairs: int, num_experts: int) -> MoEPlan:
    """The plan for T * K pairs over E experts, by the mean group size (host ints only). A
    group's size varies about its mean (Poisson-like under a balanced router), so a block takes
    half as many rows again as the mean: a group rarely spills into a second block, which would
    read the expert's weights twice."""
    per_expert = 1.5 * num_pairs / num_experts
    if per_expert <= DECODE_PLAN.block_m:
        return DECODE_PLAN
    if per_expert <= MID_PLAN.block_m:
        return MID_PLAN
    return PREFILL_PLAN if per_expert <= PREFILL_PLAN.block_m else LARGE_PLAN


def padded_pairs_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most sorted (padded) slots any routing needs: each expert that has a pair wastes at
    most block_m - 1 slots, and at most min(E, pairs) experts have one. A multiple of block_m."""
    return cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P] int32, block_experts [P / block_m] int32), P = padded_pairs_bound.

    sorted_pairs lists the pairs expert by expert (stable: in pair order within an expert), each
    expert's run padded to a multiple of block_m with the sentinel T * K; block_experts[b] is the
    expert of rows [b * block_m, (b + 1) * block_m), and num_experts for the blocks past the last
    run. Torch ops on the device, none of them reading a value back to the host (about 25
    launches: align_by_expert_triton does it in one)."""
    flat = topk_ids.flatten()
    num_pairs = flat.shape[0]
    size = padded_pairs_bound(num_pairs, num_experts, block_m)
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype))
    counts = bounds[1:] - bounds[:-1]
    padded_ends = torch.cumsum(cdiv_tensor(counts, block_m) * block_m, 0)
    padded_starts = padded_ends - cdiv_tensor(counts, block_m) * block_m
    rank = torch.arange(num_pairs, device=flat.device) - bounds[:-1][sorted_experts.long()]
    sorted_pairs = torch.full((size,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[padded_starts[sorted_experts.long()] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=flat.device, dtype=padded_ends.dtype)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


def cdiv_tensor(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + b - 1) // b


ALIGN_BLOCK = 1024  # ids a step of the alignment's loops: a prefill's 32768 pairs in 32 steps


@fast_launch
@triton.jit
def _align_kernel(ids_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts, num_slots,
                  BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program e < E writes expert e's run (its pairs in order, then the padding) and its blocks'
    expert; program E the tail past the last run. Each first counts every expert's pairs itself
    (a histogram of all the ids): redundant, but no program waits for another. EXPERTS > E: the
    masked lanes count in bin E, which no run includes."""
    expert = tl.program_id(0)
    lanes = tl.arange(0, EXPERTS)
    pair_lanes = tl.arange(0, BLOCK)
    counts = tl.zeros([EXPERTS], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        ids = tl.load(ids_ptr + start + pair_lanes, mask=start + pair_lanes < num_pairs, other=num_experts)
        counts += tl.histogram(ids, EXPERTS)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_start = tl.sum(tl.where(lanes < expert, padded, 0))
    if expert < num_experts:
        count = tl.sum(tl.where(lanes == expert, counts, 0))
        run_end = run_start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        written = run_start
        for start in range(0, num_pairs, BLOCK):
            pairs = start + pair_lanes
            match = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) == expert
            rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
            tl.store(sorted_pairs_ptr + written + rank, pairs, mask=match)
            written += tl.sum(match.to(tl.int32))
        pad = written + tl.arange(0, BLOCK_M)
        tl.store(sorted_pairs_ptr + pad, num_pairs, mask=pad < run_end)
        fill_expert = expert
    else:  # the tail: slots past the last run hold the sentinel pair, its blocks the sentinel expert
        run_end = num_slots
        for slot in range(run_start, num_slots, BLOCK):
            tail = slot + pair_lanes
            tl.store(sorted_pairs_ptr + tail, num_pairs, mask=tail < num_slots)
        fill_expert = num_experts
    for block in range(run_start // BLOCK_M, run_end // BLOCK_M, BLOCK):
        blocks = block + pair_lanes
        tl.store(block_experts_ptr + blocks, fill_expert, mask=blocks < run_end // BLOCK_M)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert_ref's result in one launch of E + 1 programs."""
    flat = topk_ids.flatten()
    num_pairs = flat.shape[0]
    size = padded_pairs_bound(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=flat.device)
    experts = next_power_of_2(num_experts + 1)
    block = max(16, min(next_power_of_2(num_pairs), ALIGN_BLOCK))
    _align_kernel[(num_experts + 1,)](flat, sorted_pairs, block_experts, num_pairs, num_experts, size, BLOCK_M=block_m,
                                      EXPERTS=experts, BLOCK=block, num_warps=4)
    return sorted_pairs, block_experts


@fast_launch
@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, sorted_pairs_ptr, block_experts_ptr, out_ptr,
                        num_pairs, top_k, num_experts, hidden, inter, x_stride, w_expert_stride, w_row_stride,
                        w_scale_stride, out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FP8: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Rows: one block of sorted pairs (one expert); columns: BLOCK_N of the I gate columns and the
    same of the up columns. out[pair, cols] = silu(x[token] . gate) * (x[token] . up). FP8: x and
    the weights are fp8, the sums scaled by x's row scale and the weights' column scales."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < num_experts:  # blocks past the last expert's run hold no pairs
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = pairs < num_pairs
        tokens = (pairs // top_k).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < inter
        w_gate = w_ptr + expert.to(tl.int64) * w_expert_stride + cols[None, :].to(tl.int64) * w_row_stride
        w_up = w_gate + inter * w_row_stride
        ks = tl.arange(0, BLOCK_K)
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + ks
            k_mask = kk < hidden
            a = tl.load(x_ptr + tokens[:, None] * x_stride + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w_mask = col_mask[None, :] & k_mask[:, None]
            acc_gate += dot(a, tl.load(w_gate + kk[:, None], mask=w_mask, other=0.0), DOT_UPCAST)
            acc_up += dot(a, tl.load(w_up + kk[:, None], mask=w_mask, other=0.0), DOT_UPCAST)
        if FP8:
            x_scale = tl.load(x_scale_ptr + tokens, mask=row_mask, other=0.0)[:, None]
            w_scales = w_scale_ptr + expert.to(tl.int64) * w_scale_stride + cols
            acc_gate *= x_scale * tl.load(w_scales, mask=col_mask, other=0.0)[None, :]
            acc_up *= x_scale * tl.load(w_scales + inter, mask=col_mask, other=0.0)[None, :]
        # gate and up rounded to the output's dtype first, as the reference (and transformers) compute them
        gate = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


@fast_launch
@triton.jit
def _moe_down_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, sorted_pairs_ptr, block_experts_ptr, pair_weights_ptr,
                     out_ptr, num_pairs, num_experts, hidden, inter, a_stride, w_expert_stride, w_row_stride,
                     w_scale_stride, out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP8: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """out[pair, cols] = weight[pair] * (a[pair] . down rows cols), for one block of sorted pairs
    (FP8: scaled as in the gate/up kernel)."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < num_experts:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = pairs < num_pairs
        rows = pairs.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < hidden
        w_rows = w_ptr + expert.to(tl.int64) * w_expert_stride + cols[None, :].to(tl.int64) * w_row_stride
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + ks
            k_mask = kk < inter
            a = tl.load(a_ptr + rows[:, None] * a_stride + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            acc += dot(a, tl.load(w_rows + kk[:, None], mask=col_mask[None, :] & k_mask[:, None], other=0.0),
                       DOT_UPCAST)
        if FP8:
            acc *= tl.load(a_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
            acc *= tl.load(w_scale_ptr + expert.to(tl.int64) * w_scale_stride + cols, mask=col_mask, other=0.0)[None, :]
        # the expert's output rounded to x's dtype before it is weighted, as the reference
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.load(pair_weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                     w_down_scale: torch.Tensor | None = None, plan: MoEPlan | None = None) -> torch.Tensor:
    """fused_moe_ref's result through the two grouped-GEMM kernels; `plan` overrides moe_plan."""
    assert x.stride(-1) == 1 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.empty_like(x)
    plan = plan or moe_plan(num_pairs, num_experts)
    sorted_pairs, block_experts = align_by_expert_triton(topk_ids, num_experts, plan.block_m)
    fp8 = w_gate_up_scale is not None
    blocks, upcast = block_experts.shape[0], not x.is_cuda
    options = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, FP8=fp8, DOT_UPCAST=upcast,
                   num_warps=plan.num_warps, num_stages=plan.num_stages)
    a, a_scale = quantize_fp8_rows_triton(x) if fp8 else (x, x)  # x: an unused pointer without fp8
    scale = w_gate_up_scale if fp8 else x
    hidden_by_pair = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(blocks, cdiv(inter, plan.block_n))](
        a, w_gate_up, a_scale, scale, sorted_pairs, block_experts, hidden_by_pair, num_pairs, top_k, num_experts,
        hidden, inter, a.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), scale.stride(0),
        hidden_by_pair.stride(0), **options)
    a, a_scale = quantize_fp8_rows_triton(hidden_by_pair) if fp8 else (hidden_by_pair, x)
    scale = w_down_scale if fp8 else x
    out_by_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    pair_weights = topk_weights.float().contiguous()
    _moe_down_kernel[(blocks, cdiv(hidden, plan.block_n))](
        a, w_down, a_scale, scale, sorted_pairs, block_experts, pair_weights, out_by_pair, num_pairs, num_experts,
        hidden, inter, a.stride(0), w_down.stride(0), w_down.stride(1), scale.stride(0), out_by_pair.stride(0),
        **options)
    return out_by_pair.view(tokens, top_k, hidden).sum(dim=1)
