"""RMSNorm (Llama): y = weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32."""
import torch

from ._triton import fast_launch, tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Like HF Llama: cast the normalised value to x's dtype before scaling by the weight.
    return (weight * normed.to(x.dtype)).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


@fast_launch
@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, hidden, x_stride, residual_stride, y_stride, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * residual_stride + cols
        summed = (x + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)  # normalise the stored (rounded) residual, as the reference does
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inv_rms).to(y_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, (normed * weight).to(y_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    tokens, hidden = x.shape
    y = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    residual = residual if has_residual else x  # unused pointer when there is no residual
    _rms_norm_kernel[(tokens,)](x, residual, weight, y, hidden, x.stride(0), residual.stride(0), y.stride(0), eps,
                                HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=min(max(block // 512, 1), 16))
    return y


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, residual, weight, eps)
