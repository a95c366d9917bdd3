"""LoRA on a mixed batch: each token's row goes through its own adapter's A and B (or none), one
launch per operation for the whole batch, whatever the mix of adapters.

The adapters sit in a slot pool: a [S, R, K] and b [S, N, R] per projection (R the largest rank,
smaller ranks zero-padded). A step groups its rows by slot once (`lora_segments`: the rows in slot
order and where each slot's run of them starts); then per projection

    lora_shrink:   s[t] = x[t] @ a[slot(t)]^T            [T, R] in x's dtype
    lora_expand_:  y[t] += s[t] @ b[slot(t)]^T           in place, summed in fp32

Rows of no adapter (slot -1) are in no segment: the kernels skip them, and their s rows are never
written or read. The kernels' grid is (slots, row blocks, column blocks), fixed by the step's rows
and the pool's size, so a CUDA graph replays them with any mix of adapters; a program whose block
lies past its slot's rows leaves at once.
"""
import torch

from ._triton import cdiv, dot, fast_launch, next_power_of_2, tl, triton

BLOCK_ROWS = 16
BLOCK_K = 64
BLOCK_N = 64


def lora_segments(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [T] int64 in slot order, starts [num_slots + 1] int32): slot s's rows are
    rows[starts[s]:starts[s + 1]]; rows of slot -1 come last, past starts[num_slots]. Device ops
    only (no host sync), so that a graph captures it."""
    keyed = torch.where(slots < 0, num_slots, slots)
    rows = torch.argsort(keyed, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.index_add_(0, keyed, torch.ones_like(keyed))
    starts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device)
    starts[1:] = counts[:num_slots].cumsum(0)
    return rows, starts


def _segments(starts: torch.Tensor):
    bounds = starts.tolist()
    return [(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1) if bounds[s + 1] > bounds[s]]


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for slot, begin, end in _segments(starts):
        index = rows[begin:end]
        out[index] = (x[index].float() @ a[slot].float().T).to(x.dtype)
    return out


def lora_expand_ref(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                    starts: torch.Tensor) -> torch.Tensor:
    for slot, begin, end in _segments(starts):
        index = rows[begin:end]
        y[index] = (y[index].float() + s[index].float() @ b[slot].float().T).to(y.dtype)
    return y


@fast_launch
@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, starts_ptr, K, R, x_stride, a_slot_stride, a_stride,
                   out_stride, BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_UPCAST: tl.constexpr):
    slot = tl.program_id(0)
    begin = tl.load(starts_ptr + slot) + tl.program_id(1) * BLOCK_ROWS
    end = tl.load(starts_ptr + slot + 1)
    if begin < end:
        offs = begin + tl.arange(0, BLOCK_ROWS)
        in_seg = offs < end
        rows = tl.load(rows_ptr + offs, mask=in_seg, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
        acc = tl.zeros((BLOCK_ROWS, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=in_seg[:, None] & (k[None, :] < K),
                         other=0.0)
            at = tl.load(a_base + r[None, :] * a_stride + k[:, None], mask=(k[:, None] < K) & (r[None, :] < R),
                         other=0.0)
            acc += dot(xt, at, DOT_UPCAST)
        tl.store(out_ptr + rows[:, None] * out_stride + r[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=in_seg[:, None] & (r[None, :] < R))


@fast_launch
@triton.jit
def _expand_kernel(y_ptr, s_ptr, b_ptr, rows_ptr, starts_ptr, N, R, y_stride, s_stride, b_slot_stride, b_stride,
                   BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_UPCAST: tl.constexpr):
    slot = tl.program_id(0)
    begin = tl.load(starts_ptr + slot) + tl.program_id(1) * BLOCK_ROWS
    end = tl.load(starts_ptr + slot + 1)
    if begin < end:
        offs = begin + tl.arange(0, BLOCK_ROWS)
        in_seg = offs < end
        rows = tl.load(rows_ptr + offs, mask=in_seg, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        st = tl.load(s_ptr + rows[:, None] * s_stride + r[None, :], mask=in_seg[:, None] & (r[None, :] < R),
                     other=0.0)
        bt = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + n[None, :] * b_stride + r[:, None],
                     mask=(r[:, None] < R) & (n[None, :] < N), other=0.0)
        delta = dot(st, bt, DOT_UPCAST)
        out = y_ptr + rows[:, None] * y_stride + n[None, :]
        keep = in_seg[:, None] & (n[None, :] < N)
        y = tl.load(out, mask=keep, other=0.0).to(tl.float32)
        tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=keep)


def _block_r(rank: int) -> int:
    return max(16, next_power_of_2(rank))  # tl.dot takes no dimension below 16


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    assert x.stride(-1) == 1 and a.is_contiguous()
    tokens, k = x.shape
    slots, rank = a.shape[:2]
    out = torch.empty(tokens, rank, dtype=x.dtype, device=x.device)
    _shrink_kernel[(slots, cdiv(tokens, BLOCK_ROWS), 1)](
        x, a, out, rows, starts, k, rank, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_R=_block_r(rank), BLOCK_K=BLOCK_K, DOT_UPCAST=not x.is_cuda)
    return out


def lora_expand_triton(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                       starts: torch.Tensor) -> torch.Tensor:
    assert y.stride(-1) == 1 and s.stride(-1) == 1 and b.is_contiguous()
    tokens, n = y.shape
    slots, _, rank = b.shape
    _expand_kernel[(slots, cdiv(tokens, BLOCK_ROWS), cdiv(n, BLOCK_N))](
        y, s, b, rows, starts, n, rank, y.stride(0), s.stride(0), b.stride(0), b.stride(1),
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_R=_block_r(rank), BLOCK_N=BLOCK_N, DOT_UPCAST=not y.is_cuda)
    return y
