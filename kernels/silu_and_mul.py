"""Gated MLP activation: silu(gate) * up, with x = [gate | up] along the last dim; or with
GELU's tanh form (Gemma's gelu_pytorch_tanh) in place of silu: gelu_tanh_and_mul.

With `fp8_out` the output is quantised per row for the fp8 down projection (quantize_fp8_rows'
pair), in the same launch (see rms_norm.py). `extra` (fp32, x's shape): added to x first, the sum
rounded to x's dtype (the gate/up projection's LoRA share, as GatedMLP hands it over)."""
import torch
import torch.nn.functional as F

from ._triton import cdiv, fast_launch, grid_dependency_wait, next_power_of_2, pdl, tl, triton
from .fp8_linear import FP8, FP8_MAX, MIN_SCALE, quantize_fp8_rows_ref, store_quantized_row


def silu_and_mul_ref(x: torch.Tensor, fp8_out: bool = False, extra: torch.Tensor | None = None):
    return _gated_ref(x, F.silu, fp8_out, extra)


def gelu_tanh_and_mul_ref(x: torch.Tensor, fp8_out: bool = False, extra: torch.Tensor | None = None):
    return _gated_ref(x, lambda gate: F.gelu(gate, approximate="tanh"), fp8_out, extra)


def _gated_ref(x: torch.Tensor, act, fp8_out: bool, extra: torch.Tensor | None):
    if extra is not None:
        x = (x.float() + extra).to(x.dtype)
    inter = x.shape[-1] // 2
    y = (act(x[:, :inter].float()) * x[:, inter:].float()).to(x.dtype)
    return quantize_fp8_rows_ref(y) if fp8_out else y


@triton.jit
def _act(gate, GELU: tl.constexpr):
    """silu(g) = g sigmoid(g); GELU's tanh form g (1 + tanh(u)) / 2 = g sigmoid(2u), where
    u = sqrt(2/pi) (g + 0.044715 g^3)."""
    z = gate
    if GELU:
        z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    return gate / (1.0 + tl.exp(-z))


@fast_launch
@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, extra_ptr, inter, x_stride, y_stride, extra_stride, BLOCK: tl.constexpr,
                         GELU: tl.constexpr, HAS_EXTRA: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    grid_dependency_wait(PDL)  # x is the gate/up GEMM's output
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:  # rounded to x's dtype, as an expand adding into x would have left it
        extra = extra_ptr + row * extra_stride + cols
        gate = (gate + tl.load(extra, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty).to(tl.float32)
        up = (up + tl.load(extra + inter, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, (_act(gate, GELU) * up).to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, inter, x_stride, q_stride, fp8_max, min_scale,
                             BLOCK: tl.constexpr, GELU: tl.constexpr, SOFT_ROUND: tl.constexpr, PDL: tl.constexpr):
    """One row whole (BLOCK >= inter): its largest |y| scales it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    grid_dependency_wait(PDL)
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = (_act(gate, GELU) * up).to(x_ptr.dtype.element_ty).to(tl.float32)  # as the reference
    store_quantized_row(y, q_ptr, scale_ptr, row, q_stride, cols, mask, fp8_max, min_scale, SOFT_ROUND)


def silu_and_mul_triton(x: torch.Tensor, fp8_out: bool = False, extra: torch.Tensor | None = None):
    return _gated_triton(x, fp8_out, gelu=False, extra=extra)


def gelu_tanh_and_mul_triton(x: torch.Tensor, fp8_out: bool = False, extra: torch.Tensor | None = None):
    return _gated_triton(x, fp8_out, gelu=True, extra=extra)


def _gated_triton(x: torch.Tensor, fp8_out: bool, gelu: bool, extra: torch.Tensor | None = None):
    assert x.stride(-1) == 1
    assert extra is None or (not fp8_out and extra.dtype == torch.float32 and extra.shape == x.shape
                             and extra.stride(-1) == 1)
    tokens, width = x.shape
    inter = width // 2
    if fp8_out:
        q = torch.empty(tokens, inter, dtype=FP8, device=x.device)
        scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
        block = next_power_of_2(inter)
        _silu_and_mul_fp8_kernel[(tokens,)](x, q, scale, inter, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE,
                                            BLOCK=block, GELU=gelu, SOFT_ROUND=not x.is_cuda,
                                            num_warps=min(max(block // 1024, 1), 16), **pdl(x))
        return q, scale
    y = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(tokens, cdiv(inter, block))](x, y, x if extra is None else extra, inter, x.stride(0),
                                                       y.stride(0), 0 if extra is None else extra.stride(0),
                                                       BLOCK=block, GELU=gelu, HAS_EXTRA=extra is not None,
                                                       num_warps=4, **pdl(x))
    return y
