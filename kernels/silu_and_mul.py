"""Gated MLP activation: silu(gate) * up, with x = [gate | up] along the last dim."""
import torch
import torch.nn.functional as F

from ._triton import fast_launch, tl, triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return (F.silu(x[:, :inter].float()) * x[:, inter:].float()).to(x.dtype)


@fast_launch
@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, inter, x_stride, y_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(y_ptr + row * y_stride + cols, (silu * up).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.stride(-1) == 1
    tokens, width = x.shape
    inter = width // 2
    y = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](x, y, inter, x.stride(0), y.stride(0), BLOCK=block,
                                                              num_warps=4)
    return y
