"""gpt-oss's experts: the MXFP4 dequantisation against transformers' own, the reference MoE (biases,
clamped SwiGLU) against transformers' GptOssExperts on the same weights, and the Triton kernels
(under the interpreter on the CPU) against the reference with bf16-style and MXFP4 weights."""
import os

import pytest
import torch
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from lightllm.kernels._triton import tl, triton
from lightllm.kernels.fp8_linear import FP8, quantize_fp8_weight
from lightllm.kernels.fused_moe import (DECODE_PLAN, dequantize_mxfp4, fused_moe_ref, fused_moe_triton, load_mxfp4_tile,
                                        mxfp4_to_fp8)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, EXPERTS = 64, 96, 4  # multiples of MXFP4's 32-value groups; INTER no multiple of the blocks
SWIGLU = (1.702, 7.0)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# bf16: the interpreter rounds fp32 -> bf16 toward zero (test_kernels.py), a bias that sums over K
SCALED_TOL = {torch.float32: dict(atol=1e-5, rtol=0), torch.bfloat16: dict(atol=3e-2, rtol=0)}


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def mxfp4(rows: int, cols: int, experts: int = EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed weights [E, rows, cols / 2] and scales [E, rows, cols / 32] of about unit
    size over sqrt(cols): every nibble, signs and zeros included."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=DEVICE)
    scales = torch.randint(121, 125, (experts, rows, cols // 32), dtype=torch.uint8, device=DEVICE)
    return blocks, scales


@triton.jit
def _decode_tiles_kernel(w_ptr, scale_ptr, out_ptr, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr):
    """out [ROWS, K]: the rows' weights, decoded one [BLOCK_K, ROWS] tile a program by load_mxfp4_tile."""
    k0 = tl.program_id(0) * BLOCK_K
    rows = tl.arange(0, ROWS)
    even, odd = load_mxfp4_tile(w_ptr + rows[None, :] * (K // 2), scale_ptr + rows[None, :] * (K // 32), k0,
                                (rows < ROWS)[None, :], K, BLOCK_K, EVEN_K, out_ptr.dtype.element_ty)
    even_k = k0 + 2 * tl.arange(0, BLOCK_K // 2)
    out = out_ptr + rows[None, :] * K + even_k[:, None]
    mask = (even_k < K)[:, None]
    tl.store(out, even, mask=mask)
    tl.store(out + 1, odd, mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,block_k", [(256, 64), (224, 64), (96, 32)])
def test_mxfp4_tile_decode_is_bitwise_dequantize_mxfp4(dtype, k, block_k):
    """The kernels' tile decode (integer bit patterns, the scale added into the exponent field) gives
    dequantize_mxfp4's bits for every byte (both nibbles: zeros, -0, every magnitude) under every
    scale of the exact range 2..252 (2^-125 .. 2^125), K tails included."""
    rows = 64
    blocks = torch.arange(rows * k // 2).remainder(256).to(torch.uint8).view(rows, k // 2)
    blocks = blocks[:, torch.randperm(k // 2)]
    scales = (2 + torch.randperm(rows * k // 32) % 251).to(torch.uint8).view(rows, k // 32)
    out = torch.full((rows, k), float("nan"), dtype=dtype)
    _decode_tiles_kernel[(triton.cdiv(k, block_k),)](blocks, scales, out, K=k, ROWS=rows, BLOCK_K=block_k,
                                                     EVEN_K=k % block_k == 0)
    expected = dequantize_mxfp4(blocks, scales, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), expected.view(bits))


def routing(tokens: int, top_k: int):
    ids = torch.rand(tokens, EXPERTS, device=DEVICE).argsort(dim=1)[:, :top_k].to(torch.int32)
    return torch.softmax(torch.randn(tokens, top_k, device=DEVICE), dim=1), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_is_transformers(dtype):
    blocks, scales = mxfp4(2 * INTER, HIDDEN)
    scales[0, 0, 0], scales[0, 1, 0] = 127, 100  # scale 1 and a small one beside the random ones
    ours = dequantize_mxfp4(blocks, scales, dtype)
    # transformers reads the checkpoint's [E, rows, K / 32, 16] and returns [E, K, rows]
    theirs = convert_moe_packed_tensors(blocks.view(EXPERTS, 2 * INTER, HIDDEN // 32, 16), scales, dtype=dtype)
    assert ours.dtype == dtype and torch.equal(ours, theirs.transpose(1, 2))


@pytest.mark.parametrize("spread", [0, 3, 14])
def test_mxfp4_in_fp8_holds_the_same_values(spread):
    """--mxfp4_experts dequantized with --quantization fp8: every value of a row whose scale groups lie
    within 14 binades of its largest is kept exactly; the rows' largest-|w|-to-448 scales would not."""
    blocks, _ = mxfp4(2 * INTER, HIDDEN)
    scales = torch.randint(110, 111 + spread, blocks.shape[:-1][:2] + (HIDDEN // 32,), dtype=torch.uint8,
                           device=DEVICE)
    scales[..., 0] = 110 + spread  # each row's spread reached
    exact = dequantize_mxfp4(blocks, scales, torch.float32)
    values, row_scales = mxfp4_to_fp8(blocks, scales)
    assert values.dtype == FP8 and row_scales.shape == exact.shape[:-1]
    assert torch.equal(values.float() * row_scales[..., None], exact)
    q, amax_scales = quantize_fp8_weight(exact.flatten(0, 1))
    assert not torch.equal(q.float() * amax_scales.T, exact.flatten(0, 1))


def test_reference_with_biases_and_swiglu_is_transformers_experts():
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    hf = GptOssExperts(config)
    w_gate_up, w_down = torch.randn(EXPERTS, 2 * INTER, HIDDEN) / 4, torch.randn(EXPERTS, HIDDEN, INTER) / 4
    gate_up_bias, down_bias = torch.randn(EXPERTS, 2 * INTER), torch.randn(EXPERTS, HIDDEN)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w_gate_up.transpose(1, 2))
        hf.down_proj.copy_(w_down.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(gate_up_bias)
        hf.down_proj_bias.copy_(down_bias)
        x = torch.randn(9, HIDDEN) * 3  # large enough that the clamp at 7 bites
        weights, ids = (t.cpu() for t in routing(9, 2))  # transformers' experts on the CPU, as x
        expected = hf(x, ids.long(), weights)
    got = fused_moe_ref(x, w_gate_up, w_down, weights, ids, gate_up_bias=gate_up_bias, down_bias=down_bias,
                        swiglu=SWIGLU)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (7, 3)])
@pytest.mark.parametrize("weights_format", ["dense", "mxfp4"])
def test_triton_with_biases_and_swiglu_matches_ref(dtype, tokens, top_k, weights_format):
    if weights_format == "mxfp4":
        (w_gate_up, gate_up_scale), (w_down, down_scale) = mxfp4(2 * INTER, HIDDEN), mxfp4(HIDDEN, INTER)
    else:
        w_gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEVICE) / 4).to(dtype)
        w_down = (torch.randn(EXPERTS, HIDDEN, INTER, device=DEVICE) / 4).to(dtype)
        gate_up_scale = down_scale = None
    biases = dict(gate_up_bias=torch.randn(EXPERTS, 2 * INTER, device=DEVICE).to(dtype),
                  down_bias=torch.randn(EXPERTS, HIDDEN, device=DEVICE).to(dtype))
    x = (torch.randn(tokens, HIDDEN, device=DEVICE) * 3).to(dtype)
    args = (x, w_gate_up, w_down, *routing(tokens, top_k), gate_up_scale, down_scale)
    expected = fused_moe_ref(*args, **biases, swiglu=SWIGLU)
    got = fused_moe_triton(*args, **biases, swiglu=SWIGLU, plan=DECODE_PLAN)
    assert got.dtype == dtype
    # bf16: the paths round the biased sums at different points; outputs reach ~100, so relative to the largest
    scale = expected.float().abs().max()
    torch.testing.assert_close(got.float() / scale, expected.float() / scale, **SCALED_TOL[dtype])
