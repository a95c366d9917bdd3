"""fp8 (e4m3) linear layer: y = (x W^T) with W stored in fp8 with one scale per output row,
and x quantised to fp8 per token at each call ("dynamic" activation scales), as vLLM's and
SGLang's `--quantization fp8` do for a bf16 checkpoint.

Two GEMMs, one operation (y = sx * sw * (xq @ wq^T)):
- up to SMALL_M_MAX tokens (decode steps), a split-K Triton kernel that streams the fp8
  weight at close to copy speed, summed in fp32, where cuBLAS's fp8 kernels do not (H100, 8B shapes, M = 1:
  qkv 21.6 us against 20.6 us in bf16, o 17.9 against 9.1, down 53.8 against 42.9); one launch:
  each column block's last K slice to finish adds the slices up, counted on a device counter
  as decode attention merges its chunks;
- above it, cuBLAS's scaled fp8 GEMM (`torch._scaled_mm`, row-wise scales, fast accumulation),
  on fp8 tensor cores 1.3-1.9x faster than bf16 from M = 512 (H200, gate_up at M = 4096: 755
  against 1440 us).
The per-token quantisation in front of both is the first kernel here. The reference does the
same quantisation in torch and the GEMM in fp32, so the paths differ only by accumulation order
(and, above SMALL_M_MAX, by the fast accumulation's precision: FAST_ACCUM).
"""
import torch

from ._triton import cdiv, dot, fast_launch, next_power_of_2, num_sms, tl, triton, zeroed_counters

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A row of zeros gets this scale instead of 0 (then x / scale = 0, not NaN).
MIN_SCALE = 1e-12


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (fp8 [N, K], fp32 scales [1, N]): each output row scaled so its largest |w| is 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale[None, :].contiguous()


def quantize_fp8_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (fp8 [M, K], fp32 scales [M, 1]): per-row (per-token) dynamic scales."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale  # quantize_row's reciprocal


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), still in fp32, so
    that the cast to fp8 is exact: Triton's interpreter (the CPU tests) drops the carry when its
    cast rounds a mantissa up (127.9 -> 64), the GPU's cast rounds like torch. About ten integer
    operations a value: kernels that may skip it on the GPU take SOFT_ROUND = not x.is_cuda."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 of fp32's 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0  # 1.5 * 2^14: rounds to a multiple of 2^-9, e4m3's subnormal step
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def quantize_row(y, fp8_max, min_scale, SOFT_ROUND: tl.constexpr):
    """One row (fp32, masked entries 0) -> (its values scaled and clamped for the e4m3 cast, still
    in fp32, exact e4m3 values with SOFT_ROUND; its scale), as quantize_fp8_rows_ref: the largest
    |y| maps to 448. Shared by the kernels that quantise their own output (rms_norm, silu_and_mul).
    One correctly rounded reciprocal a row, then a multiply a value, as the reference does: a
    division a value made the 14336-wide SiLU-and-mul rows compute-bound (H200, 8704 rows: 251
    against 165 us, with the GPU's own cast; 302 with the software rounding too)."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, min_scale)
    v = tl.clamp(y * tl.div_rn(tl.full([], 1.0, tl.float32), scale), -fp8_max, fp8_max)
    if SOFT_ROUND:
        v = round_to_e4m3(v)
    return v, scale


@triton.jit
def store_quantized_row(y, q_ptr, scale_ptr, row, q_stride, cols, mask, fp8_max, min_scale,
                        SOFT_ROUND: tl.constexpr):
    """quantize_row(y), stored: its fp8 values at row `row` of q, its scale at scale[row]."""
    q, scale = quantize_row(y, fp8_max, min_scale, SOFT_ROUND)
    tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@fast_launch
@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, width, x_stride, q_stride, fp8_max, min_scale,
                          BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    store_quantized_row(x, q_ptr, scale_ptr, row, q_stride, cols, mask, fp8_max, min_scale, SOFT_ROUND)


def quantize_fp8_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, width = x.shape
    q = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = next_power_of_2(width)
    _quantize_rows_kernel[(rows,)](x, q, scale, width, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE, BLOCK=block,
                                   SOFT_ROUND=not x.is_cuda, num_warps=min(max(block // 1024, 1), 16))
    return q, scale


def fp8_gemm_ref(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """q fp8 [M, K] with scale [M, 1] (quantize_fp8_rows' output), weight fp8 [N, K] with
    weight_scale [1, N] -> [M, N] in out_dtype."""
    return ((q.float() @ weight.float().t()) * scale * weight_scale).to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp32), weight fp8 [N, K], weight_scale [1, N] -> [M, N] in x's dtype."""
    return fp8_gemm_ref(*quantize_fp8_rows_ref(x), weight, weight_scale, x.dtype)




SMALL_M_MAX = 64
# cuBLAS's fp8 GEMM with Hopper's fast accumulation (the tensor cores' partial sums are not
# promoted to fp32 after each K block), as vLLM's CUTLASS fp8 kernels and torchao's forward do.
# H200, 8B shapes, M = 8704 (fp8_gemm_bench.py): gate_up 1615 against 1804 us, qkv 336 against
# 366; the error against the same fp8 operands summed in fp32 0.21-0.33% against 0.17% (the
# bf16 output's rounding), where the fp8 quantisation itself costs 3.75%.
FAST_ACCUM = True


def small_m_plan(m: int, n: int, k: int, num_sms: int, block_n: int | None = None, block_k: int = 256,
                 waves: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits): enough (column block, K slice) programs for `waves`
    per SM, each K slice a whole number of BLOCK_K. The defaults are the H100's best or within
    8% of it (test/benchmark/kernels/fp8_gemm_bench.py --tune, 8B shapes, M = 1 and 48): at M <= 16 two
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
def _store_scaled(acc, xs_ptr, ws_ptr, out_ptr, rows, cols, row_mask, col_mask, out_stride):
    y = acc * tl.load(xs_ptr + rows, mask=row_mask, other=0.0)[:, None] * tl.load(ws_ptr + cols, mask=col_mask,
                                                                                  other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@fast_launch
@triton.jit
def _fp8_gemm_small_m_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, part_ptr, out_ptr, counters_ptr, m, n, k, k_per_split,
                             splits, x_stride, w_stride, out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One column block over one K slice. SPLIT: the slice's fp32 sum goes to part [splits, m, n],
    and the column block's last slice to count itself done adds them up, scales and stores."""
    col_block, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):
        kk = k0 + ks
        k_mask = kk < k
        x = tl.load(xq_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * w_stride + kk[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)
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
            _store_scaled(total, xs_ptr, ws_ptr, out_ptr, rows, cols, row_mask, col_mask, out_stride)
    else:
        _store_scaled(acc, xs_ptr, ws_ptr, out_ptr, rows, cols, row_mask, col_mask, out_stride)


# Column blocks one split launch may have, one counter each (gate_up of an 8B model: 896).
NUM_COUNTERS = 8192


def fp8_gemm_small_m(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype, plan: tuple[int, int, int, int] | None = None,
                     num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """sx * sw * (q @ weight^T) for up to a few dozen rows, one launch; `plan` (small_m_plan's)
    overrides the choice."""
    m, k = q.shape
    n = weight.shape[0]
    block_m, block_n, block_k, splits = plan or small_m_plan(m, n, k, num_sms(q.device, elsewhere=4))
    split = splits > 1
    assert not split or cdiv(n, block_n) <= NUM_COUNTERS
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=q.device) if split else out
    counters = zeroed_counters("fp8 small-M GEMM", NUM_COUNTERS, q.device) if split else out
    _fp8_gemm_small_m_kernel[(cdiv(n, block_n), splits)](
        q, scale, weight, weight_scale, part, out, counters, m, n, k, cdiv(cdiv(k, block_k), splits) * block_k,
        splits, q.stride(0), weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT=split, DOT_UPCAST=not q.is_cuda, num_warps=num_warps, num_stages=num_stages)
    return out


def fp8_gemm_triton(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    if q.shape[0] <= SMALL_M_MAX:
        return fp8_gemm_small_m(q, scale, weight, weight_scale, out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype,
                            use_fast_accum=FAST_ACCUM)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return fp8_gemm_triton(*quantize_fp8_rows_triton(x), weight, weight_scale, x.dtype)
