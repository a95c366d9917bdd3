"""Mixture-of-experts MLP: each token runs through its top-k experts' gated MLPs and the outputs
are summed, weighted by the router.

    y[t] = sum_j weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert[t, j]

Shapes: x [T, H]; w_gate_up [E, 2I, H], each expert's gate and up rows interleaved (row 2i its
gate row i, row 2i + 1 its up row i: interleave_gate_up), so that one tile of 2n rows holds n gate
rows and the n up rows they multiply; w_down [E, H, I]; the router's choice topk_weights [T, K]
(fp32) and topk_ids [T, K]. A "pair" is one (token, choice) of the T * K, numbered t * K + j.

The Triton path (fused_moe_triton) never copies activations per expert. `align_by_expert_*`
sorts the pairs by expert and pads each expert's run to a multiple of the kernel's BLOCK_M, so
that one program's rows all belong to one expert; the gate/up kernel gathers those tokens' rows
of x itself, multiplies them by a tile of gate/up rows in one dot, applies SiLU-and-mul to the
interleaved columns and writes the [T * K, I] intermediate by pair; the down kernel
reads it back by pair, scales by the routing weight and writes [T * K, H], which a sum over K
reduces to [T, H]. Every size is fixed by T, K, E and BLOCK_M (the padding is bounded, the
programs past the last expert's blocks exit), so a decode step can be captured in a CUDA graph:
nothing is read back to the host.

With fp8 experts (`--quantization fp8`: weights e4m3 with one scale per output row of each
expert, `quantize_experts_fp8`) both GEMMs take fp8 inputs as fp8_linear does: x is quantised per
token, the SiLU-and-mul output per pair (quantize_fp8_rows, one launch each), and the products
are scaled back in fp32 (fp8 tensor cores; half the weight bytes of bf16 for the decode steps).

MXFP4 experts (gpt-oss's checkpoints: weights of dtype uint8, two e2m1 values a byte, the low
nibble first, with a uint8 e8m0 scale, 2^(s - 127), for each 32 values along K) stay packed in
memory, a quarter of bf16's bytes, and both kernels widen each weight tile to the activations'
dtype as they load it (weight-only: Hopper has no FP4 tensor cores). gpt-oss also adds a bias to
each expert's gate/up and down outputs and replaces silu(gate) * up by its clamped SwiGLU
(`swiglu` = (alpha, limit): (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)).

The reference (fused_moe_ref) loops over the experts that have tokens, as transformers does: the
CPU path and the test oracle.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._triton import cdiv, dot, fast_launch, next_power_of_2, tl, triton, use_descriptor_allocator
from .fp8_linear import FP8, fp8_linear_ref, quantize_fp8_rows_triton, quantize_fp8_weight


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


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, I, H] gate and up projections -> w_gate_up [E, 2I, H]: row 2i is gate row i, 2i + 1 up row i."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def quantize_experts_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (fp8 [E, N, K], fp32 scales [E, N]): each expert's rows as quantize_fp8_weight."""
    experts, rows, cols = weight.shape
    q, scale = quantize_fp8_weight(weight.reshape(experts * rows, cols))
    return q.view(experts, rows, cols), scale.view(experts, rows)


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values along K that share one scale


def fp4_values(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K / 2] -> the fp4 values, unscaled, float32 [..., N, K]."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    return torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., N, K / 2] (value 2i in byte i's low nibble, 2i + 1 in its high one) and
    scales uint8 [..., N, K / 32] -> [..., N, K] in dtype."""
    values = fp4_values(blocks)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(MXFP4_GROUP, dim=-1)
    return (values * scale).to(dtype)


# fp4's largest value (6) times 2^6 is e4m3's 384, within its 448: a row's largest scale group lands there
MXFP4_FP8_SHIFT = 6


def mxfp4_to_fp8(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dequantize_mxfp4's arguments -> (fp8 [..., N, K], fp32 scales [..., N]) holding the same values:
    each row's scale is a power of two, 2^(its largest scale group's exponent - MXFP4_FP8_SHIFT), so
    every fp4 value (at most two significant bits) times its group's power of two lands on an e4m3
    value. Exact for every group less than 15 binades below its row's largest; values of groups
    further below round to e4m3's subnormals (2^-9 apart), as quantize_fp8_weight rounds any row.
    quantize_fp8_weight's scales (largest |w| to 448) would round most values instead."""
    values = fp4_values(blocks)
    top = scales.amax(dim=-1, keepdim=True).float()
    shift = torch.exp2(scales.float() - top + MXFP4_FP8_SHIFT).repeat_interleave(MXFP4_GROUP, dim=-1)
    return (values * shift).to(FP8), torch.exp2(top.squeeze(-1) - 127 - MXFP4_FP8_SHIFT)


def _expert_linear(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, expert: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == torch.uint8:
        y = F.linear(a, dequantize_mxfp4(weight[expert], scale[expert], a.dtype))
    elif scale is None:
        y = F.linear(a, weight[expert])
    else:
        y = fp8_linear_ref(a, weight[expert], scale[expert][None, :])
    return y if bias is None else y + bias[expert]


def moe_activation(gate_up: torch.Tensor, swiglu: tuple[float, float] | None, gelu: bool = False) -> torch.Tensor:
    """[P, 2I] interleaved gate/up -> [P, I] fp32: silu(gate) * up, GELU's tanh form of gate times up
    (`gelu`, Gemma 4), or gpt-oss's clamped SwiGLU."""
    gate, up = gate_up[:, 0::2].float(), gate_up[:, 1::2].float()
    if gelu:
        return F.gelu(gate, approximate="tanh") * up
    if swiglu is None:
        return F.silu(gate) * up
    alpha, limit = swiglu
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                  w_down_scale: torch.Tensor | None = None, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None,
                  gelu: bool = False) -> torch.Tensor:
    """[T, H] in x's dtype; each expert's projections in x's dtype, as transformers computes them.
    With the scales (fp8 weights, quantize_experts_fp8's) each projection is fp8_linear's; uint8
    weights are MXFP4, dequantised to x's dtype. Biases [E, 2I] (interleaved as w_gate_up's rows)
    and [E, H]."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten().long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()  # host sync: the CPU path
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert, pairs in enumerate(torch.split(order, counts)):
        if not len(pairs):
            continue
        tokens = pairs // top_k
        gate_up = _expert_linear(x[tokens], w_gate_up, w_gate_up_scale, expert, gate_up_bias)
        hidden = moe_activation(gate_up, swiglu, gelu).to(x.dtype)
        y = _expert_linear(hidden, w_down, w_down_scale, expert, down_bias).float()
        y = y * topk_weights.flatten()[pairs, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


class MoEPlan(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # The order of the programs (moe_tile): group_m row blocks at a time run across all their
    # column tiles, so that a block's gathered rows are read from memory once and then from L2.
    # 0: every row block for one column tile, then the next column tile (each block's rows read
    # again for every column tile).
    group_m: int = 0
    # The gate/up kernel's weight tiles through a tensor descriptor (Hopper's TMA: one copy a tile,
    # no per-thread address arithmetic) where the weights allow one (moe_gate_up_triton); else, and
    # in the down kernel (no faster there), per-thread loads.
    tma: bool = False


# Decode-sized groups (a few pairs per expert) stream the experts' weights: short row blocks, long K
# blocks. Prefill-sized groups are GEMMs: larger tiles. Groups of over 64 pairs an expert take
# LARGE_PLANS: moe_bench.py --tune's best on the H100 for qwen3-30b-a3b, each kernel tuned alone,
# (gate/up, down) for bf16 and for fp8 experts (K blocks of 128 bytes, 64-row blocks): tiles at 4096
# and 8192 tokens (2026-11-25, 724aef1), program order and bf16 stages at 4096 and 16384
# (2026-11-27, 369b8ba and b225fa2: moe_bench.py --groups 0,1,8, --tune --tune-rows 128
# --tune-groups 1,8). The grouped order took the whole layer at 16384 tokens from 3002 to 2866 us
# (bf16, the 2026-11-25 tiles; 2797 us with three stages) and 2666 to 2539 us (fp8, group 8); at
# 4096, 946 to 845 us (bf16). Decode rows moved by under 2% either way (group 1 kept). The bf16
# gate/up kernel takes four stages (H100, 2026-11-27, 077ff35): faster than three in three tunes of
# four (16384 tokens: 1600.4/1612.5/1614.7 against 1609.5/1640.4/1676.6 us; 4096: 506.4 against
# 536.3 us), ~1% slower in one. Since 9807f0b (H200, 2026-12-01, against 7ab2b99 in the same
# process, moe_ab.py) the gate/up weight rows are interleaved and multiplied in one dot, the large
# plans' gate/up tiles come through TMA, and both kernels take H and I as constexprs (no column
# masks where the tiles divide them): bf16 alone at 16384 tokens, gate/up 1567-1572 against
# 1693-1696 us, down 913-916 against 949-951 (the two 50.3-50.4% of bf16 peak against 47.3%); fp8
# gate/up 1176-1180 against 1249-1252. One dot with per-thread loads alone was slower (H100,
# 2026-11-27, 492ae4a); TMA alone, or one dot alone, gained ~2%. The fp8 gate/up plan was retuned
# for the one dot (its two 256-column dots became one of 512 columns, 2.5x slower):
# (64, 64, 128, 4, 3). Decode plans keep loads (with TMA 6% slower at batch 1, within 2% at 64 and
# 256), the down kernel too (TMA no faster). PREFILL_PLAN is an untuned guess.
DECODE_PLAN = MoEPlan(16, 64, 128, 4, 3, group_m=1)
MID_PLAN = MoEPlan(32, 64, 128, 4, 3, group_m=1)
PREFILL_PLAN = MoEPlan(64, 128, 64, 8, 3, group_m=1)
# fp8 experts take K blocks of 128 bytes from prefill-sized groups on, and the large plans' down kernel
# 128 columns in four warps: moe_bench.py --shape gpt-oss-20b --fp8 --tune --tune-rows auto (H200,
# 2026-12-04, 00cc996) took the layer at 256 tokens from 341.6 to 246.7 us (PREFILL_PLAN's K blocks of
# 64 before), and the down kernel's best at 1024, 2048 and 8192 tokens was (64, 128, 128, 4, 3): the
# layer 453.2 -> 432.1, 755.7 -> 740.3 and 2623.0 -> 2565.5 us, its gate/up weights then loaded
# without TMA (moe_gate_up_triton: no TMA where the K blocks do not divide H). On qwen3-30b-a3b's
# shape (H200, same day, 371809e against the old plans): 512 tokens 199.0 against 279.2 us, 1024
# 244.8 against 258.2, 16384 2116.0 against 2308.9.
FP8_PREFILL_PLAN = MoEPlan(64, 64, 128, 4, 3, group_m=8)
LARGE_PLANS = {False: (MoEPlan(128, 128, 64, 8, 4, group_m=1, tma=True), MoEPlan(128, 256, 64, 8, 3, group_m=1)),
               True: (MoEPlan(64, 64, 128, 4, 3, group_m=8, tma=True), MoEPlan(64, 128, 128, 4, 3, group_m=8))}
LARGE_PLAN = LARGE_PLANS[False][0]


def moe_plan(num_pairs: int, num_experts: int) -> MoEPlan:
    """The bf16 gate/up plan for T * K pairs over E experts, by the mean group size (host ints
    only). A group's size varies about its mean (Poisson-like under a balanced router), so a
    block takes half as many rows again as the mean: a group rarely spills into a second block,
    which would read the expert's weights twice."""
    per_expert = 1.5 * num_pairs / num_experts
    if per_expert <= DECODE_PLAN.block_m:
        return DECODE_PLAN
    if per_expert <= MID_PLAN.block_m:
        return MID_PLAN
    return PREFILL_PLAN if per_expert <= PREFILL_PLAN.block_m else LARGE_PLAN


# MXFP4 experts (gpt-oss) take plans of their own, no TMA (the packed tiles are loaded and decoded):
# moe_bench.py --shape gpt-oss-20b --mxfp4 --tune --tune-rows auto on an H200 (2026-12-03, f364e28 and
# f662c0f, two leases, the same best plans): at a decode step's 16-row blocks the narrow 32-column
# tiles over K blocks of 128 took the layer from 138.1 to 86.6-86.9 us (gate/up 50.3 against ~84,
# down 28.8 against ~49); at 64-row blocks (256 tokens) 32 columns for gate/up and 64 for down, K
# blocks of 64, from 694.6-696.8 to 622.8-629.2 us. The large plans' K blocks are cut to 64 (two
# scale groups; 128 asks more shared memory than the H200 has at those tiles). The rows tried
# beside them (K blocks 64-256, 16-128 columns, 4 or 8 warps, 2-3 stages; and two dots over the
# even and odd K positions, or the weights as wgmma's register operand, in place of one dot over
# the interleaved tile: 1.1-2.9x slower at every size) are in docs/benchmarks.md.
MXFP4_DECODE_PLANS = (MoEPlan(16, 32, 128, 4, 3), MoEPlan(16, 32, 128, 4, 3))
MXFP4_MAX_BLOCK_K = 64


def mxfp4_plans(plans: tuple[MoEPlan, MoEPlan]) -> tuple[MoEPlan, MoEPlan]:
    """moe_plans' (gate/up, down) for MXFP4 experts, from the bf16 ones of the same row block."""
    gate_up, down = plans
    if gate_up == DECODE_PLAN:
        return MXFP4_DECODE_PLANS
    if gate_up in (MID_PLAN, PREFILL_PLAN):
        return (MoEPlan(gate_up.block_m, 32, 64, 4, 3), MoEPlan(gate_up.block_m, 64, 64, 4, 3))
    return tuple(p._replace(block_k=min(p.block_k, MXFP4_MAX_BLOCK_K), tma=False) for p in plans)


def moe_plans(num_pairs: int, num_experts: int, fp8: bool = False, mxfp4: bool = False) -> tuple[MoEPlan, MoEPlan]:
    """(gate/up plan, down plan) for T * K pairs over E experts; the two share the row block,
    which the alignment fixes."""
    plan = moe_plan(num_pairs, num_experts)
    if plan == LARGE_PLAN:
        plans = LARGE_PLANS[fp8]
    else:
        plans = (FP8_PREFILL_PLAN,) * 2 if fp8 and plan == PREFILL_PLAN else (plan, plan)
    return mxfp4_plans(plans) if mxfp4 else plans


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


ALIGN_BLOCK = 1024  # ids a step of the one-launch alignment's loops, and the smallest chunk of the chunked one


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


@fast_launch
@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, num_pairs, num_experts, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    """hist[c, e]: how many of chunk c's pairs chose expert e (masked lanes count in bin E)."""
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=num_experts)
    tl.store(hist_ptr + chunk * EXPERTS + tl.arange(0, EXPERTS), tl.histogram(ids, EXPERTS))


@fast_launch
@triton.jit
def _align_runs_kernel(hist_ptr, offsets_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts,
                       num_chunks, num_slots, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNKS: tl.constexpr,
                       FILL: tl.constexpr):
    """Program e < E: expert e's run from the chunks' histograms: where each chunk's pairs of e
    start (offsets[c, e]), the run's padding and its blocks' expert; program E the tail."""
    expert = tl.program_id(0)
    lanes = tl.arange(0, EXPERTS)
    chunks = tl.arange(0, CHUNKS)
    hist = tl.load(hist_ptr + chunks[:, None] * EXPERTS + lanes[None, :], mask=chunks[:, None] < num_chunks, other=0)
    padded = (tl.sum(hist, axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_start = tl.sum(tl.where(lanes < expert, padded, 0))
    lane_fill = tl.arange(0, FILL)
    if expert < num_experts:
        column = tl.sum(tl.where(lanes[None, :] == expert, hist, 0), axis=1)
        tl.store(offsets_ptr + chunks * EXPERTS + expert, run_start + tl.cumsum(column, axis=0) - column,
                 mask=chunks < num_chunks)
        count = tl.sum(column)
        run_end = run_start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad = run_start + count + tl.arange(0, BLOCK_M)
        tl.store(sorted_pairs_ptr + pad, num_pairs, mask=pad < run_end)
        fill_expert = expert
    else:
        run_end = num_slots
        for slot in range(run_start, num_slots, FILL):
            tl.store(sorted_pairs_ptr + slot + lane_fill, num_pairs, mask=slot + lane_fill < num_slots)
        fill_expert = num_experts
    for block in range(run_start // BLOCK_M, run_end // BLOCK_M, FILL):
        blocks = block + lane_fill
        tl.store(block_experts_ptr + blocks, fill_expert, mask=blocks < run_end // BLOCK_M)


@fast_launch
@triton.jit
def _align_place_kernel(ids_ptr, hist_ptr, offsets_ptr, sorted_pairs_ptr, num_pairs, EXPERTS: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Program (c, e): chunk c's pairs of expert e, in order, from offsets[c, e] on."""
    chunk, expert = tl.program_id(0), tl.program_id(1)
    if tl.load(hist_ptr + chunk * EXPERTS + expert) > 0:
        pairs = chunk * CHUNK + tl.arange(0, CHUNK)
        match = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) == expert
        rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
        tl.store(sorted_pairs_ptr + tl.load(offsets_ptr + chunk * EXPERTS + expert) + rank, pairs, mask=match)


ALIGN_ONE_LAUNCH_PAIRS = 4096  # up to this many pairs (decode steps) one launch; above, chunks in parallel
ALIGN_MAX_CHUNKS = 64


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert_ref's result. Up to ALIGN_ONE_LAUNCH_PAIRS pairs in one launch of E + 1
    programs, each of which reads every id (no program waits for another). Above, that serial
    scan grows with the pairs (57 us at 32768 on an H100), so the ids are cut into at most
    ALIGN_MAX_CHUNKS chunks: one launch counts each chunk's experts, one lays out the runs from
    those counts, one places each (chunk, expert)'s pairs, all in parallel."""
    flat = topk_ids.flatten()
    num_pairs = flat.shape[0]
    size = padded_pairs_bound(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=flat.device)
    experts = next_power_of_2(num_experts + 1)
    if num_pairs <= ALIGN_ONE_LAUNCH_PAIRS:
        block = max(16, min(next_power_of_2(num_pairs), ALIGN_BLOCK))
        _align_kernel[(num_experts + 1,)](flat, sorted_pairs, block_experts, num_pairs, num_experts, size,
                                          BLOCK_M=block_m, EXPERTS=experts, BLOCK=block, num_warps=4)
        return sorted_pairs, block_experts
    chunk = max(ALIGN_BLOCK, next_power_of_2(cdiv(num_pairs, ALIGN_MAX_CHUNKS)))
    num_chunks = cdiv(num_pairs, chunk)
    hist = torch.empty(num_chunks, experts, dtype=torch.int32, device=flat.device)
    offsets = torch.empty(num_chunks, experts, dtype=torch.int32, device=flat.device)
    _align_count_kernel[(num_chunks,)](flat, hist, num_pairs, num_experts, EXPERTS=experts, CHUNK=chunk, num_warps=4)
    _align_runs_kernel[(num_experts + 1,)](hist, offsets, sorted_pairs, block_experts, num_pairs, num_experts,
                                           num_chunks, size, BLOCK_M=block_m, EXPERTS=experts,
                                           CHUNKS=max(2, next_power_of_2(num_chunks)), FILL=1024, num_warps=8)
    _align_place_kernel[(num_chunks, num_experts)](flat, hist, offsets, sorted_pairs, num_pairs, EXPERTS=experts,
                                                   CHUNK=chunk, num_warps=4)
    return sorted_pairs, block_experts


@triton.jit
def moe_tile(num_blocks, num_cols, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program in a 1-D grid of num_blocks * num_cols. GROUP_M 0:
    row blocks fastest (a column tile's every block, then the next tile). GROUP_M g: g row blocks
    at a time over all the column tiles, the g blocks fastest: their rows (up to g * BLOCK_M of
    the gathered activations) stay in L2 while every column tile reads them, and the blocks of one
    expert share its weight tile. Blocks past the last expert's run come last either way."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        block = pid % num_blocks
        col_tile = pid // num_blocks
    else:
        per_group = GROUP_M * num_cols
        first = pid // per_group * GROUP_M
        rows = tl.minimum(num_blocks - first, GROUP_M)
        block = first + pid % per_group % rows
        col_tile = pid % per_group // rows
    return block, col_tile


@triton.jit
def mxfp4_bits(nibble, exponent):
    """The fp32 bit patterns of e2m1 values (int32 nibbles: sign, 2 exponent bits of bias 1, 1
    mantissa bit) times their scales 2^(s - 127), exponent = s << 23 (an E8M0 scale is an fp32
    exponent field): |value| = 2^(e - 1) (1 + m / 2) for e >= 1 has exponent field s + e - 1 and
    mantissa bit m, i.e. (s << 23) + ((em - 2) << 22) with em = nibble & 7; 0.5 (em 1) has field
    s - 1, (s << 23) - (2 << 22); em 0 is zero. Exact (equal to dequantize_mxfp4's bits) for
    2 <= s <= 252, where every product is a normal fp32 (checkpoints' scales lie far inside)."""
    em = nibble & 7
    offset = em - 2 - (em == 1).to(tl.int32)
    magnitude = tl.where(em == 0, 0, exponent + (offset << 22))
    return magnitude | ((nibble & 8) << 28)


@triton.jit
def load_mxfp4_tile(w_rows, scale_rows, k0, col_mask, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    dtype: tl.constexpr):
    """(even, odd): the [BLOCK_K / 2, cols] weights of MXFP4 rows at K positions k0 + 2i and k0 + 2i + 1
    (byte i's low and high nibble), widened to dtype; w_rows [1, cols] each column's packed row (K / 2
    bytes), scale_rows its K / 32 scales, col_mask [1, cols]. Each byte and each scale is loaded once
    and decoded with integer operations (mxfp4_bits): the multiplier of the old per-value decode
    (two loads a byte, a scale gathered per value, exp2 and float selects on [BLOCK_K, cols] fp32
    tiles) made the gate/up kernel 4.7 ms a call at batch 1 (H200). BLOCK_K: a multiple of 32."""
    cols: tl.constexpr = col_mask.shape[1]
    byte_k = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_rows + byte_k[:, None], mask=col_mask & ((byte_k < K // 2) | EVEN_K)[:, None], other=0)
    packed = packed.to(tl.int32)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(scale_rows + groups[:, None], mask=col_mask & ((groups < K // 32) | EVEN_K)[:, None], other=127)
    exponent = scales.to(tl.int32) << 23  # [BLOCK_K / 32, cols], each for 16 bytes
    exponent = tl.reshape(tl.broadcast_to(exponent[:, None, :], [BLOCK_K // 32, 16, cols]), [BLOCK_K // 2, cols])
    even = mxfp4_bits(packed & 15, exponent).to(tl.float32, bitcast=True).to(dtype)
    odd = mxfp4_bits(packed >> 4, exponent).to(tl.float32, bitcast=True).to(dtype)
    return even, odd


@triton.jit
def mxfp4_dot(a, w_rows, scale_rows, k0, col_mask, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              DOT_UPCAST: tl.constexpr):
    """a [rows, BLOCK_K] times the MXFP4 weights' [BLOCK_K, cols] tile at k0, its rows interleaved from
    the low and the high nibbles' (one dot: two of half the K, one by each, spilled registers at the
    large plans, 376 bytes a thread against 8 in the sm90 compile)."""
    w_even, w_odd = load_mxfp4_tile(w_rows, scale_rows, k0, col_mask, K, BLOCK_K, EVEN_K, a.dtype)
    w = tl.reshape(tl.permute(tl.join(w_even, w_odd), (0, 2, 1)), [BLOCK_K, w_even.shape[1]])
    return dot(a, w, DOT_UPCAST)


@fast_launch
@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, sorted_pairs_ptr, block_experts_ptr, out_ptr,
                        num_pairs, top_k, num_experts, x_stride, w_expert_stride, w_row_stride,
                        w_scale_stride, out_stride, num_blocks, num_cols, swiglu_alpha, swiglu_limit,
                        BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, DOT_UPCAST: tl.constexpr,
                        EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                        EVEN_N: tl.constexpr, TMA: tl.constexpr, MXFP4: tl.constexpr, BIAS: tl.constexpr,
                        SWIGLU: tl.constexpr, GELU: tl.constexpr):
    """Rows: one block of sorted pairs (one expert); columns: BLOCK_N of the I outputs, from the
    2 * BLOCK_N interleaved gate/up weight rows that make them, multiplied in one dot.
    out[pair, c] = silu(x[token] . gate_c) * (x[token] . up_c). FP8: x and the weights are fp8, the
    sums scaled by x's row scale and the weights' row scales. EVEN_K: BLOCK_K divides H, so the K
    loop's loads need no K mask. TMA: the weight tiles through a descriptor over every expert's rows
    (experts back to back): rows past the expert's 2I belong to the next one (or lie past the end,
    read as zeros) and give only masked columns; a K tail past H reads as zeros. MXFP4: the weights
    are packed (w_row_stride bytes a row, scales HIDDEN / 32 a row), widened as loaded; BIAS: the
    expert's gate/up bias added before the activation; SWIGLU: gpt-oss's clamped SwiGLU; GELU: GELU's
    tanh form in place of silu (g (1 + tanh(u)) / 2 = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3))."""
    block, col_tile = moe_tile(num_blocks, num_cols, GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < num_experts:  # blocks past the last expert's run hold no pairs
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = pairs < num_pairs
        tokens = (pairs // top_k).to(tl.int64)
        w_rows = col_tile * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # this tile's rows of the expert's 2I
        w_row_mask = (w_rows < 2 * INTER) | EVEN_N
        ks = tl.arange(0, BLOCK_K)
        if TMA:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts * 2 * INTER, HIDDEN],
                                               strides=[w_row_stride, 1], block_shape=[2 * BLOCK_N, BLOCK_K])
            first_row = expert * 2 * INTER + col_tile * 2 * BLOCK_N
        else:
            w_tile = w_ptr + expert.to(tl.int64) * w_expert_stride + w_rows[None, :].to(tl.int64) * w_row_stride
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            kk = k0 + ks
            k_mask = (kk < HIDDEN) | EVEN_K
            a = tl.load(x_ptr + tokens[:, None] * x_stride + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            if MXFP4:
                scale_rows = (w_scale_ptr + expert.to(tl.int64) * w_scale_stride
                              + w_rows[None, :].to(tl.int64) * (HIDDEN // 32))
                acc += mxfp4_dot(a, w_tile, scale_rows, k0, w_row_mask[None, :], HIDDEN, BLOCK_K, EVEN_K, DOT_UPCAST)
            else:
                if TMA:
                    w = w_desc.load([first_row, k0]).T
                else:
                    w = tl.load(w_tile + kk[:, None], mask=w_row_mask[None, :] & k_mask[:, None], other=0.0)
                acc += dot(a, w, DOT_UPCAST)
        if FP8:
            x_scale = tl.load(x_scale_ptr + tokens, mask=row_mask, other=0.0)[:, None]
            w_scales = w_scale_ptr + expert.to(tl.int64) * w_scale_stride + w_rows
            acc *= x_scale * tl.load(w_scales, mask=w_row_mask, other=0.0)[None, :]
        if BIAS:
            acc += tl.load(bias_ptr + expert.to(tl.int64) * 2 * INTER + w_rows, mask=w_row_mask, other=0.0)[None, :]
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))  # the even columns, the odd ones
        # gate and up rounded to the output's dtype first, as the reference (and transformers) compute them
        gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        if SWIGLU:
            gate = tl.minimum(gate, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
            y = (up + 1.0) * gate * tl.sigmoid(swiglu_alpha * gate)
        elif GELU:
            y = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
        else:
            y = gate / (1.0 + tl.exp(-gate)) * up
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & ((cols < INTER) | EVEN_N)[None, :])


@fast_launch
@triton.jit
def _moe_down_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, sorted_pairs_ptr, block_experts_ptr,
                     pair_weights_ptr, out_ptr, num_pairs, num_experts, a_stride, w_expert_stride, w_row_stride,
                     w_scale_stride, out_stride, num_blocks, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, FP8: tl.constexpr, DOT_UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
                     GROUP_M: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, EVEN_N: tl.constexpr,
                     MXFP4: tl.constexpr, BIAS: tl.constexpr):
    """out[pair, cols] = weight[pair] * (a[pair] . down rows cols + bias), for one block of sorted
    pairs (FP8 and MXFP4 as in the gate/up kernel; EVEN_K: BLOCK_K divides I)."""
    block, col_tile = moe_tile(num_blocks, num_cols, GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < num_experts:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = pairs < num_pairs
        rows = pairs.to(tl.int64)
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = (cols < HIDDEN) | EVEN_N
        w_rows = w_ptr + expert.to(tl.int64) * w_expert_stride + cols[None, :].to(tl.int64) * w_row_stride
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + ks
            k_mask = (kk < INTER) | EVEN_K
            a = tl.load(a_ptr + rows[:, None] * a_stride + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            if MXFP4:
                scale_rows = (w_scale_ptr + expert.to(tl.int64) * w_scale_stride
                              + cols[None, :].to(tl.int64) * (INTER // 32))
                acc += mxfp4_dot(a, w_rows, scale_rows, k0, col_mask[None, :], INTER, BLOCK_K, EVEN_K, DOT_UPCAST)
            else:
                w = tl.load(w_rows + kk[:, None], mask=col_mask[None, :] & k_mask[:, None], other=0.0)
                acc += dot(a, w, DOT_UPCAST)
        if FP8:
            acc *= tl.load(a_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
            acc *= tl.load(w_scale_ptr + expert.to(tl.int64) * w_scale_stride + cols, mask=col_mask, other=0.0)[None, :]
        if BIAS:
            acc += tl.load(bias_ptr + expert.to(tl.int64) * HIDDEN + cols, mask=col_mask, other=0.0)[None, :]
        # the expert's output rounded to x's dtype before it is weighted, as the reference
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.load(pair_weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


def moe_gate_up_triton(a: torch.Tensor, a_scale: torch.Tensor | None, w_gate_up: torch.Tensor,
                       w_scale: torch.Tensor | None, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
                       top_k: int, out_dtype: torch.dtype, plan: MoEPlan, bias: torch.Tensor | None = None,
                       swiglu: tuple[float, float] | None = None, gelu: bool = False) -> torch.Tensor:
    """The gate/up kernel alone: [T * K, I], silu(gate) * up (or the clamped SwiGLU) by pair (a: x,
    or its fp8 rows with a_scale and the weights' w_scale; uint8 weights: MXFP4 with w_scale theirs)."""
    mxfp4 = w_gate_up.dtype == torch.uint8
    assert not mxfp4 or plan.block_k % MXFP4_GROUP == 0, "MXFP4 tiles are whole scale groups"
    num_experts, inter, hidden = w_gate_up.shape[0], w_gate_up.shape[1] // 2, w_gate_up.shape[2] * (2 if mxfp4 else 1)
    num_pairs = a.shape[0] * top_k
    out = torch.empty(num_pairs, inter, dtype=out_dtype, device=a.device)
    fp8 = w_scale is not None and not mxfp4
    # TMA where the K blocks divide H: gpt-oss's H = 2880 in fp8's 128-byte K blocks leaves a ragged last
    # tile, and loads took its gate/up from 259.5 to 246.9 us at 1024 tokens and 495.7 to 430.9 at 2048
    # (3% slower at 8192; moe_bench.py --shape gpt-oss-20b --fp8 --tune, H200, 2026-12-04, 00cc996).
    tma = (bool(plan.tma) and not mxfp4 and hidden % plan.block_k == 0 and 2 * plan.block_n <= TMA_MAX_BOX
           and descriptor_fits(w_gate_up))
    if tma:
        use_descriptor_allocator(w_gate_up.device)
    num_blocks, num_cols = block_experts.shape[0], cdiv(inter, plan.block_n)
    alpha, limit = swiglu or (1.0, 0.0)
    _moe_gate_up_kernel[(num_blocks * num_cols,)](
        a, w_gate_up, a_scale if fp8 else a, a if w_scale is None else w_scale, a if bias is None else bias,
        sorted_pairs, block_experts, out, num_pairs, top_k, num_experts, a.stride(0), w_gate_up.stride(0),
        w_gate_up.stride(1), 0 if w_scale is None else w_scale.stride(0), out.stride(0), num_blocks, num_cols,
        float(alpha), float(limit), **_options(plan, fp8, a, hidden), HIDDEN=hidden, INTER=inter,
        EVEN_N=inter % plan.block_n == 0, TMA=tma, MXFP4=mxfp4, BIAS=bias is not None, SWIGLU=swiglu is not None,
        GELU=gelu)
    return out


TMA_MAX_BOX = 256  # a tensor descriptor's block: at most 256 rows (so plans of over 128 columns take loads)


def descriptor_fits(w: torch.Tensor) -> bool:
    """A tensor descriptor can span w's [E * rows, K] rows: experts back to back, rows and the base
    16-byte aligned (Hopper's TMA)."""
    return (w.is_contiguous() and w.stride(1) * w.element_size() % 16 == 0 and w.data_ptr() % 16 == 0)


def moe_down_triton(a: torch.Tensor, a_scale: torch.Tensor | None, w_down: torch.Tensor, w_scale: torch.Tensor | None,
                    sorted_pairs: torch.Tensor, block_experts: torch.Tensor, pair_weights: torch.Tensor,
                    out_dtype: torch.dtype, plan: MoEPlan, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The down kernel alone: [T * K, H], each pair's expert output (plus its bias) times its routing
    weight (pair_weights fp32 [T * K]; a: the gate/up output, or its fp8 rows with a_scale)."""
    mxfp4 = w_down.dtype == torch.uint8
    assert not mxfp4 or plan.block_k % MXFP4_GROUP == 0, "MXFP4 tiles are whole scale groups"
    num_experts, hidden, inter = w_down.shape[0], w_down.shape[1], w_down.shape[2] * (2 if mxfp4 else 1)
    num_pairs = a.shape[0]
    out = torch.empty(num_pairs, hidden, dtype=out_dtype, device=a.device)
    fp8 = w_scale is not None and not mxfp4
    num_blocks, num_cols = block_experts.shape[0], cdiv(hidden, plan.block_n)
    _moe_down_kernel[(num_blocks * num_cols,)](
        a, w_down, a_scale if fp8 else a, a if w_scale is None else w_scale, a if bias is None else bias,
        sorted_pairs, block_experts, pair_weights, out, num_pairs, num_experts, a.stride(0), w_down.stride(0),
        w_down.stride(1), 0 if w_scale is None else w_scale.stride(0), out.stride(0), num_blocks, num_cols,
        **_options(plan, fp8, a, inter), HIDDEN=hidden, INTER=inter, EVEN_N=hidden % plan.block_n == 0,
        MXFP4=mxfp4, BIAS=bias is not None)
    return out


def _options(plan: MoEPlan, fp8: bool, a: torch.Tensor, reduced: int) -> dict:
    return dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, FP8=fp8, DOT_UPCAST=not a.is_cuda,
                EVEN_K=reduced % plan.block_k == 0, GROUP_M=plan.group_m, num_warps=plan.num_warps,
                num_stages=plan.num_stages)


def fit_plan(plan: MoEPlan, dtype: torch.dtype, fp8: bool, mxfp4: bool = False) -> MoEPlan:
    """The plan for activations of `dtype`. fp32 (tiny test models) with bf16 or fp32 experts:
    the K blocks halved, or the large plans' pipelined tiles need more shared memory than an H100
    or H200 has (288 KiB). fp8 experts multiply fp8 tiles whatever x's dtype (x is quantised
    first), so their plans stand: fp8 tensor cores take no K block under 32. MXFP4 K blocks are
    whole scale groups (32)."""
    if dtype.itemsize == 4 and not fp8:
        return plan._replace(block_k=max(32 if mxfp4 else 16, plan.block_k // 2))
    return plan


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                     w_down_scale: torch.Tensor | None = None, gate_up_bias: torch.Tensor | None = None,
                     down_bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None,
                     gelu: bool = False, plan: MoEPlan | None = None,
                     down_plan: MoEPlan | None = None) -> torch.Tensor:
    """fused_moe_ref's result through the two grouped-GEMM kernels. `plan` overrides moe_plan's
    choice for the gate/up kernel and, unless `down_plan` is given, for the down kernel too (the
    two share the alignment, so their row blocks must be equal)."""
    assert x.stride(-1) == 1 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    tokens, hidden = x.shape
    num_experts, top_k = w_gate_up.shape[0], topk_ids.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.empty_like(x)
    mxfp4 = w_gate_up.dtype == torch.uint8
    fp8 = w_gate_up_scale is not None and not mxfp4  # MXFP4 is weight-only
    if plan is None:
        plan, down_plan = moe_plans(num_pairs, num_experts, fp8=fp8, mxfp4=mxfp4)
    down_plan = down_plan or plan
    plan, down_plan = (fit_plan(p, x.dtype, fp8, mxfp4) for p in (plan, down_plan))
    assert down_plan.block_m == plan.block_m, "the gate/up and down kernels share the alignment's row blocks"
    sorted_pairs, block_experts = align_by_expert_triton(topk_ids, num_experts, plan.block_m)
    a, a_scale = quantize_fp8_rows_triton(x) if fp8 else (x, None)
    hidden_by_pair = moe_gate_up_triton(a, a_scale, w_gate_up, w_gate_up_scale, sorted_pairs, block_experts, top_k,
                                        x.dtype, plan, gate_up_bias, swiglu, gelu)
    a, a_scale = quantize_fp8_rows_triton(hidden_by_pair) if fp8 else (hidden_by_pair, None)
    out_by_pair = moe_down_triton(a, a_scale, w_down, w_down_scale, sorted_pairs, block_experts,
                                  topk_weights.float().contiguous().view(-1), x.dtype, down_plan, down_bias)
    return out_by_pair.view(tokens, top_k, hidden).sum(dim=1)
