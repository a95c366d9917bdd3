"""fp8 (e4m3) linear layer: y = (x W^T) with W stored in fp8 with one scale per output row,
and x quantised to fp8 per token at each call ("dynamic" activation scales), as vLLM's and
SGLang's `--quantization fp8` do for a bf16 checkpoint.

Two GEMMs, one operation (y = sx * sw * (xq @ wq^T), accumulated in fp32):
- up to SMALL_M_MAX tokens (decode steps), the split-K Triton kernel of kernels/linear.py, which
  streams the fp8 weight at close to copy speed: cuBLAS's fp8 kernels do not at these sizes
  (H100, 8B shapes, M = 1: qkv 21.6 us against 20.6 us in bf16, o 17.9 against 9.1, down 53.8
  against 42.9);
- above it, cuBLAS's scaled fp8 GEMM (`torch._scaled_mm`, row-wise scales), on fp8 tensor cores
  1.4-1.6x faster than bf16 from M = 512 (gate_up at M = 4096: 867 against 1422 us).
The per-token quantisation in front of both is the first kernel here. The reference does the
same quantisation in torch and the GEMM in fp32, so the paths differ only by accumulation order.
"""
import torch

from ._triton import fast_launch, next_power_of_2, tl, triton
from .linear import small_m_gemm

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
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), still in fp32, so
    that the cast to fp8 is exact: Triton's interpreter (the CPU tests) drops the carry when its
    cast rounds a mantissa up (127.9 -> 64), the GPU's cast rounds like torch."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 of fp32's 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0  # 1.5 * 2^14: rounds to a multiple of 2^-9, e4m3's subnormal step
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def quantize_row(y, fp8_max, min_scale):
    """One row (fp32, masked entries 0) -> (its e4m3 values still in fp32, its scale), as
    quantize_fp8_rows_ref: the largest |y| maps to 448. Shared by the kernels that quantise
    their own output (rms_norm, silu_and_mul)."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, min_scale)
    return round_to_e4m3(tl.clamp(tl.div_rn(y, scale), -fp8_max, fp8_max)), scale


@triton.jit
def store_quantized_row(y, q_ptr, scale_ptr, row, q_stride, cols, mask, fp8_max, min_scale):
    """quantize_row(y), stored: its fp8 values at row `row` of q, its scale at scale[row]."""
    q, scale = quantize_row(y, fp8_max, min_scale)
    tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@fast_launch
@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, width, x_stride, q_stride, fp8_max, min_scale,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    store_quantized_row(x, q_ptr, scale_ptr, row, q_stride, cols, mask, fp8_max, min_scale)


def quantize_fp8_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, width = x.shape
    q = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = next_power_of_2(width)
    _quantize_rows_kernel[(rows,)](x, q, scale, width, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE, BLOCK=block,
                                   num_warps=min(max(block // 1024, 1), 16))
    return q, scale


def fp8_gemm_ref(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """q fp8 [M, K] with scale [M, 1] (quantize_fp8_rows' output), weight fp8 [N, K] with
    weight_scale [1, N] -> [M, N] in out_dtype."""
    return ((q.float() @ weight.float().t()) * scale * weight_scale).to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp32), weight fp8 [N, K], weight_scale [1, N] -> [M, N] in x's dtype."""
    return fp8_gemm_ref(*quantize_fp8_rows_ref(x), weight, weight_scale, x.dtype)


SMALL_M_MAX = 64  # rows served by the split-K kernel (kernels/linear.py); above, cuBLAS's scaled GEMM


def fp8_gemm_triton(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    if q.shape[0] <= SMALL_M_MAX:
        return small_m_gemm(q, weight, out_dtype, x_scale=scale, weight_scale=weight_scale)
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return fp8_gemm_triton(*quantize_fp8_rows_triton(x), weight, weight_scale, x.dtype)
