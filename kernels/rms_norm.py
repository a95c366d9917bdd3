"""RMSNorm (Llama): y = weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32.

With `fp8_out` the output is y quantised per row for an fp8 projection (quantize_fp8_rows: the
pair (fp8 rows, scales)), in the same launch: under `--quantization fp8` the q/k/v and gate/up
projections take their input from a norm, and a launch saved is about 3 us of the device and
60 us of the host in an eager step (H100)."""
import torch

from ._triton import fast_launch, grid_dependency_wait, next_power_of_2, pdl, tl, triton
from .fp8_linear import FP8, FP8_MAX, MIN_SCALE, quantize_fp8_rows_ref, quantize_row


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_out: bool = False):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Like HF Llama: cast the normalised value to x's dtype before scaling by the weight.
    y = (weight * normed.to(x.dtype)).to(x.dtype)
    return quantize_fp8_rows_ref(y) if fp8_out else y


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     fp8_out: bool = False, extra: torch.Tensor | None = None):
    """rms_norm(residual + x), residual updated in place. extra: fp32 [T, H] added to x first, the
    sum rounded to x's dtype (a row-parallel projection's LoRA share: RowParallelLinear.defer_lora_sum)."""
    if extra is not None:
        x = (x.float() + extra).to(x.dtype)
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps, fp8_out)


def norm_warps(block: int) -> int:
    """Warps for a program that normalises one row of `block` columns."""
    return min(max(block // 512, 1), 16)


@triton.jit
def _add_and_normalise(x, x_ptr, residual_ptr, residual_ptrs, weight_ptr, cols, mask, hidden, eps,
                       HAS_RESIDUAL: tl.constexpr):
    """weight * rms_norm(x [+ residual]) in fp32, rounded where add_rms_norm_ref rounds: the sum
    to the residual's dtype (stored back at residual_ptrs, then normalised), the normalised row
    to x's dtype before the weight. x: the row in fp32."""
    if HAS_RESIDUAL:
        summed = (x + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)  # normalise the stored (rounded) residual, as the reference does
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # x's dtype, as the reference
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return normed * weight


@fast_launch
@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, scale_ptr, extra_ptr, hidden, x_stride, residual_stride,
                     y_stride, part_stride, extra_stride, eps, fp8_max, min_scale, HAS_RESIDUAL: tl.constexpr,
                     FP8_OUT: tl.constexpr, PARTS: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr,
                     SOFT_ROUND: tl.constexpr, PDL: tl.constexpr):
    """PARTS > 0: x holds PARTS fp32 partial sums of each row (a projection split over K,
    add_rms_norm_triton's `x` [PARTS, T, H]), added up here and rounded to the residual's dtype as
    the projection's own output would have been; the residual's dtype then stands for x's.
    HAS_EXTRA: an fp32 row added to x's before that rounding (with or without PARTS)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    grid_dependency_wait(PDL)  # x (and the residual) come from the kernel before
    if PARTS > 0:
        x = tl.zeros([BLOCK], tl.float32)
        for part in tl.static_range(PARTS):
            x += tl.load(x_ptr + part * part_stride + row * x_stride + cols, mask=mask, other=0.0)
        dtype_ptr = residual_ptr  # x's rounding: the projection's output dtype
    else:
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dtype_ptr = x_ptr
    if HAS_EXTRA:
        x += tl.load(extra_ptr + row * extra_stride + cols, mask=mask, other=0.0)
    if PARTS > 0 or HAS_EXTRA:
        x = x.to(dtype_ptr.dtype.element_ty).to(tl.float32)
    y = _add_and_normalise(x, dtype_ptr, residual_ptr, residual_ptr + row * residual_stride + cols, weight_ptr, cols,
                           mask, hidden, eps, HAS_RESIDUAL)
    if FP8_OUT:  # as quantize_fp8_rows of y rounded to x's dtype (never with PARTS)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        y, scale = quantize_row(y, fp8_max, min_scale, SOFT_ROUND)
        tl.store(scale_ptr + row, scale)
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     fp8_out: bool, extra: torch.Tensor | None = None):
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    parts = x.shape[0] if x.dim() == 3 else 0  # fp32 partial sums [PARTS, T, H] of a split projection
    assert not parts or (residual is not None and x.dtype == torch.float32 and not fp8_out)
    assert extra is None or (residual is not None and extra.dtype == torch.float32 and extra.stride(-1) == 1
                             and not fp8_out)
    tokens, hidden = x.shape[-2:]
    dtype = residual.dtype if parts else x.dtype
    y = torch.empty(tokens, hidden, dtype=FP8 if fp8_out else dtype, device=x.device)
    scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device) if fp8_out else y  # unused without fp8
    block = next_power_of_2(hidden)
    has_residual = residual is not None
    residual = residual if has_residual else x  # unused pointer when there is no residual
    _rms_norm_kernel[(tokens,)](x, residual, weight, y, scale, x if extra is None else extra, hidden, x.stride(-2),
                                residual.stride(0), y.stride(0), x.stride(0) if parts else 0,
                                0 if extra is None else extra.stride(0), eps, FP8_MAX, MIN_SCALE,
                                HAS_RESIDUAL=has_residual, FP8_OUT=fp8_out, PARTS=parts, HAS_EXTRA=extra is not None,
                                BLOCK=block, SOFT_ROUND=not x.is_cuda, num_warps=norm_warps(block), **pdl(x))
    return (y, scale) if fp8_out else y


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_out: bool = False):
    return _launch_rms_norm(x, None, weight, eps, fp8_out)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        fp8_out: bool = False, extra: torch.Tensor | None = None):
    """add_rms_norm_ref's result; x may also be fp32 partial sums [PARTS, T, H] of a projection
    split over K (RowParallelLinear.split_sum), the sum (with `extra`) rounded to the residual's
    dtype first."""
    return _launch_rms_norm(x, residual, weight, eps, fp8_out, extra)


# ---- gated RMSNorm (the hybrid models' linear layers): weight * rms_norm(x) * silu(gate), per head ----

def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [T, H, D] (gate may be a strided view); weight [D]: weight * rms_norm(x) * silu(gate)
    over each head's D, normalised in fp32, rounded as Qwen3-Next's torch norm rounds: the normalised
    value to x's dtype, times the weight (in their common dtype), times silu(gate) in fp32, to x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * torch.nn.functional.silu(gate.float())).to(x.dtype)


@fast_launch
@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, y_ptr, heads, dim, x_stride, x_head_stride, gate_stride,
                           gate_head_stride, y_stride, y_head_stride, eps, ROUND_WEIGHTED: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token: every head's row [BLOCK_H, BLOCK_D] in one tile, one read of x and the gate and one
    write (the torch form is about ten passes over the step's [T, H, D] in fp32)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < dim)
    x = tl.load(x_ptr + t * x_stride + h[:, None] * x_head_stride + d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    normed = (x * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    weighted = tl.load(weight_ptr + d, mask=d < dim, other=0.0).to(tl.float32)[None, :] * normed
    if ROUND_WEIGHTED:  # weight * normed in x's dtype (the weight no wider than x), as the reference
        weighted = weighted.to(x_ptr.dtype.element_ty).to(tl.float32)
    g = tl.load(gate_ptr + t * gate_stride + h[:, None] * gate_head_stride + d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    y = weighted * (g * tl.sigmoid(g))
    tl.store(y_ptr + t * y_stride + h[:, None] * y_head_stride + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert x.stride(-1) == 1 and gate.stride(-1) == 1 and x.shape == gate.shape
    tokens, heads, dim = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    block_h, block_d = next_power_of_2(heads), next_power_of_2(dim)
    _gated_rms_norm_kernel[(tokens,)](x, gate, weight, y, heads, dim, x.stride(0), x.stride(1), gate.stride(0),
                                      gate.stride(1), y.stride(0), y.stride(1), eps,
                                      ROUND_WEIGHTED=torch.promote_types(weight.dtype, x.dtype) == x.dtype
                                      and x.dtype != torch.float32,
                                      BLOCK_H=block_h, BLOCK_D=block_d, num_warps=norm_warps(block_h * block_d))
    return y
