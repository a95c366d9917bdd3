"""RMSNorm (Llama): y = weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32."""
import torch

from ._triton import tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Like HF Llama: cast the normalised value to x's dtype before scaling by the weight.
    return (weight * normed.to(x.dtype)).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    raise NotImplementedError


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    raise NotImplementedError
