"""Gated MLP activation: silu(gate) * up, with x = [gate | up] along the last dim; or with
GELU's tanh form (Gemma's gelu_pytorch_tanh) in place of silu: gelu_tanh_and_mul.

With `fp8_out` the output is quantised per row for the fp8 down projection (quantize_fp8_rows'
pair), in the same launch (see rms_norm.py)."""
import torch
import torch.nn.functional as F

from ._triton import cdiv, fast_launch, next_power_of_2, tl, triton
from .fp8_linear import FP8, FP8_MAX, MIN_SCALE, quantize_fp8_rows_ref, round_to_e4m3, store_quantized_row

# fp8_out: rows up to this wide are held whole by one program; wider ones (an 8B model's 14336)
# go in chunks of FP8_CHUNK columns, twice (_silu_and_mul_fp8_chunked_kernel): a whole row of
# them fills most of an SM's registers, so one program at a time ran on each SM and the kernel
# alternated between loading and reducing.
FP8_WHOLE_ROW_MAX = 4096
FP8_CHUNK = 1024


def silu_and_mul_ref(x: torch.Tensor, fp8_out: bool = False):
    return _gated_ref(x, F.silu, fp8_out)


def gelu_tanh_and_mul_ref(x: torch.Tensor, fp8_out: bool = False):
    return _gated_ref(x, lambda gate: F.gelu(gate, approximate="tanh"), fp8_out)


def _gated_ref(x: torch.Tensor, act, fp8_out: bool):
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
def _silu_and_mul_kernel(x_ptr, y_ptr, inter, x_stride, y_stride, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, (_act(gate, GELU) * up).to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, inter, x_stride, q_stride, fp8_max, min_scale,
                             BLOCK: tl.constexpr, GELU: tl.constexpr):
    """One row whole (BLOCK >= inter): its largest |y| scales it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = (_act(gate, GELU) * up).to(x_ptr.dtype.element_ty).to(tl.float32)  # as the reference
    store_quantized_row(y, q_ptr, scale_ptr, row, q_stride, cols, mask, fp8_max, min_scale)


@triton.jit
def _gated_chunk(x_row, cols, inter, GELU: tl.constexpr, EVICT: tl.constexpr):
    """act(gate) * up of columns `cols` of one row, rounded to x's dtype as the reference (masked
    columns give 0)."""
    mask = cols < inter
    gate = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return (_act(gate, GELU) * up).to(x_row.dtype.element_ty).to(tl.float32)


@fast_launch
@triton.jit
def _silu_and_mul_fp8_chunked_kernel(x_ptr, q_ptr, scale_ptr, inter, x_stride, q_stride, fp8_max, min_scale,
                                     BLOCK: tl.constexpr, GELU: tl.constexpr):
    """One row in BLOCK-column chunks, twice: the first pass finds its largest |y|, the second
    computes y again, scales and stores it (quantize_row's arithmetic, chunk by chunk). The first
    pass's loads ask L2 to keep the row, so the second reads it from there."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    top = tl.zeros([BLOCK], tl.float32)
    for start in range(0, inter, BLOCK):
        top = tl.maximum(top, tl.abs(_gated_chunk(x_row, start + tl.arange(0, BLOCK), inter, GELU, "evict_last")))
    scale = tl.maximum(tl.max(top, axis=0) / fp8_max, min_scale)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _gated_chunk(x_row, cols, inter, GELU, "evict_first")
        q = round_to_e4m3(tl.clamp(tl.div_rn(y, scale), -fp8_max, fp8_max))
        tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=cols < inter)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_triton(x: torch.Tensor, fp8_out: bool = False):
    return _gated_triton(x, fp8_out, gelu=False)


def gelu_tanh_and_mul_triton(x: torch.Tensor, fp8_out: bool = False):
    return _gated_triton(x, fp8_out, gelu=True)


def _gated_triton(x: torch.Tensor, fp8_out: bool, gelu: bool):
    assert x.stride(-1) == 1
    tokens, width = x.shape
    inter = width // 2
    if fp8_out:
        q = torch.empty(tokens, inter, dtype=FP8, device=x.device)
        scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
        if inter > FP8_WHOLE_ROW_MAX:
            _silu_and_mul_fp8_chunked_kernel[(tokens,)](x, q, scale, inter, x.stride(0), q.stride(0), FP8_MAX,
                                                        MIN_SCALE, BLOCK=FP8_CHUNK, GELU=gelu, num_warps=4)
            return q, scale
        block = next_power_of_2(inter)
        _silu_and_mul_fp8_kernel[(tokens,)](x, q, scale, inter, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE,
                                            BLOCK=block, GELU=gelu, num_warps=min(max(block // 1024, 1), 16))
        return q, scale
    y = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(tokens, cdiv(inter, block))](x, y, inter, x.stride(0), y.stride(0), BLOCK=block,
                                                       GELU=gelu, num_warps=4)
    return y
