"""LoRA on a mixed batch: each token's row goes through its own adapter's A and B (or none), one
launch per operation for the whole batch, whatever the mix of adapters.

The adapters sit in a slot pool: a [S, R, K] and b [S, N, R] per projection (R the largest rank,
smaller ranks zero-padded). A step groups its rows by slot once (`lora_segments`: the rows in slot
order, where each slot's run of them starts, and where its row blocks start); then per projection

    lora_shrink:   s[p, t] = x[t, K slice p] @ a[slot(t), :, K slice p]^T    [P, T, R] fp32
    lora_expand_:  y[t] += (sum over p of s[p, t]) @ b[slot(t)]^T            in place, summed in fp32

The shrink's P partial sums over slices of K (`shrink_splits`: several where the step has few row
blocks, so that a decode step's few rows still spread over many programs; the reference's P is 1)
are added up by the expand, in a fixed order: the result does not depend on timing. Rows of no
adapter (slot -1) are in no segment: the kernels skip them, and their s rows are never written or
read.

The kernels' first grid axis runs over the step's row blocks, slot after slot (a slot's rows cut
into blocks of BLOCK_ROWS, or of LARGE_BLOCK_ROWS in a step of at least LARGE_ROWS rows; a slot of
no rows has none): a program finds its slot in the blocks table (one vector compare over the
slots' first blocks). The axis's size is `max_row_blocks`, the most
blocks any mix of the step's rows over the pool's slots can need, fixed by the step's rows and
the pool's size, so a CUDA graph replays it with any mix of adapters; the programs past the step's
real blocks (at most one a used slot's worth, and those of rows of no adapter) leave at once.
Both kernels take programmatic dependent launch on sm90+ (scheduled while the kernel ahead
finishes; each program finds its block, then waits for it before reading x or s).
"""
from typing import NamedTuple

import torch

from ._triton import cdiv, dot, fast_launch, grid_dependency_wait, next_power_of_2, pdl, tl, triton

# The launch plan, timed on an H200 (2026-12-05, test/benchmark/kernels/lora_bench.py: bench-8b, 16
# slots of rank 16, a step's LoRA work in one CUDA graph at 1, 16, 256 and 2048 tokens): K tiles of
# 128 took 0.99, 0.92, 0.92 and 0.90x the time of tiles of 64; blocks of 32 rows, 128 columns, K
# slices of 128 or 256 lost at 1-16 tokens, where batch-1 decoding is.
BLOCK_ROWS = 16
BLOCK_K = 128
BLOCK_N = 64
# Steps of at least LARGE_ROWS rows take row blocks of LARGE_BLOCK_ROWS and expand tiles of
# LARGE_BLOCK_N columns: fewer, larger programs. H100, bench-8b, 16 slots of rank 16, the LoRA work
# in turn after the base GEMMs (lora_bench.py, f5302f1, 2026-12-06): blocks of 64 rows and 128
# columns added 6,070 / 6,906 us at 1,024 / 2,048 rows against 6,638 / 8,266 with 16 and 64, and
# 4,642 / 6,171 with the shrink beside the GEMM (models/lora.py); at 16-256 rows they lost 10-40%.
LARGE_ROWS = 1024
LARGE_BLOCK_ROWS = 64
LARGE_BLOCK_N = 128
# The shrink cuts K into slices (of at least SPLIT_K columns) until the step's row blocks times the
# slices reach SHRINK_PROGRAMS (about two programs an SM on an H100 or H200, 132 SMs): a decode
# step's one row block would otherwise be one program over all of K.
SPLIT_K = 512
SHRINK_PROGRAMS = 256


class Segments(NamedTuple):
    """A step's rows grouped by slot: slot s's rows are rows[starts[s]:starts[s + 1]] ([T] int64; rows
    of slot -1 come last, past starts[num_slots]), and its row blocks of `block_rows` rows are
    blocks[s]:blocks[s + 1] (int32 [num_slots + 1] each)."""

    rows: torch.Tensor
    starts: torch.Tensor
    blocks: torch.Tensor
    block_rows: int


def block_rows(tokens: int) -> int:
    """The rows of a row block in a step of `tokens` rows."""
    return LARGE_BLOCK_ROWS if tokens >= LARGE_ROWS else BLOCK_ROWS


def lora_segments(slots: torch.Tensor, num_slots: int) -> Segments:
    """Device ops only (no host sync), so that a graph captures it."""
    rows_per_block = block_rows(slots.shape[0])
    keyed = torch.where(slots < 0, num_slots, slots)
    rows = torch.argsort(keyed, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.index_add_(0, keyed, torch.ones_like(keyed))
    table = torch.zeros(2, num_slots + 1, dtype=torch.int32, device=slots.device)
    used = counts[:num_slots]
    table[:, 1:] = torch.stack([used, (used + rows_per_block - 1) // rows_per_block]).cumsum(1)
    return Segments(rows, table[0], table[1], rows_per_block)


def max_row_blocks(tokens: int, num_slots: int) -> int:
    """The most row blocks `tokens` rows over `num_slots` slots can take: each used slot wastes at
    most a block's rows less one in its last block, and at most min(tokens, num_slots) slots are used."""
    rows = block_rows(tokens)
    return (tokens + min(tokens, num_slots) * (rows - 1)) // rows


def shrink_splits(tokens: int, k: int, num_slots: int) -> int:
    """Slices of K the shrink of `tokens` rows takes (1: K whole)."""
    return max(1, min(cdiv(k, SPLIT_K), cdiv(SHRINK_PROGRAMS, max(1, max_row_blocks(tokens, num_slots)))))


def _segments(seg: Segments):
    bounds = seg.starts.tolist()
    return [(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1) if bounds[s + 1] > bounds[s]]


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, seg: Segments, splits: int | None = None) -> torch.Tensor:
    """[1, T, R] fp32 (K whole, whatever `splits`)."""
    out = torch.zeros(1, x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, begin, end in _segments(seg):
        index = seg.rows[begin:end]
        out[0, index] = x[index].float() @ a[slot].float().T
    return out


def lora_expand_ref(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, seg: Segments) -> torch.Tensor:
    for slot, begin, end in _segments(seg):
        index = seg.rows[begin:end]
        summed = s[:, index].sum(0).to(b.dtype).float()  # rounded to the weights' dtype, as the kernel's dot
        y[index] = (y[index].float() + summed @ b[slot].float().T).to(y.dtype)
    return y


@triton.jit
def _find_block(rows_ptr, starts_ptr, blocks_ptr, num_slots, BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
    """(slot, rows [BLOCK_ROWS] int64, in_seg) of this program's row block; slot == num_slots: past
    the step's blocks (nothing to do)."""
    block = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ends = tl.load(blocks_ptr + 1 + s, mask=s < num_slots, other=2147483647)
    slot = tl.sum((ends <= block).to(tl.int32), axis=0)  # the slots whose blocks all lie before this one
    # Past the blocks: the last slot's bounds, where this block starts past its rows (no row in_seg)
    slot_in = tl.minimum(slot, num_slots - 1)
    begin = tl.load(starts_ptr + slot_in) + (block - tl.load(blocks_ptr + slot_in)) * BLOCK_ROWS
    end = tl.load(starts_ptr + slot_in + 1)
    offs = begin + tl.arange(0, BLOCK_ROWS)
    in_seg = offs < end
    rows = tl.load(rows_ptr + offs, mask=in_seg, other=0).to(tl.int64)
    return slot, rows, in_seg


@fast_launch
@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, starts_ptr, blocks_ptr, num_slots, K, R, k_slice, x_stride,
                   a_slot_stride, a_stride, out_split_stride, out_stride, BLOCK_ROWS: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_UPCAST: tl.constexpr,
                   PDL: tl.constexpr):
    slot, rows, in_seg = _find_block(rows_ptr, starts_ptr, blocks_ptr, num_slots, BLOCK_ROWS, BLOCK_S)
    grid_dependency_wait(PDL)  # x may come from the kernel before (the segments come from older ones)
    if slot < num_slots:
        r = tl.arange(0, BLOCK_R)
        a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
        split = tl.program_id(1)
        k_end = tl.minimum(K, (split + 1) * k_slice)
        acc = tl.zeros((BLOCK_ROWS, BLOCK_R), dtype=tl.float32)
        for k0 in range(split * k_slice, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=in_seg[:, None] & (k[None, :] < k_end),
                         other=0.0)
            at = tl.load(a_base + r[None, :] * a_stride + k[:, None], mask=(k[:, None] < k_end) & (r[None, :] < R),
                         other=0.0)
            acc += dot(xt, at, DOT_UPCAST)
        out = out_ptr + split.to(tl.int64) * out_split_stride + rows[:, None] * out_stride + r[None, :]
        tl.store(out, acc, mask=in_seg[:, None] & (r[None, :] < R))


@fast_launch
@triton.jit
def _expand_kernel(y_ptr, s_ptr, b_ptr, rows_ptr, starts_ptr, blocks_ptr, num_slots, N, R, splits, y_stride,
                   s_split_stride, s_stride, b_slot_stride, b_stride, BLOCK_ROWS: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_UPCAST: tl.constexpr,
                   PDL: tl.constexpr):
    slot, rows, in_seg = _find_block(rows_ptr, starts_ptr, blocks_ptr, num_slots, BLOCK_ROWS, BLOCK_S)
    grid_dependency_wait(PDL)  # s comes from the shrink before; every program waits, even one that leaves
    if slot < num_slots:
        r = tl.arange(0, BLOCK_R)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep_s = in_seg[:, None] & (r[None, :] < R)
        st = tl.zeros((BLOCK_ROWS, BLOCK_R), dtype=tl.float32)
        for p in range(0, splits):
            st += tl.load(s_ptr + p * s_split_stride + rows[:, None] * s_stride + r[None, :], mask=keep_s, other=0.0)
        bt = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + n[None, :] * b_stride + r[:, None],
                     mask=(r[:, None] < R) & (n[None, :] < N), other=0.0)
        delta = dot(st.to(bt.dtype), bt, DOT_UPCAST)  # s rounded to the weights' dtype: tensor cores take bf16
        out = y_ptr + rows[:, None] * y_stride + n[None, :]
        keep = in_seg[:, None] & (n[None, :] < N)
        y = tl.load(out, mask=keep, other=0.0).to(tl.float32)
        tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=keep)


def _block_r(rank: int) -> int:
    return max(16, next_power_of_2(rank))  # tl.dot takes no dimension below 16


def _block_s(num_slots: int) -> int:
    return max(2, next_power_of_2(num_slots))


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, seg: Segments, splits: int | None = None) -> torch.Tensor:
    """[P, T, R] fp32, P = `splits` (default shrink_splits of the step)."""
    assert x.stride(-1) == 1 and a.is_contiguous()
    tokens, k = x.shape
    slots, rank = a.shape[:2]
    splits = shrink_splits(tokens, k, slots) if splits is None else splits
    k_slice = cdiv(cdiv(k, splits), BLOCK_K) * BLOCK_K
    out = torch.empty(splits, tokens, rank, dtype=torch.float32, device=x.device)
    blocks = max_row_blocks(tokens, slots)
    if blocks:
        _shrink_kernel[(blocks, splits)](
            x, a, out, seg.rows, seg.starts, seg.blocks, slots, k, rank, k_slice, x.stride(0), a.stride(0),
            a.stride(1), out.stride(0), out.stride(1), BLOCK_ROWS=seg.block_rows, BLOCK_S=_block_s(slots),
            BLOCK_R=_block_r(rank), BLOCK_K=BLOCK_K, DOT_UPCAST=not x.is_cuda, **pdl(x))
    return out


def lora_expand_triton(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, seg: Segments) -> torch.Tensor:
    assert y.stride(-1) == 1 and s.stride(-1) == 1 and b.is_contiguous()
    tokens, n = y.shape
    slots, _, rank = b.shape
    blocks = max_row_blocks(tokens, slots)
    block_n = LARGE_BLOCK_N if tokens >= LARGE_ROWS else BLOCK_N
    if blocks:
        _expand_kernel[(blocks, cdiv(n, block_n))](
            y, s, b, seg.rows, seg.starts, seg.blocks, slots, n, rank, s.shape[0], y.stride(0), s.stride(0),
            s.stride(1), b.stride(0), b.stride(1), BLOCK_ROWS=seg.block_rows, BLOCK_S=_block_s(slots),
            BLOCK_R=_block_r(rank), BLOCK_N=block_n, DOT_UPCAST=not y.is_cuda, **pdl(y))
    return y
