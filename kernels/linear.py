"""y = x W^T (+ b) for a projection, and the split-K Triton GEMM that serves decode steps' few rows.

cuBLAS does not stream a weight at copy speed when x has only a few rows. The H100 batch-1 profile
(docs/benchmarks-log.md, "Batch-1 decode") had bf16 qkv at 80% of copy speed and o at 82%.
In fp8 the gap is wider (qkv at M = 1: 21.6 us against 8.9 us here).

`small_m_gemm` is a split-K kernel. Each program takes a block of output columns over one slice
of K. The column block's last slice to finish adds up the slices' fp32 partial sums (counted on
a device counter, as decode attention merges its chunks), so the product is one launch.

It serves:
- bf16 / fp16 weights, up to SMALL_M_MAX rows (`linear`);
- fp8 weights with their row scales (kernels/fp8_linear.py).

W may be laid out either way: [N, K] (column-parallel layers) or a transposed view of [K, N]
(row-parallel layers, which keep W^T for cuBLAS's sake at large M).
"""
import torch
import torch.nn.functional as F

from ._triton import cdiv, dot, fast_launch, next_power_of_2, num_sms, tl, triton, zeroed_counters

# bf16/fp16/fp32 rows served by the Triton kernel; above, cuBLAS (F.linear).
SMALL_M_MAX = 16
# Column blocks one split launch may have (one counter each): 28672 columns in blocks of 16 are 1792.
NUM_COUNTERS = 8192


def small_m_plan(m: int, n: int, k: int, num_sms: int, block_n: int | None = None, block_k: int = 256,
                 waves: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits): enough (column block, K slice) programs for `waves`
    per SM, each K slice a whole number of BLOCK_K. The defaults are the H100's best or within
    8% of it (test/benchmark/fp8_gemm_bench.py --tune, 8B shapes, M = 1 and 48): at M <= 16 two
    waves, and columns in blocks of 32 when a layer is wide enough to fill them without splitting
    K (gate_up: 41.8 against 50.3 us); above, one wave, since each split's fp32 partial grows with M."""
    block_m = max(16, next_power_of_2(m))
    if waves is None:
        waves = 2 if m <= 16 else 1
    if block_n is None:
        block_n = 32 if m <= 16 and cdiv(n, 64) >= 2 * num_sms else 64
    col_blocks = cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    splits = max(1, min(k_blocks, cdiv(waves * num_sms, col_blocks)))
    splits = cdiv(k_blocks, cdiv(k_blocks, splits))  # equal slices, none empty
    return block_m, block_n, block_k, splits


@triton.jit
def _store_rows(acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, out_stride,
                SCALED: tl.constexpr, HAS_BIAS: tl.constexpr):
    if SCALED:
        acc = acc * tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
        acc = acc * tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@fast_launch
@triton.jit
def _small_m_gemm_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, part_ptr, out_ptr, counters_ptr,
                         m, n, k, k_per_split, splits, x_stride, w_stride_n, w_stride_k, out_stride,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                         DOT_UPCAST: tl.constexpr):
    """One column block of x W^T over one K slice. SPLIT: the slice's fp32 sum goes to part
    [splits, m, n], and the block's last slice to count itself done adds them up and stores."""
    col_block, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    ks = tl.arange(0, BLOCK_K)
    w_cols = w_ptr + cols[None, :].to(tl.int64) * w_stride_n
    k_start = split * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):
        kk = k0 + ks
        k_mask = kk < k
        x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_cols + kk[:, None].to(tl.int64) * w_stride_k, mask=col_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc += dot(x, w, DOT_UPCAST)
    if SPLIT:
        parts = part_ptr + rows[:, None] * n + cols[None, :]  # split 0's; split s is s * m * n further
        out_mask = row_mask[:, None] & col_mask[None, :]
        tl.store(parts + split * m * n, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's stores before the count (the atomic releases them)
        counter = counters_ptr + col_block
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:  # the last slice done: add them up
            tl.store(counter, 0)  # every slice has counted: ready for the next launch
            tl.debug_barrier()  # the other slices' sums, acquired, before any thread reads them
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, splits):  # L1 may hold none of them: bypass it
                total += tl.load(parts + s * m * n, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_rows(total, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_mask, col_mask,
                        out_stride, SCALED, HAS_BIAS)
    else:
        _store_rows(acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, out_stride,
                    SCALED, HAS_BIAS)


def small_m_gemm(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, x_scale: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 plan: tuple[int, int, int, int] | None = None, num_warps: int = 4,
                 num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T, times x_scale [M, 1] and weight_scale [1, N] when given (fp8),
    plus bias [N], in out_dtype; `plan` (small_m_plan's) overrides the choice. x's rows contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, splits = plan or small_m_plan(m, n, k, num_sms(x.device, elsewhere=4))
    split = splits > 1
    assert x.stride(1) == 1 and (not split or cdiv(n, block_n) <= NUM_COUNTERS)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if split else out
    counters = zeroed_counters("small-M GEMM", NUM_COUNTERS, x.device) if split else out
    scaled = x_scale is not None
    _small_m_gemm_kernel[(cdiv(n, block_n), splits)](
        x, x_scale if scaled else x, weight, weight_scale if scaled else x, x if bias is None else bias, part, out,
        counters, m, n, k, cdiv(cdiv(k, block_k), splits) * block_k, splits, x.stride(0), weight.stride(0),
        weight.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        SCALED=scaled, HAS_BIAS=bias is not None, DOT_UPCAST=not x.is_cuda, num_warps=num_warps,
        num_stages=num_stages)
    return out


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias, weight in either layout."""
    return F.linear(x, weight, bias)


def bf16_plan(m: int, n: int, k: int, num_sms: int, transposed: bool) -> tuple[tuple[int, int, int, int], int, int]:
    """(small_m_gemm's plan, warps, stages) for a bf16/fp16 weight. On the H100 the best plans at
    bench-8b's projections, tp 1 and 2, M = 1, had about 1.5 programs per SM (column blocks times
    K slices): fewer leave SMs idle, more only add partial sums (fp8_gemm_bench.py --bf16-tune,
    docs/benchmarks-log.md); with 2 warps gate_up took 87 us, not 80. A transposed W is read along N
    rows: wider column blocks there."""
    block_n, block_k, warps, stages = 64 if transposed else 32, 128, 4, 3
    col_blocks, k_blocks = cdiv(n, block_n), cdiv(k, block_k)
    splits = max(1, min(k_blocks, round(1.5 * num_sms / col_blocks)))
    splits = cdiv(k_blocks, cdiv(k_blocks, splits))  # equal slices, none empty
    return (max(16, next_power_of_2(m)), block_n, block_k, splits), warps, stages


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Up to SMALL_M_MAX rows on small_m_gemm, except a transposed W whose K is at most its N (the
    o projection), where cuBLAS was faster (H100: 13.8 against 14.5 us at M = 1); with a long K
    (down) cuBLAS splits it and sums the slices in a second kernel, which small_m_gemm does not."""
    n, k = weight.shape
    transposed = weight.stride(0) == 1 and n > 1
    if x.dim() == 2 and x.shape[0] <= SMALL_M_MAX and x.stride(1) == 1 and (k > n or not transposed):
        plan, warps, stages = bf16_plan(x.shape[0], n, k, num_sms(x.device, elsewhere=4), transposed)
        return small_m_gemm(x, weight, x.dtype, bias=bias, plan=plan, num_warps=warps, num_stages=stages)
    return F.linear(x, weight, bias)
