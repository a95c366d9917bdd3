"""Every Triton kernel against its torch reference, and each reference against an independent
computation. Without a GPU the Triton kernels run on CPU tensors under TRITON_INTERPRET=1
(see conftest.py); shapes are kept small because the interpreter is slow.
Relies on transformers' LlamaRMSNorm and apply_rotary_pos_emb as the independent norm and rotary."""
import importlib
import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from lightllm.kernels import _triton
from lightllm.kernels._triton import HAS_TRITON, attention_shared_bytes, fp8_dot_dtype, tl, triton, zeroed_counters
from lightllm.kernels.apply_penalties import apply_penalties_ref, apply_penalties_triton
from lightllm.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from lightllm.kernels.extend_attention import (extend_attention_ref, extend_attention_triton, extend_block_m,
                                               extend_launch, extend_q_blocks,
                                               max_q_blocks)
from lightllm.kernels.fp8_linear import (FP8_MAX, NUM_COUNTERS, SMALL_M_MAX, fp8_gemm_ref, fp8_gemm_small_m,
                                         fp8_gemm_triton, fp8_linear_ref, fp8_linear_triton, quantize_fp8_rows_ref,
                                         quantize_fp8_rows_triton, quantize_fp8_weight)
from lightllm.kernels.greedy_sample import greedy_sample_ref, greedy_sample_triton
from lightllm.kernels.random_uniform import random_uniform_ref, random_uniform_triton
from lightllm.kernels.rms_norm import (add_rms_norm_ref, add_rms_norm_triton, gated_rms_norm_ref, gated_rms_norm_triton,
                                      rms_norm_ref, rms_norm_triton)
from lightllm.kernels.rotary_kv import rotary_kv_ref, rotary_kv_triton
from lightllm.kernels.silu_and_mul import (gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton, silu_and_mul_ref,
                                           silu_and_mul_triton)

# The package's public `decode_attention` function shadows the submodule of the same name.
decode_module = importlib.import_module("lightllm.kernels.decode_attention")
extend_attention_module = importlib.import_module("lightllm.kernels.extend_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# fp32: the kernel and the reference differ only in summation order and exp vs exp2.
# bf16: outputs are rounded to bf16 (ulp 2^-8 relative), and the interpreter rounds fp32 -> bf16
# toward zero where torch rounds to nearest, so one more ulp; attention also feeds bf16
# probabilities to the P @ V product, as the GPU kernel does.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
PROMPT_LENS = [1, 7, 33]
HEADS = [(4, 2, 64), (4, 1, 128)]  # (query heads, kv heads, head_dim): GQA and MQA


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")  # shown with a failure, to reproduce it


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def assert_close(actual, expected, tol):
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


# ---------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 128])
def test_rms_norm_triton_matches_ref(dtype, hidden):
    x, weight = randn(5, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_ref_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data.copy_(randn(64))
    x = randn(9, 64, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_triton_matches_ref(dtype):
    x, weight = randn(6, 96, dtype=dtype), randn(96, dtype=dtype)
    residual = randn(6, 96, dtype=dtype)
    residual_triton = residual.clone()
    expected = add_rms_norm_ref(x, residual, weight, 1e-6)
    actual = add_rms_norm_triton(x, residual_triton, weight, 1e-6)
    assert_close(residual_triton, residual, TOL[dtype])
    assert_close(actual, expected, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim,weight_dtype", [(3, 8, None), (6, 128, None), (4, 16, torch.float32)])
def test_gated_rms_norm_triton_matches_ref(dtype, heads, dim, weight_dtype):
    """Every head of a token in one program (3 and 6: a tile of padded heads), the gate a strided
    view (a slice of the linear layer's projection, as the model passes it), the weight in x's
    dtype (rounded with it) or in fp32 (not)."""
    x = randn(5, heads, dim, dtype=dtype)
    projection = randn(5, 3 * heads * dim, dtype=dtype)
    gate = projection[:, heads * dim: 2 * heads * dim].view(5, heads, dim)
    weight = randn(dim, dtype=weight_dtype or dtype)
    assert not gate.is_contiguous()
    expected = gated_rms_norm_ref(x, gate, weight, 1e-6)
    actual = gated_rms_norm_triton(x, gate, weight, 1e-6)
    assert actual.dtype == expected.dtype == dtype
    # bf16: the kernel rounds three times (normed, times the weight, times the gate's silu), toward
    # zero in the interpreter, the reference to nearest: up to 3.5 bf16 steps of 2^-7 relative
    # (3,000 seeds: 3 steps at worst, seed 2541's 8.0 against 8.1875), past TOL's 2e-2.
    tol = TOL[dtype] if dtype is torch.float32 else dict(atol=2e-2, rtol=4 * 2**-7)
    assert_close(actual, expected, tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_ref_matches_transformers(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    norm = Qwen3NextRMSNormGated(16, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data.copy_(randn(16))
    x, gate = randn(7, 16, dtype=dtype), randn(7, 16, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(gated_rms_norm_ref(x, gate, norm.weight, 1e-6), norm(x, gate))


@pytest.mark.parametrize("parts", [2, 3])
def test_add_rms_norm_adds_a_split_projections_partial_sums(parts):
    """x as fp32 partial sums [P, T, H] of a projection split over K (RowParallelLinear.split_sum):
    the norm adds them up, rounds the sum to the residual's dtype as the unsplit projection's
    output, and goes on as add_rms_norm with that output; a strided slice of T too. The sum's
    rounding to bf16 is to nearest, or toward zero under the interpreter: each value must match
    the reference with one rounding or the other (one ulp of a sum where the residual nearly
    cancels it moves the normed value by far more than the tolerance of its own size)."""
    dtype = torch.bfloat16
    partials, weight = randn(parts, 7, 96), randn(96, dtype=dtype)
    residual = randn(7, 96, dtype=dtype)
    residual_triton = residual.clone()
    outputs, residuals = _split_norm_references(partials, residual, weight)
    actual = add_rms_norm_triton(partials, residual_triton, weight, 1e-6)
    _assert_close_to_either(residual_triton, residuals)  # the bf16 sum, stored back
    assert actual.dtype == dtype
    _assert_close_to_either(actual, outputs)
    picked = torch.tensor([0, 3, 6], device=DEVICE)  # LlamaModel.forward's logit_index on partials
    residual = randn(7, 96, dtype=dtype)
    outputs, _ = _split_norm_references(partials[:, picked], residual[picked], weight)
    _assert_close_to_either(add_rms_norm_triton(partials[..., picked, :], residual[picked], weight, 1e-6), outputs)


@pytest.mark.parametrize("parts", [0, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_an_extra_fp32_share(dtype, parts):
    """`extra` (a row-parallel projection's LoRA share, RowParallelLinear.defer_lora_sum): fp32 rows
    added to x, or to its partial sums' total, before the rounding to the projection's dtype, as the
    expand would have added them to the projection's output; then add_rms_norm. bf16: the
    interpreter rounds toward zero, so either rounding (as for the partial sums)."""
    if parts and dtype == torch.float32:
        pytest.skip("partial sums come from bf16 projections")
    weight, residual = randn(96, dtype=dtype), randn(7, 96, dtype=dtype)
    x = randn(parts, 7, 96) if parts else randn(7, 96, dtype=dtype)
    extra = randn(7, 96)
    residual_triton = residual.clone()
    actual = add_rms_norm_triton(x, residual_triton, weight, 1e-6, extra=extra)
    total = (x.sum(0) if parts else x.float()) + extra
    if dtype == torch.float32:
        after = residual.clone()
        expected = add_rms_norm_ref(x, after, weight, 1e-6, extra=extra)
        assert_close(actual, expected, TOL[dtype])
        assert_close(residual_triton, after, TOL[dtype])
        assert_close(expected, add_rms_norm_ref(total, residual.clone(), weight, 1e-6), TOL[dtype])
        return
    outputs, residuals = _split_norm_references(total[None], residual, weight)
    _assert_close_to_either(residual_triton, residuals)
    _assert_close_to_either(actual, outputs)
    if not parts:  # the reference with `extra` rounds to nearest
        after = residual.clone()
        assert torch.equal(add_rms_norm_ref(x, after, weight, 1e-6, extra=extra), outputs[0])
        assert torch.equal(after, residuals[0])


def _split_norm_references(partials, residual, weight):
    """add_rms_norm_ref's (outputs, residuals) after the partials' fp32 sum is rounded to bf16 to
    nearest, and toward zero (its low 16 bits cut)."""
    summed = partials.sum(0)
    toward_zero = (summed.view(torch.int32) & -65536).view(torch.float32)
    outputs, residuals = [], []
    for rounded in (summed, toward_zero):
        after = residual.clone()
        outputs.append(add_rms_norm_ref(rounded.to(residual.dtype), after, weight, 1e-6))
        residuals.append(after)
    return outputs, residuals


def _assert_close_to_either(actual, expected: list):
    close = [torch.isclose(actual.float(), e.float(), **TOL[torch.bfloat16]) for e in expected]
    assert (close[0] | close[1]).all(), (actual.float() - expected[0].float()).abs().max()


def test_add_rms_norm_ref_adds_residual_in_place():
    x, residual, weight = randn(4, 32), randn(4, 32), randn(32)
    summed = x + residual
    y = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(residual, summed)
    assert torch.equal(y, rms_norm_ref(summed, weight, 1e-6))


# ---------------------------------------------------------------- rotary + KV write
def random_cos_sin(tokens, head_dim):
    angles = torch.rand(tokens, head_dim // 2, device=DEVICE) * 100
    return angles.cos(), angles.sin()


def qkv_views(tokens, num_q_heads, num_kv_heads, head_dim, dtype=torch.float32):
    """q, k, v as strided views into one fused qkv projection, as the model produces them."""
    qkv = randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim), v.view(tokens, -1, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_rotary_kv_triton_matches_ref(dtype, num_q_heads, num_kv_heads, head_dim, slot_dtype):
    q, k, v = qkv_views(7, num_q_heads, num_kv_heads, head_dim, dtype)
    cos, sin = random_cos_sin(7, head_dim)
    k_cache, v_cache = randn(20, num_kv_heads, head_dim, dtype=dtype), randn(20, num_kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(20, device=DEVICE)[:7].to(slot_dtype)
    q_ref, k_before, k_cache_ref, v_cache_ref = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    rotary_kv_ref(q_ref, k, v, cos, sin, k_cache_ref, v_cache_ref, slots)
    rotary_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert_close(q, q_ref, TOL[dtype])
    assert_close(k_cache, k_cache_ref, TOL[dtype])
    assert torch.equal(v_cache, v_cache_ref) and torch.equal(k, k_before)  # v copied exactly, k left as it was


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_adds_an_extra_fp32_share(dtype):
    """`extra` (q/k/v's LoRA share in the projection's layout, Attention): added to q, k and v first,
    each sum rounded to their dtype; q keeps it, the caches take the rotated k and the v with it. The
    reference equals rotary_kv_ref of those rounded sums; the kernel the reference."""
    q, k, v = qkv_views(7, 4, 2, 64, dtype)
    extra = randn(7, (4 + 2 * 2) * 64)
    cos, sin = random_cos_sin(7, 64)
    caches = [randn(20, 2, 64, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(20, device=DEVICE)[:7]
    q_ref, k_cache_ref, v_cache_ref = q.clone(), caches[0].clone(), caches[1].clone()
    rotary_kv_ref(q_ref, k, v, cos, sin, k_cache_ref, v_cache_ref, slots, extra=extra)
    shares = [s.view(7, -1, 64) for s in extra.split([256, 128, 128], dim=-1)]
    q_sum, k_sum, v_sum = ((t.float() + s).to(dtype) for t, s in zip((q, k, v), shares))
    k_cache_sum, v_cache_sum = caches[0].clone(), caches[1].clone()
    rotary_kv_ref(q_sum, k_sum, v_sum, cos, sin, k_cache_sum, v_cache_sum, slots)
    assert torch.equal(q_ref, q_sum) and torch.equal(k_cache_ref, k_cache_sum) and torch.equal(v_cache_ref, v_cache_sum)
    assert not torch.allclose(v_cache_ref[slots].float(), v.float(), **TOL[dtype])
    k_before = k.clone()
    rotary_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots, extra=extra)
    if dtype == torch.bfloat16:
        # The kernel rounds each sum and each rotated value to bf16 in its own direction (toward zero
        # under TRITON_INTERPRET), the reference to nearest: a rotated value is then apart by up to
        # one bf16 step (2^-7 of the magnitude) of each of the two sums it combines and of itself,
        # which near zero, after cancellation, exceeds TOL's absolute part.
        for actual, expected, sums in ((q, q_ref, q_sum), (caches[0][slots], k_cache_ref[slots], k_sum)):
            bound = 2 ** -7 * (2 * sums.float().abs().amax(-1, keepdim=True) + expected.float().abs())
            assert ((actual.float() - expected.float()).abs() <= bound).all()
        written = torch.zeros(20, dtype=torch.bool, device=DEVICE).index_fill_(0, slots, True)
        assert torch.equal(caches[0][~written], k_cache_ref[~written])
    else:
        assert_close(q, q_ref, TOL[dtype])
        assert_close(caches[0], k_cache_ref, TOL[dtype])
    assert_close(caches[1], v_cache_ref, TOL[dtype])
    assert torch.equal(k, k_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_into_an_fp8_cache_triton_matches_ref(dtype):
    """--kv_cache_dtype fp8_e4m3: k and v rounded to the nearest e4m3 value, saturating at 448."""
    q, k, v = qkv_views(7, 4, 2, 64, dtype)
    v[0, 0, :3] = torch.tensor([1000.0, -600.0, 3e-4], dtype=dtype)  # saturates both ways; a subnormal
    cos, sin = random_cos_sin(7, 64)
    k_cache, v_cache = (torch.zeros(20, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2))
    slots = torch.randperm(20, device=DEVICE)[:7]
    q_ref, k_cache_ref, v_cache_ref = q.clone(), k_cache.clone(), v_cache.clone()
    rotary_kv_ref(q_ref, k, v, cos, sin, k_cache_ref, v_cache_ref, slots)
    rotary_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert_close(q, q_ref, TOL[dtype])
    assert torch.equal(v_cache.float(), v_cache_ref.float())
    assert v_cache_ref[slots[0], 0, :2].float().tolist() == [448.0, -448.0]
    assert torch.equal(v_cache_ref[slots].float(), v.float().clamp(-448, 448).to(torch.float8_e4m3fn).float())
    # k: the same fp32 rotation on both sides, unless summation order moves a value across a rounding boundary
    assert (k_cache.float() == k_cache_ref.float()).float().mean() > 0.99
    assert_close(k_cache, k_cache_ref, dict(atol=2**-9, rtol=0.13))


def test_rotary_kv_ref_matches_transformers_and_writes_only_the_slots():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, v = randn(5, 4, 64), randn(5, 2, 64), randn(5, 2, 64)
    cos, sin = random_cos_sin(5, 64)
    k_cache, v_cache = randn(10, 2, 64), randn(10, 2, 64)
    slots = torch.tensor([7, 2, 5, 0, 9], dtype=torch.int32, device=DEVICE)
    untouched = torch.ones(10, dtype=torch.bool, device=DEVICE)
    untouched[slots.long()] = False
    k_kept, v_kept = k_cache[untouched].clone(), v_cache[untouched].clone()
    # transformers: q/k [batch, heads, tokens, D], cos/sin [batch, tokens, D] with both halves equal
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin)
    rotary_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, q_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache[slots.long()], k_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache[slots.long()], v)
    assert torch.equal(k_cache[untouched], k_kept) and torch.equal(v_cache[untouched], v_kept)


# ---------------------------------------------------------------- silu_and_mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 1500])
def test_silu_and_mul_triton_matches_ref(dtype, inter):
    x = randn(4, 2 * inter, dtype=dtype)
    assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), TOL[dtype])


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_and_mul_adds_an_extra_fp32_share(dtype, gelu):
    """`extra` (gate/up's LoRA share, GatedMLP): fp32 added to gate and up, each sum rounded to x's
    dtype as an expand adding into the projection's output would have left it. The kernel against
    the reference, and the reference against the activation of that rounded sum (bf16 under the
    interpreter, which rounds toward zero: within the tolerance of one more rounding)."""
    triton_fn, ref = ((gelu_tanh_and_mul_triton, gelu_tanh_and_mul_ref) if gelu
                      else (silu_and_mul_triton, silu_and_mul_ref))
    x, extra = randn(5, 2 * 96, dtype=dtype), randn(5, 2 * 96)
    expected = ref(x, extra=extra)
    assert torch.equal(expected, ref((x.float() + extra).to(dtype)))
    assert not torch.allclose(expected.float(), ref(x).float(), **TOL[dtype])
    assert_close(triton_fn(x, extra=extra), expected, TOL[dtype])


def test_silu_and_mul_ref_is_gated_silu():
    x = randn(3, 20)
    gate, up = x[:, :10], x[:, 10:]
    torch.testing.assert_close(silu_and_mul_ref(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 1500])
def test_gelu_tanh_and_mul_triton_matches_ref(dtype, inter):
    x = 3 * randn(4, 2 * inter, dtype=dtype)  # wide enough to reach GELU's tails
    assert_close(gelu_tanh_and_mul_triton(x), gelu_tanh_and_mul_ref(x), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_fp8_out_triton_matches_ref(dtype):
    x = randn(5, 2 * 80, dtype=dtype) * 3  # as the silu test below
    q, scale = gelu_tanh_and_mul_triton(x, fp8_out=True)
    q_ref, scale_ref = gelu_tanh_and_mul_ref(x, fp8_out=True)
    torch.testing.assert_close(scale, scale_ref, rtol=2e-5 if dtype is torch.float32 else 2 * 2**-7, atol=0)
    assert_within_one_fp8_step(q, scale, q_ref, scale_ref)


def test_gelu_tanh_and_mul_ref_is_gated_tanh_gelu():
    """Gemma's gelu_pytorch_tanh, written out: g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up."""
    x = 3 * randn(3, 20)
    gate, up = x[:, :10], x[:, 10:]
    gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), gelu * up)


# ---------------------------------------------------------------- decode attention
def decode_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, dtype, num_slots=400):
    """Requests in scattered rows of a token table; entries past each length are -1 (never read)."""
    batch, width = len(seq_lens), max(seq_lens) + 5
    req_rows = torch.randperm(batch + 3, device=DEVICE)[:batch].to(torch.int32)
    req_to_token = torch.full((batch + 3, width), -1, dtype=torch.int32, device=DEVICE)
    for row, length in zip(req_rows.tolist(), seq_lens):
        req_to_token[row, :length] = torch.randperm(num_slots, device=DEVICE)[:length].to(torch.int32)
    q = randn(batch, num_q_heads, head_dim, dtype=dtype)
    k_cache = randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
    v_cache = randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, req_to_token, req_rows, lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEADS + [(8, 2, 64)])
@pytest.mark.parametrize("waves", [0, 64], ids=["one-split", "split-k"])
def test_decode_attention_triton_matches_ref(dtype, num_q_heads, num_kv_heads, head_dim, waves, monkeypatch):
    # WAVES drives the split plan: 0 gives one chunk per request, 64 several, so the merge is tested
    # (the longest request past a chunk's fewest keys); the short ones fit one chunk and skip it.
    monkeypatch.setattr(decode_module, "WAVES", waves)
    seq_lens = PROMPT_LENS + [decode_module.MIN_CHUNK + 100]
    num_splits, *_ = decode_module._split_plan(len(seq_lens), num_kv_heads, max(seq_lens), torch.device(DEVICE))
    assert (num_splits > 1) == (waves > 1)
    args = decode_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, dtype) + (max(seq_lens), head_dim ** -0.5)
    # The output goes to rows of a larger buffer, as the layers pass it (one output for decodes and
    # chunks), here with a head stride wider than the heads: rows and heads outside stay untouched.
    buffer = torch.full((len(seq_lens) + 2, num_q_heads + 1, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[1:-1, :num_q_heads]
    assert decode_attention_triton(*args, out=out) is out
    assert_close(out, decode_attention_ref(*args), ATTN_TOL[dtype])
    assert buffer[[0, -1]].isnan().all() and buffer[:, num_q_heads].isnan().all()


@pytest.mark.parametrize("min_chunk", [None, 64, 256])  # None: the plan's own (one or two requests: 64)
def test_decode_attention_split_launches_leave_their_counters_at_zero(min_chunk, monkeypatch):
    """The chunks of a request are merged by the last of its programs to count itself done, and
    that program zeroes the (request, kv head)'s counter; a request whose keys fit one chunk (at
    most min_chunk, rounded up to the block) writes its output directly and never counts. After
    launches of different plans in a row (the counters shared, as by the layers of a step) each
    output is the reference's and every counter is back at zero."""
    monkeypatch.setattr(decode_module, "WAVES", 64)
    for seq_lens, num_kv_heads in (([5, 130, 37, 300], 2), ([200, 1, 64], 4), ([300] * 6, 2), ([256, 9], 2),
                                   ([700], 2), ([90, 400], 2)):
        args = decode_batch(seq_lens, 8, num_kv_heads, 64, torch.float32, num_slots=800) + (max(seq_lens), 0.125)
        num_splits, _, fewest = decode_module._split_plan(len(seq_lens), num_kv_heads, max(seq_lens),
                                                          torch.device(DEVICE), min_chunk=min_chunk)
        assert num_splits > 1 or fewest >= max(seq_lens)
        got = decode_attention_triton(*args, min_chunk=min_chunk)
        assert_close(got, decode_attention_ref(*args), ATTN_TOL[torch.float32])
        assert not decode_module._chunk_counters(args[0].device).any()


@pytest.mark.parametrize("window", [0, 40])
def test_decode_attention_under_a_graph_bound_splits_each_request(window, monkeypatch):
    """A CUDA graph launches with max_req_total_len as the bound, far above the lengths that run:
    each request still cuts its own keys into the plan's splits (one program would otherwise take
    a short request's keys alone), and the result equals the reference's."""
    monkeypatch.setattr(decode_module, "WAVES", 64)
    seq_lens, bound = [1, 2, 64, 65, 150, 300], 8192
    num_splits, *_ = decode_module._split_plan(len(seq_lens), 2, bound, torch.device(DEVICE))
    assert num_splits > 1  # stage 1 and the merge must agree on each request's chunk
    q, k_cache, v_cache, req_to_token, req_rows, lens = decode_batch(seq_lens, 4, 2, 64, torch.float32)
    wide = torch.full((req_to_token.shape[0], bound), -1, dtype=torch.int32, device=DEVICE)
    wide[:, :req_to_token.shape[1]] = req_to_token
    args = (q, k_cache, v_cache, wide, req_rows, lens, bound, 0.125)
    assert_close(decode_attention_triton(*args, window=window), decode_attention_ref(*args, window=window),
                 ATTN_TOL[torch.float32])


@pytest.mark.parametrize("plan_batch", [6, 8, 64])
def test_decode_attention_planned_for_a_graph_bucket_is_the_reference(plan_batch, monkeypatch):
    """An eager step's decodes launch with the plan of the graph bucket they would replay (batch
    rounded up, max_req_total_len as the bound): the plan is chosen for those, not for the call's
    own batch and lengths, and the result is still the reference's."""
    monkeypatch.setattr(decode_module, "WAVES", 64)
    planned = []
    split_plan = decode_module._split_plan
    monkeypatch.setattr(decode_module, "_split_plan", lambda *a, **k: planned.append(a[:3]) or split_plan(*a, **k))
    seq_lens, bound = [3, 70, 150, 17, 300, 1], 4096
    q, k_cache, v_cache, req_to_token, req_rows, lens = decode_batch(seq_lens, 4, 2, 64, torch.float32)
    args = (q, k_cache, v_cache, req_to_token, req_rows, lens, max(seq_lens), 0.125)
    got = decode_attention_triton(*args, plan_for=(plan_batch, bound))
    assert planned == [(plan_batch, 2, bound)]
    assert_close(got, decode_attention_ref(*args, plan_for=(plan_batch, bound)), ATTN_TOL[torch.float32])
    assert not decode_module._chunk_counters(q.device).any()
    with pytest.raises(AssertionError):  # a plan for fewer requests than the call has
        decode_attention_triton(*args, plan_for=(len(seq_lens) - 1, bound))


def verify_batch(runs, num_q_heads, num_kv_heads, head_dim, num_slots=800, padding=0):
    """A step's decode rows as a verify step lays them out: each run (length, rows) is one request's
    last token and drafts, `rows` consecutive rows of lengths length .. length + rows - 1; then
    `padding` rows of a graph bucket (one shared row of length 1)."""
    q, k_cache, v_cache, req_to_token, req_rows, lens = decode_batch(
        [length + n - 1 for length, n in runs] + [1], num_q_heads, num_kv_heads, head_dim, torch.float32, num_slots)
    rows = [req_rows[i] for i, (_, n) in enumerate(runs) for _ in range(n)] + [req_rows[-1]] * padding
    lengths = [length + j for length, n in runs for j in range(n)] + [1] * padding
    q = randn(len(rows), num_q_heads, head_dim)
    return (q, k_cache, v_cache, req_to_token, torch.stack(rows),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


# Runs of 1-9 rows at lengths on either side of a multiple of the group size, single rows between
# them, and a run of one key.
VERIFY_RUNS = [(5, 5), (1, 1), (8, 3), (100, 9), (300, 2), (33, 1), (1, 4), (297, 8)]


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("waves,window", [(0, 0), (256, 0), (256, 40), (0, 40)],
                         ids=["one-split", "split-k", "split-k-window", "window"])
def test_decode_attention_groups_a_requests_rows_as_the_reference(rows, waves, window, monkeypatch):
    """A verifying request's rows (its last token and drafts, one position apart) attended by one
    program per group of up to `rows` rows, each row to its own keys: equal to each row alone
    (the reference), split or not, in a window, with a graph's padding rows after them; every
    chunk counter back at zero."""
    monkeypatch.setattr(decode_module, "WAVES", waves)
    args = verify_batch(VERIFY_RUNS, 8, 2, 64, padding=5)
    bound = int(args[5].max())
    args += (bound, 0.125)
    assert decode_module._split_plan(len(args[0]), 2, bound, torch.device(DEVICE))[0] > 1 or not waves
    got = torch.full_like(args[0], float("nan"))  # a row no group attends for stays NaN
    decode_attention_triton(*args, window=window, rows=rows, out=got)
    assert_close(got, decode_attention_ref(*args, window=window), ATTN_TOL[torch.float32])
    assert not decode_module._chunk_counters(args[0].device).any()


def test_decode_attention_group_row_that_sees_no_key_of_a_chunk(monkeypatch):
    """One request verifying one draft in a window of 128 (gpt-oss's): its two rows' keys split
    in two chunks of 128 from the first row's window start, so the second chunk holds the last
    row's newest key alone and the first row sees none of it; that row's part of the chunk weighs
    nothing in the merge (no NaN from a softmax over no key)."""
    monkeypatch.setattr(decode_module, "WAVES", 64)
    args = verify_batch([(301, 2)], 8, 2, 64)  # one group: (301 - 1) % 2 == 0
    args += (302, 0.125)
    assert decode_module._split_plan(2, 2, 128, torch.device(DEVICE))[0] == 2
    got = decode_attention_triton(*args, window=128, rows=2)
    assert_close(got, decode_attention_ref(*args, window=128), ATTN_TOL[torch.float32])


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_decode_attention_groups_cover_each_row_once(rows):
    """_group_size on the device: the groups' sizes, from the rows they lead, cover every row
    exactly once; a run of 1 + k rows is cut every `rows` rows from its first, so it takes
    ceil((1 + k) / rows) programs; padding rows (one shared row, length 1) and another request's
    rows stay alone."""
    args = verify_batch(VERIFY_RUNS, 4, 2, 16, padding=3)
    req_rows, lens = args[4], args[5]
    sizes = torch.zeros(len(lens), dtype=torch.int32, device=DEVICE)
    _group_sizes_kernel[(len(lens),)](req_rows, lens, sizes, len(lens), ROWS=rows)
    covered = torch.zeros(len(lens), dtype=torch.int32)
    for row, size in enumerate(sizes.tolist()):
        covered[row: row + size] += 1
    assert covered.tolist() == [1] * len(lens)
    first = 0
    for length, n in VERIFY_RUNS:  # each run's groups: cut every `rows` rows from its first
        cuts = list(range(0, n, rows))
        assert [j for j in range(n) if sizes[first + j] > 0] == cuts, (length, n)
        first += n
    assert sizes[first:].tolist() == [1] * 3


if HAS_TRITON:
    @triton.jit
    def _group_sizes_kernel(req_rows_ptr, seq_lens_ptr, out_ptr, batch, ROWS: tl.constexpr):
        row = tl.program_id(0)
        size = decode_module._group_size(req_rows_ptr, seq_lens_ptr, row, batch, tl.load(req_rows_ptr + row),
                                         tl.load(seq_lens_ptr + row), ROWS)
        tl.store(out_ptr + row, size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_over_an_fp8_cache_triton_matches_ref(dtype):
    """The kernels widen fp8 K/V as they read them (to fp16 under bf16 queries: fp8_dot_dtype), the
    references to fp32. Under bf16 queries the fp16 dots are closer to fp32 than bf16 dots (the old
    widening, still selectable) on average."""
    fp8 = torch.float8_e4m3fn
    q, k_cache, v_cache, req_to_token, req_rows, lens = decode_batch(PROMPT_LENS + [200], 4, 2, 64, dtype)
    args = (q, k_cache.to(fp8), v_cache.to(fp8), req_to_token, req_rows, lens, 200, 0.125)
    ref = decode_attention_ref(*args)
    assert_close(decode_attention_triton(*args), ref, ATTN_TOL[dtype])
    if dtype is torch.bfloat16:
        assert fp8_dot_dtype(q, args[1]) is torch.float16
        error = {f16: (decode_attention_triton(*args, fp8_as_f16=f16).float() - ref.float()).abs().mean()
                 for f16 in (True, False)}
        assert error[True] < error[False], error
    q, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, q_blocks = extend_batch(CHUNKS, 4, 2, 64, dtype)
    args = (q, k_cache.to(fp8), v_cache.to(fp8), req_to_token, req_rows, cu_q, kv_lens, q_blocks, 0.125)
    assert_close(extend_attention_triton(*args), extend_attention_ref(*args), ATTN_TOL[dtype])


@pytest.mark.parametrize("softcap", [0.0, 3.0])  # SDPA without a cap, the written-out scores with one
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEADS)
def test_decode_attention_ref_matches_per_request_loop(num_q_heads, num_kv_heads, head_dim, softcap):
    seq_lens = PROMPT_LENS + [50]
    q, k_cache, v_cache, req_to_token, req_rows, lens = decode_batch(
        seq_lens, num_q_heads, num_kv_heads, head_dim, torch.float32)
    # max_seqlen may exceed every length (a bucketed bound); it must not exceed the table width
    out = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, lens, req_to_token.shape[1], 0.2,
                               softcap=softcap)
    group = num_q_heads // num_kv_heads
    for b, (row, length) in enumerate(zip(req_rows.tolist(), seq_lens)):
        slots = req_to_token[row, :length].long()
        keys = k_cache[slots].repeat_interleave(group, 1)  # [L, Hq, D]
        values = v_cache[slots].repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[b], keys).mul(0.2)
        probs = (softcap * torch.tanh(scores / softcap) if softcap else scores).softmax(-1)
        expected = torch.einsum("hl,lhd->hd", probs, values)
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- extend attention
# (new tokens, tokens cached before them) per request: fresh prompts, chunks after a cached
# prefix, decodes (one new token, with and without a prefix), chunks spanning two query blocks
# and several key blocks, and one whose first query sees SPLIT_FROM_KEYS keys or more (the
# unmasked key blocks' loop).
CHUNKS = [(7, 0), (1, 90), (33, 40), (1, 0), (70, 0), (66, 100), (40, 300)]


def extend_batch(chunks, num_q_heads, num_kv_heads, head_dim, dtype, first_row=0, block_slots=None):
    """Chunks' queries packed from row `first_row` of q (the rows before stand for a step's
    decodes); their requests' K/V (chunk included) already in scattered slots; the block table
    padded to `block_slots`."""
    q_lens = [new for new, _ in chunks]
    _, k_cache, v_cache, req_to_token, req_rows, kv_lens = decode_batch(
        [new + cached for new, cached in chunks], num_q_heads, num_kv_heads, head_dim, dtype)
    cu_q = torch.tensor([first_row] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = randn(first_row + sum(q_lens), num_q_heads, head_dim, dtype=dtype)
    blocks = torch.tensor(extend_q_blocks(q_lens, head_dim, block_slots), dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, blocks.view(2, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEADS + [(2, 2, 80)])  # + MHA, D not a power of 2
def test_extend_attention_triton_matches_ref(dtype, num_q_heads, num_kv_heads, head_dim):
    args = extend_batch(CHUNKS, num_q_heads, num_kv_heads, head_dim, dtype) + (head_dim ** -0.5,)
    expected = extend_attention_ref(*args)
    assert_close(extend_attention_triton(*args), expected, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_writes_only_its_rows_with_a_padded_block_table(dtype):
    """As a graph-replayed mixed step calls it: the chunks' rows start after 3 decodes' rows of one
    output, and the block table has padding slots (chunk -1) past the real blocks."""
    q_lens = [new for new, _ in CHUNKS]
    slots = max_q_blocks(sum(q_lens), len(CHUNKS), 64) + 5
    args = extend_batch(CHUNKS, 4, 2, 64, dtype, first_row=3, block_slots=slots) + (0.125,)
    expected = extend_attention_ref(*args, out=torch.zeros_like(args[0]))[3:]
    out = torch.full_like(args[0], float("nan"))
    assert extend_attention_triton(*args, out=out) is out
    assert_close(out[3:], expected, ATTN_TOL[dtype])
    assert out[:3].isnan().all()


def test_extend_q_blocks_cover_every_query_once():
    q_lens = [1, 64, 65, 200, 3]
    chunks, blocks = (torch.tensor(extend_q_blocks(q_lens, 64, 20)).view(2, -1)).tolist()
    covered = sorted((c, b * 64 + i) for c, b in zip(chunks, blocks) if c >= 0 for i in range(64)
                     if b * 64 + i < q_lens[c])
    assert covered == [(c, j) for c, n in enumerate(q_lens) for j in range(n)]
    used = sum(-(-n // 64) for n in q_lens)
    assert len(chunks) == 20 and chunks.count(-1) == 20 - used
    assert used <= max_q_blocks(sum(q_lens), len(q_lens), 64)
    with pytest.raises(ValueError):
        extend_q_blocks(q_lens, 64, 3)


H200_SHARED_BYTES = 232448  # a block's most shared memory, opted in (an H100's too)


@pytest.fixture
def h200_shared_memory(monkeypatch):
    """The attention wrappers bound their launches as on an H200 (on the CPU they see no limit)."""
    for module in (decode_module, extend_attention_module):
        monkeypatch.setattr(module, "shared_memory_limit", lambda device: H200_SHARED_BYTES)


def captured_attention_launches(monkeypatch, head_dim, q_dtype, kv_dtype, group):
    """(kernel name, grid, kwargs, q) of every launch the attention wrappers make for these heads:
    decode over one split, several and the few-requests plan, extend; none runs."""
    launches = []
    monkeypatch.setattr(_triton._FastKernel, "_launch",
                        lambda kernel, grid, args, kwargs: launches.append((kernel.fn.__name__, grid, kwargs, args[0])))
    q = torch.zeros(4, 2 * group, head_dim, dtype=q_dtype)
    k_cache, v_cache = (torch.zeros(64, 2, head_dim, dtype=kv_dtype) for _ in range(2))
    table, rows = torch.zeros(4, 64, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    lens = torch.full((4,), 40, dtype=torch.int32)
    for sms, batch in ((0, 4), (132, 4), (132, 1)):
        monkeypatch.setattr(decode_module, "_programs_per_wave", lambda device, sms=sms: sms)
        decode_attention_triton(q[:batch], k_cache, v_cache, table, rows[:batch], lens[:batch], 64, 0.1)
    blocks = torch.tensor(extend_q_blocks([1, 3], head_dim, 4), dtype=torch.int32).view(2, -1)
    cu_q = torch.tensor([0, 1, 4], dtype=torch.int32)
    extend_attention_triton(q, k_cache, v_cache, table, rows[:2], cu_q, lens[:2], blocks, 0.1)
    return launches


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256, 320, 512])
def test_every_attention_launch_fits_an_h200s_shared_memory(head_dim, h200_shared_memory, monkeypatch):
    """Every launch the attention wrappers choose (decode plans, extend; bf16, an fp8 cache, fp32;
    up to 32 query heads a kv head) takes at most an H200's shared memory by attention_shared_bytes,
    which gives what Triton compiles for extend attention (393216 bytes for the old extend launch at
    Gemma 4's 512-dim heads, which an H200 refused); extend's programs split its table's blocks
    evenly and hold at most 128 x 256 outputs; the launches tuned for 128-dim heads stand."""
    assert attention_shared_bytes(128, 64, 2, 512, 2, 2) == 393216
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    for (q_dtype, kv_dtype), group in itertools.product([(bf16, bf16), (bf16, fp8), (torch.float32,) * 2],
                                                        [1, 8, 32]):
        launches = captured_attention_launches(monkeypatch, head_dim, q_dtype, kv_dtype, group)
        assert sorted(name for name, *_ in launches) == ["_decode_split_kernel"] * 3 + ["_extend_kernel"]
        for name, grid, kw, q in launches:
            block_m = kw["BLOCK_G"] if name == "_decode_split_kernel" else kw["BLOCK_M"]
            used = attention_shared_bytes(block_m, kw["BLOCK_N"], kw["num_stages"], kw["BLOCK_D"], q.element_size(),
                                          kv_dtype.itemsize)
            assert used <= H200_SHARED_BYTES, (name, head_dim, q_dtype, kv_dtype, group, kw)
            if name == "_extend_kernel":
                assert kw["TABLE_M"] == extend_block_m(head_dim) and kw["TABLE_M"] % kw["BLOCK_M"] == 0
                assert kw["BLOCK_M"] * kw["BLOCK_D"] <= 128 * 256  # the output tile's registers
                assert kw["num_warps"] == (8 if kw["TABLE_M"] == 128 and kw["BLOCK_D"] > 128 else 4)
                assert grid[0] == 4 * kw["TABLE_M"] // kw["BLOCK_M"]  # each table block's every part
    if head_dim == 128:
        assert extend_launch(128, bf16, bf16, H200_SHARED_BYTES) == (64, 64, 3, 4)
        for launch in (decode_module.WHOLE_LAUNCH, decode_module.SPLIT_LAUNCH, decode_module.FEW_LAUNCH):
            assert decode_module.fit_decode_launch(launch, 16, 128, bf16, bf16, H200_SHARED_BYTES) == launch


@pytest.mark.parametrize("window", [0, 24])
def test_extend_attention_at_512_dim_heads_matches_ref(window, h200_shared_memory):
    """Gemma 4's global heads (fp32): programs of 64 queries over the table's blocks of 128 (a chunk
    of 70 spans both halves of one), 16 keys a step."""
    assert extend_launch(512, torch.float32, torch.float32, H200_SHARED_BYTES)[:2] == (64, 16)
    chunks = [(3, 0), (70, 50), (1, 20)]
    args = extend_batch(chunks, 2, 1, 512, torch.float32) + (512 ** -0.5,)
    assert_close(extend_attention_triton(*args, window=window), extend_attention_ref(*args, window=window),
                 ATTN_TOL[torch.float32])


@pytest.mark.parametrize("waves", [0, 64], ids=["one-split", "split-k"])
def test_decode_attention_at_512_dim_heads_matches_ref(waves, h200_shared_memory, monkeypatch):
    monkeypatch.setattr(decode_module, "WAVES", waves)
    seq_lens = [5, decode_module.MIN_CHUNK + 40]
    args = decode_batch(seq_lens, 4, 1, 512, torch.bfloat16) + (max(seq_lens), 512 ** -0.5)
    assert_close(decode_attention_triton(*args), decode_attention_ref(*args), ATTN_TOL[torch.bfloat16])


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEADS)
def test_extend_attention_ref_matches_sdpa_over_each_full_sequence(num_q_heads, num_kv_heads, head_dim):
    """Causal SDPA over a request's whole sequence; its last q_len rows are the chunk's output."""
    _, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, q_blocks = extend_batch(
        CHUNKS, num_q_heads, num_kv_heads, head_dim, torch.float32)
    full_q = [randn(new + cached, num_q_heads, head_dim) for new, cached in CHUNKS]
    q = torch.cat([seq_q[cached:] for seq_q, (_, cached) in zip(full_q, CHUNKS)])
    out = extend_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, q_blocks, 0.3)
    group = num_q_heads // num_kv_heads
    for i, (row, (new, cached)) in enumerate(zip(req_rows.tolist(), CHUNKS)):
        slots = req_to_token[row, :new + cached].long()
        keys, values = (cache[slots].transpose(0, 1).repeat_interleave(group, 0) for cache in (k_cache, v_cache))
        expected = F.scaled_dot_product_attention(full_q[i].transpose(0, 1), keys, values, is_causal=True, scale=0.3)
        start = cu_q[i].item()
        # fp32 sums in two orders: 1.2e-5 apart at worst seen, where 1e-5 was asked (ATTN_TOL's bound)
        torch.testing.assert_close(out[start:start + new], expected.transpose(0, 1)[cached:], **ATTN_TOL[torch.float32])


@pytest.mark.parametrize("q_len,n", [(1, 1), (1, 50), (9, 9), (9, 50), (64, 64)])
@pytest.mark.parametrize("window", [0, 1, 7])
def test_extend_attention_refs_sdpa_path_is_the_written_out_math(q_len, n, window):
    """The reference attends a chunk through torch's SDPA (no soft cap); the written-out scores,
    masked and softmaxed, must give the same: causal from the chunk's offset, and the window."""
    q, k, v = randn(q_len, 6, 32), randn(n, 2, 32), randn(n, 2, 32)
    got = extend_attention_module._attend_chunk(q, k, v, 0.3, window, 0.0)
    expected = extend_attention_module._attend_chunk_math(q, k, v, 0.3, window, 0.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_extend_attention_ref_with_one_token_chunks_is_decode_attention():
    chunks = [(1, cached) for cached in (0, 6, 40, 99)]
    args = extend_batch(chunks, 4, 2, 64, torch.float32)
    q, k_cache, v_cache, req_to_token, req_rows, _, kv_lens, _ = args
    expected = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv_lens, int(kv_lens.max()), 0.2)
    torch.testing.assert_close(extend_attention_ref(*args, 0.2), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- penalties
def penalty_inputs(batch=3, vocab=1000):
    counts_per_req = [3, 0, 40][:batch]
    ids = [torch.randperm(vocab)[:n] for n in counts_per_req]  # unique ids per request
    token_ids = torch.cat(ids).to(torch.int32).to(DEVICE)
    token_counts = torch.randint(1, 6, (token_ids.numel(),), dtype=torch.int32, device=DEVICE)
    cu_offsets = torch.tensor([0] + counts_per_req, device=DEVICE).cumsum(0).to(torch.int32)
    penalties = (torch.rand(batch, device=DEVICE), torch.rand(batch, device=DEVICE),
                 torch.rand(batch, device=DEVICE) + 0.5)
    return randn(batch, vocab), penalties, (token_ids, token_counts, cu_offsets)


def test_apply_penalties_triton_matches_ref():
    logits, penalties, tokens = penalty_inputs()
    logits_triton = logits.clone()
    apply_penalties_ref(logits, *penalties, *tokens)
    apply_penalties_triton(logits_triton, *penalties, *tokens)
    torch.testing.assert_close(logits_triton, logits, atol=1e-6, rtol=1e-6)


def test_apply_penalties_ref_matches_python_loop():
    logits, (presence, frequency, repetition), (token_ids, token_counts, cu_offsets) = penalty_inputs()
    expected = logits.clone()
    for b in range(logits.shape[0]):
        for i in range(cu_offsets[b], cu_offsets[b + 1]):
            token, count = int(token_ids[i]), int(token_counts[i])
            value = float(expected[b, token])
            value = value / float(repetition[b]) if value > 0 else value * float(repetition[b])
            expected[b, token] = value - float(frequency[b]) * count - float(presence[b])
    apply_penalties_ref(logits, presence, frequency, repetition, token_ids, token_counts, cu_offsets)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- greedy_sample
@pytest.mark.parametrize("vocab", [100, 5000])  # within one block, and over three (the last partly masked)
def test_greedy_sample_triton_matches_ref(vocab):
    logits = randn(6, vocab) * 4
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first one wins
    logits[2, : vocab // 2] = float("-inf")  # masked columns, as a grammar or a ban leaves them
    logits[3, 7] = logits[3, vocab // 2 + 7] = logits[3].max() + 2  # tied in the same lane of two blocks
    logits[4] = 0.0  # all equal: column 0, log(1 / vocab)
    tokens, logprobs = greedy_sample_triton(logits)
    expected_tokens, expected_logprobs = greedy_sample_ref(logits)
    assert torch.equal(tokens, expected_tokens)
    assert tokens[1] == vocab // 3 and tokens[3] == 7 and tokens[4] == 0
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
    assert abs(logprobs[4].item() + torch.log(torch.tensor(float(vocab))).item()) < 1e-5


# ---------------------------------------------------------------- random_uniform
def random_seeds(batch):
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), dtype=torch.int64, device=DEVICE)
    steps = torch.randint(0, 2**40, (batch,), dtype=torch.int64, device=DEVICE)
    return seeds, steps


def test_random_uniform_triton_is_bit_identical_to_ref():
    seeds, steps = random_seeds(5)
    seeds[0], steps[0] = 0, 0
    assert torch.equal(random_uniform_triton(seeds, steps, 3000), random_uniform_ref(seeds, steps, 3000))


def test_random_uniform_is_open_unit_interval_and_roughly_uniform():
    u = random_uniform_ref(*random_seeds(64), 4096)
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 60, chi2  # 15 degrees of freedom: P(chi2 > 60) < 1e-6 for a uniform source


def test_random_uniform_depends_only_on_seed_and_step():
    seeds, steps = random_seeds(4)
    together = random_uniform_ref(seeds, steps, 500)
    alone = random_uniform_ref(seeds[2:3], steps[2:3], 500)
    assert torch.equal(together[2:3], alone)
    next_step = random_uniform_ref(seeds[2:3], steps[2:3] + 1, 500)
    assert (next_step != alone).float().mean() > 0.99


def fmix32_python(h: int) -> int:
    """murmur3's finaliser with Python's unbounded ints, the textbook way."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_random_uniform_hash_matches_textbook_fmix32():
    from lightllm.kernels.random_uniform import _fmix32_ref

    values = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    values[:3] = torch.tensor([0, 1, 2**32 - 1])
    assert _fmix32_ref(values).tolist() == [fmix32_python(v) for v in values.tolist()]


def test_random_uniform_stream_is_stable():
    """Pinned values: changing the hash would silently change every seeded completion."""
    u = random_uniform_ref(torch.tensor([0, 1234, -7]), torch.tensor([0, 5, 2**33]), 3)
    assert (u * 2**24).long().tolist() == [[9620015, 3987171, 1774717], [4316197, 10932725, 14830879],
                                           [12743387, 10385101, 14386489]]


# ---- the fast launch path (kernels/_triton.py) ----

class _FakeTensor:
    is_cuda = True

    def __init__(self, address):
        self.address, self.dtype = address, torch.bfloat16

    def data_ptr(self):
        return self.address

    def get_device(self):
        return 3


class _FakeJit:
    """Stands in for a @triton.jit kernel: records Triton-path launches and direct launches."""

    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]

    def __init__(self):
        self.triton_calls, self.direct_calls = [], []
        self.__name__ = "fake_kernel"

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            fake = self

            class Compiled:
                def __getitem__(self, launch_grid):
                    return lambda *values: fake.direct_calls.append((launch_grid, values))
            return Compiled()
        return run


def test_fast_launch_compiles_once_per_specialisation_and_passes_every_parameter():
    from lightllm.kernels._triton import NEW_SPECIALISATIONS, _FastKernel

    jit = _FakeJit()
    kernel = _FastKernel(jit)
    before = NEW_SPECIALISATIONS["launches"]
    aligned, misaligned = _FakeTensor(4096), _FakeTensor(4098)
    kernel[(4,)](aligned, 32, BLOCK=64, FLAG=True, num_warps=4)  # compiles through Triton
    kernel[(4,)](aligned, 48, BLOCK=64, FLAG=True, num_warps=4)  # same specialisation: direct
    kernel[(2, 3)](aligned, 17, BLOCK=64, FLAG=True, num_warps=4)  # 17 is not a multiple of 16: Triton
    kernel[(4,)](misaligned, 32, BLOCK=64, FLAG=True, num_warps=4)  # another alignment: Triton
    kernel[(4,)](aligned, 32, BLOCK=128, FLAG=True, num_warps=4)  # another constexpr: Triton
    kernel[(4,)](aligned, 1, BLOCK=64, FLAG=True, num_warps=4)  # 1 is specialised apart: Triton
    kernel[(2, 3)](aligned, 33, BLOCK=64, FLAG=True, num_warps=4)  # as the third: direct
    assert [args[1] for _, args, _ in jit.triton_calls] == [32, 17, 32, 32, 1]
    assert NEW_SPECIALISATIONS["launches"] - before == 5  # the step trace's new_kernels counts these
    assert jit.direct_calls == [((4, 1, 1), (aligned, 48, 64, True)), ((2, 3, 1), (aligned, 33, 64, True))]
    assert NEW_SPECIALISATIONS["kernels"][-5:] == ["fake_kernel"] * 5  # and names them


def test_fast_launch_calls_the_launcher_as_triton_does(monkeypatch):
    """A compiled kernel with Triton's launcher attributes is launched through them, on the
    stream current for the first argument's device, with no launch metadata or hooks."""
    from lightllm.kernels import _triton

    launches = []

    class Compiled:
        function, packed_metadata = "fn-handle", "packed"

        def run(self, *values):
            launches.append(values)

    class Jit(_FakeJit):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.triton_calls.append(args) or Compiled()

    monkeypatch.setattr(_triton, "_current_stream", lambda device: f"stream-of-{device}")
    kernel = _triton._FastKernel(Jit())
    tensor = _FakeTensor(4096)
    kernel[(4,)](tensor, 32, BLOCK=64, FLAG=True, num_warps=4)
    kernel[(2, 5)](tensor, 48, BLOCK=64, FLAG=True, num_warps=4)
    assert launches == [(2, 5, 1, "stream-of-3", "fn-handle", "packed", None, None, None, tensor, 48, 64, True)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast launch path is taken for CUDA tensors only")
def test_fast_launch_on_the_gpu_matches_the_reference():
    from lightllm.kernels.rms_norm import _rms_norm_kernel

    weight = randn(4096, dtype=torch.bfloat16)
    for rows in (8, 8, 24):  # the second call reuses the first's kernel
        x = randn(rows, 4096, dtype=torch.bfloat16)
        assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dict(atol=2e-2, rtol=2e-2))
    flat = randn(8 * 4096 + 1, dtype=torch.bfloat16)
    x = flat[1:].view(8, 4096)  # 2 bytes past an aligned start: compiled apart
    assert x.data_ptr() % 16 != 0
    assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dict(atol=2e-2, rtol=2e-2))
    assert len(_rms_norm_kernel._compiled) >= 2


# ---------------------------------------------------------------- fp8 linear
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 200])
def test_quantize_fp8_rows_triton_matches_ref(dtype, width):
    x = randn(4, width, dtype=dtype) * 5
    x[1] = 0  # a row of zeros: scale MIN_SCALE, all zeros, no NaN
    x[2, :width // 2] *= 1e-4  # values in e4m3's subnormal range after scaling
    q, scale = quantize_fp8_rows_triton(x)
    q_ref, scale_ref = quantize_fp8_rows_ref(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())  # -0 and +0 compare equal


def test_quantize_fp8_ref_rounds_to_the_nearest_e4m3_value():
    x = torch.randn(6, 128) * torch.logspace(-3, 3, 6)[:, None]
    q, scale = quantize_fp8_rows_ref(x)
    assert torch.equal(q.float().abs().amax(1), torch.full((6,), FP8_MAX))  # each row's max maps to 448
    scaled = x / scale
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value; below 2^-6 the step is 2^-9
    bound = torch.maximum(scaled.abs() * 2**-4, torch.full_like(scaled, 2**-10))
    assert ((q.float() - scaled).abs() <= bound * (1 + 1e-6)).all()
    w_q, w_scale = quantize_fp8_weight(x)
    assert torch.equal(w_q.float(), q.float()) and torch.equal(w_scale, scale.t())  # weights: the same per row


def fp8_inputs(m, n, k):
    x = randn(m, k, dtype=torch.bfloat16)
    w_q, w_scale = quantize_fp8_weight(randn(n, k) * 0.05)
    return x, w_q.to(DEVICE), w_scale.to(DEVICE)


@pytest.mark.parametrize("m,plan", [(1, None), (5, (16, 32, 64, 1)), (16, (16, 64, 64, 3)), (33, None),
                                    (33, (64, 32, 128, 2)), (1, (16, 16, 64, 5))])
def test_fp8_gemm_small_m_matches_ref(m, plan):
    """K whole and split: a split column block's last slice to count itself done adds the slices up
    and sets its counter back to zero (shared by the launches of a step)."""
    x, w_q, w_scale = fp8_inputs(m, 96, 320)  # K = 5 blocks of 64: the last split is shorter
    q, scale = quantize_fp8_rows_triton(x)
    got = fp8_gemm_small_m(q, scale, w_q, w_scale, torch.bfloat16, plan=plan)
    assert_close(got, fp8_linear_ref(x, w_q, w_scale), TOL[torch.bfloat16])
    assert not zeroed_counters("fp8 small-M GEMM", NUM_COUNTERS, q.device).any()


@pytest.mark.parametrize("m", [3, SMALL_M_MAX + 3])  # the Triton kernel, then cuBLAS's scaled GEMM
def test_fp8_linear_triton_matches_ref(m):
    x, w_q, w_scale = fp8_inputs(m, 48, 128)
    assert_close(fp8_linear_triton(x, w_q, w_scale), fp8_linear_ref(x, w_q, w_scale), TOL[torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's fp8 GEMM and its fast accumulation are CUDA's")
def test_fp8_gemm_fast_accumulation_stays_close_to_fp32_sums():
    """FAST_ACCUM's cuBLAS GEMM at the 8B down projection's depth (K = 14336, where partial sums
    kept in the tensor cores' precision drift the most) against the same fp8 operands summed in
    fp32: within 1%, a quarter of what the fp8 rounding of the operands costs (3.75%)."""
    x, w_q, w_scale = fp8_inputs(SMALL_M_MAX + 64, 512, 14336)
    q, scale = quantize_fp8_rows_triton(x)
    exact = fp8_gemm_ref(q, scale, w_q, w_scale, torch.float32)
    got = fp8_gemm_triton(q, scale, w_q, w_scale, torch.bfloat16).float()
    assert (got - exact).norm() / exact.norm() < 0.01


def test_fp8_linear_ref_is_close_to_the_unquantised_product():
    x, w = torch.randn(8, 256), torch.randn(64, 256) * 0.05
    w_q, w_scale = quantize_fp8_weight(w)
    exact = x @ w.t()
    err = (fp8_linear_ref(x, w_q, w_scale) - exact).norm() / exact.norm()
    assert 1e-3 < err < 0.06  # e4m3 rounding of both operands: a few percent, never none


def assert_within_one_fp8_step(q, scale, q_ref, scale_ref, min_equal: float = 0.9):
    """Dequantised values at most one e4m3 step apart, and most of them equal. A step is 2^-3
    relative for normal values, and a fixed 2^-9 (times the row's scale) among the subnormals
    (|q| < 2^-6), where one step can be most of a small value. The two rows' scales may differ
    too (each test bounds by how much), which moves a value by q_ref times the difference: q * s -
    q_ref * s_ref = (q - q_ref) s + q_ref (s - s_ref). Among normal values the 2^-3 bound's margin
    takes it; a subnormal's fixed step does not (seed 1637338502: gelu's -3.5 one subnormal step
    and a bf16 ulp of scale apart). More than `min_equal` of the values must be equal."""
    actual, expected = q.float() * scale, q_ref.float() * scale_ref
    step = (torch.maximum(0.13 * expected.abs(), 1.01 * 2**-9 * torch.maximum(scale, scale_ref))
            + q_ref.float().abs() * (scale - scale_ref).abs())
    assert ((actual - expected).abs() <= step).all(), (actual - expected).abs().max()
    assert (q.float() == q_ref.float()).float().mean() > min_equal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_out_triton_matches_ref(dtype, with_residual):
    x, weight = randn(5, 96, dtype=dtype), randn(96, dtype=dtype)
    residual = randn(5, 96, dtype=dtype) if with_residual else None
    if with_residual:
        residual_ref = residual.clone()
        q, scale = add_rms_norm_triton(x, residual, weight, 1e-5, fp8_out=True)
        q_ref, scale_ref = add_rms_norm_ref(x, residual_ref, weight, 1e-5, fp8_out=True)
        torch.testing.assert_close(residual, residual_ref)
    else:
        q, scale = rms_norm_triton(x, weight, 1e-5, fp8_out=True)
        q_ref, scale_ref = rms_norm_ref(x, weight, 1e-5, fp8_out=True)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    # The norm's own rounding (the interpreter's bf16 cast, summation order) may move a value
    # across an fp8 rounding boundary: a step of 2^-3 relative at most, and rarely.
    # scale: a row's largest |y| / 448; bf16 y is rounded twice (normed, then times the weight),
    # with a residual three times (the sum first), toward zero in the interpreter: a bf16 step of
    # 2^-7 at most each (seed 3631056701 put one row 2.09 steps off with the residual).
    roundings = 3 if with_residual else 2
    torch.testing.assert_close(scale, scale_ref, rtol=2e-5 if dtype is torch.float32 else roundings * 2**-7, atol=0)
    # Those roundings leave values unequal: in bf16 over 300 seeds a median of 5.6% (residual) and
    # 5.0%, 10.0% at worst (seed 117881091, residual): more than 80% equal, with margin.
    assert_within_one_fp8_step(q, scale, q_ref, scale_ref, min_equal=0.9 if dtype is torch.float32 else 0.8)
    if not with_residual:  # the reference is the norm, then quantize_fp8_rows
        assert torch.equal(quantize_fp8_rows_ref(rms_norm_ref(x, weight, 1e-5))[0].float(), q_ref.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_fp8_out_triton_matches_ref(dtype):
    x = randn(5, 2 * 80, dtype=dtype) * 3
    q, scale = silu_and_mul_triton(x, fp8_out=True)
    q_ref, scale_ref = silu_and_mul_ref(x, fp8_out=True)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    # exp differs in the last bits (and the interpreter casts to bf16 toward zero): as the norm's test
    torch.testing.assert_close(scale, scale_ref, rtol=2e-5 if dtype is torch.float32 else 2 * 2**-7, atol=0)
    assert_within_one_fp8_step(q, scale, q_ref, scale_ref)
    assert torch.equal(quantize_fp8_rows_ref(silu_and_mul_ref(x))[0].float(), q_ref.float())


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    import triton

    from lightllm.kernels._triton import cdiv, next_power_of_2

    for n in range(0, 70000, 7):
        for d in (1, 16, 64, 132, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d)
        if n:
            assert next_power_of_2(n) == triton.next_power_of_2(n)


def test_direct_launch_only_on_the_tested_triton_releases():
    from lightllm.kernels._triton import _tested_triton

    assert _tested_triton("3.6.0") and _tested_triton("3.9.1+git0a1b2c")
    assert not _tested_triton("3.5.1") and not _tested_triton("3.10.0") and not _tested_triton("4.0.0")


# ---------------------------------------------------------------- sliding window and soft cap
# Windows below the query block (16 < BLOCK_M 64: a block's later rows see none of its first key
# block), between the lengths (40; 150, which the decode kernel splits in two), and past every
# length (500: the same as none); soft caps as Gemma 2's (50 on attention).
WINDOWED = [(16, 0.0), (40, 50.0), (150, 30.0), (500, 0.0), (0, 50.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", WINDOWED)
@pytest.mark.parametrize("waves", [0, 64], ids=["one-split", "split-k"])
def test_windowed_decode_attention_triton_matches_ref(dtype, window, softcap, waves, monkeypatch):
    monkeypatch.setattr(decode_module, "WAVES", waves)
    seq_lens = PROMPT_LENS + [300, 200, 16, 17]
    args = decode_batch(seq_lens, 4, 2, 64, dtype) + (max(seq_lens), 0.125)
    expected = decode_attention_ref(*args, window=window, softcap=softcap)
    assert_close(decode_attention_triton(*args, window=window, softcap=softcap), expected, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", WINDOWED)
def test_windowed_extend_attention_triton_matches_ref(dtype, window, softcap):
    args = extend_batch(CHUNKS, 4, 2, 64, dtype) + (0.125,)
    expected = extend_attention_ref(*args, window=window, softcap=softcap)
    out = extend_attention_triton(*args, window=window, softcap=softcap)
    assert not out.isnan().any()
    assert_close(out, expected, ATTN_TOL[dtype])


@pytest.mark.parametrize("window,softcap", WINDOWED)
def test_windowed_extend_attention_ref_matches_masked_sdpa(window, softcap):
    """Over each request's whole sequence, with the mask built apart: query i sees key j where
    i - window < j <= i; scores capped as softcap * tanh(s / softcap) before the mask."""
    _, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, q_blocks = extend_batch(CHUNKS, 4, 2, 64,
                                                                                         torch.float32)
    full_q = [randn(new + cached, 4, 64) for new, cached in CHUNKS]
    q = torch.cat([seq_q[cached:] for seq_q, (_, cached) in zip(full_q, CHUNKS)])
    out = extend_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, cu_q, kv_lens, q_blocks, 0.3,
                               window=window, softcap=softcap)
    for i, (row, (new, cached)) in enumerate(zip(req_rows.tolist(), CHUNKS)):
        n = new + cached
        slots = req_to_token[row, :n].long()
        keys, values = (cache[slots].transpose(0, 1).repeat_interleave(2, 0) for cache in (k_cache, v_cache))
        scores = full_q[i].transpose(0, 1) @ keys.transpose(1, 2) * 0.3
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(n, device=DEVICE)
        seen = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
        expected = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values
        start = cu_q[i].item()
        # fp32 sums in two orders: 1.2e-5 apart at worst seen, where 1e-5 was asked (ATTN_TOL's bound)
        torch.testing.assert_close(out[start:start + new], expected.transpose(0, 1)[cached:], **ATTN_TOL[torch.float32])


@pytest.mark.parametrize("window,softcap", WINDOWED)
def test_windowed_decode_attention_ref_is_extend_attention_of_one_token(window, softcap):
    chunks = [(1, cached) for cached in (0, 6, 15, 16, 40, 99)]
    args = extend_batch(chunks, 4, 2, 64, torch.float32)
    q, k_cache, v_cache, req_to_token, req_rows, _, kv_lens, _ = args
    expected = extend_attention_ref(*args, 0.2, window=window, softcap=softcap)
    out = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv_lens, int(kv_lens.max()), 0.2,
                               window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("rows,programs", [(5, 8), (7, 4), (13, 4)])
def test_one_shot_add_rms_norm_as_one_rank_of_two_matches_ref(dtype, rank, rows, programs):
    """The fused all-reduce + residual add + RMSNorm as rank `rank` of two, two calls, its
    peer's rows already pushed into this rank's buffer (each call's into the region of its
    epoch's parity and the peer, program p's rows in slot p) and the peer's signals already
    set: the residual as the reference's (bitwise where the rounding is torch's: two ranks' sum is
    rounded once either way; under the interpreter, which rounds bf16 toward zero, within its two
    roundings), the norm as the reference's of that residual; each program's epoch
    counted and sent to the peer, this rank's rows pushed into the peer's slots of (parity,
    this rank). One row a program (5 rows, 8 programs), and several (7 and 13 rows over 4
    programs: 2 and 4 rows a program, the last program with fewer)."""
    from lightllm.kernels.allreduce_norm import (flag_count, one_shot_add_rms_norm_ref, one_shot_add_rms_norm_triton,
                                                 slots)

    hidden, world = 96, 2
    peer = 1 - rank
    region = 4 * programs * hidden  # elements of each of a buffer's 2 x world regions: 4 rows a slot
    per_program, launched, slot = slots(rows, hidden, programs, region)
    assert per_program == -(-rows // programs) and slot == 4 * hidden
    assert (launched - 1) * per_program < rows <= launched * per_program  # no program empty
    data = [torch.zeros(2 * world * region, dtype=dtype, device=DEVICE) for _ in range(world)]
    flags = [torch.zeros(flag_count(programs, world), dtype=torch.int64, device=DEVICE) for _ in range(world)]
    counters = torch.zeros(programs, dtype=torch.int64, device=DEVICE)
    flags[rank].view(programs, world)[:, peer] = 2  # the peer has signalled both epochs
    pointers = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)  # noqa: E731
    exact = dtype is torch.float32 or DEVICE == "cuda"  # bitwise on a GPU; the interpreter rounds to bf16 toward zero

    def row_at(epoch: int, sender: int, r: int) -> int:
        """Where row r of `sender` lies in a buffer: its program's slot of (epoch's parity, sender)."""
        return ((epoch % 2) * world + sender) * region + (r // per_program) * slot + (r % per_program) * hidden

    for epoch in (1, 2):
        parts = [randn(rows, hidden, dtype=dtype) for _ in range(world)]
        residual, weight = randn(rows, hidden, dtype=dtype), randn(hidden, dtype=dtype)
        for r in range(rows):
            data[rank][row_at(epoch, peer, r):][:hidden] = parts[peer][r]
        _, expected_residual = one_shot_add_rms_norm_ref(parts, residual.clone(), weight, 1e-6)
        total = parts[0].float().abs() + parts[1].float().abs()
        got, got_residual = one_shot_add_rms_norm_triton(parts[rank], residual, weight, 1e-6, data_ptrs=pointers(data),
                                                         flags_ptrs=pointers(flags), counters=counters, rank=rank,
                                                         region_bytes=region * data[0].element_size())
        assert got_residual is residual
        if exact:
            assert torch.equal(residual, expected_residual)
        else:  # two roundings (the sum's, the add's) each at most a bf16 ulp (2^-7 relative) apart
            bound = 2 ** -6 * (total + expected_residual.float().abs())
            assert ((residual.float() - expected_residual.float()).abs() <= bound).all()
        # the norm of the residual the kernel stored, as the unfused norm's
        torch.testing.assert_close(got, rms_norm_ref(residual, weight, 1e-6), **TOL[dtype])
        pushed = torch.stack([data[peer][row_at(epoch, rank, r):][:hidden] for r in range(rows)])
        assert torch.equal(pushed, parts[rank])  # this rank's rows, in the peer's slots for them
        used = torch.arange(programs, device=DEVICE) < launched
        assert torch.equal(counters, torch.where(used, epoch, 0))
        sent = torch.zeros(programs, world, dtype=torch.int64, device=DEVICE)
        sent[:launched, rank] = epoch
        assert torch.equal(flags[peer].view(programs, world), sent)




_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NAME_CHECK = """
import importlib.machinery, importlib.metadata, sys
case, root = sys.argv[1:3]
sys.path[:0] = sys.argv[2:]  # the checkout's root first, as `python -m` from it puts it; then any stand-in
if case == "none":  # no other package of that name on the path: hide any from the lookup past the root
    find = importlib.machinery.PathFinder.find_spec
    importlib.machinery.PathFinder.find_spec = classmethod(
        lambda cls, name, path=None, target=None: None if name == "kernels" and path is not None
        else find(name, path, target))
import lightllm.kernels as ours
assert ours.rms_norm_ref.__module__ == "lightllm.kernels.rms_norm", ours.rms_norm_ref.__module__
import kernels
print(kernels.__file__)
if case == "installed":  # transformers >= 5.25 imports PyPI's `kernels` here, where it is installed
    from transformers.activations import ACT2FN
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        print("not installed")
"""


@pytest.mark.parametrize("case", ["stand-in", "none", "installed"])
def test_the_checkout_root_on_sys_path_leaves_the_name_kernels_to_the_pypi_package(tmp_path, case):
    """`python -m` from the checkout puts its root on sys.path, where kernels/ looks like a top-level package
    `kernels`: an import of that name (transformers imports PyPI's `kernels`) gets the package of that name found
    further on the path (a stand-in; or PyPI's, where installed, and transformers' models import), and only where
    there is none this folder (as it always did), which stays `lightllm.kernels` throughout."""
    import subprocess
    import sys

    stand_in = tmp_path / "kernels" / "__init__.py"
    stand_in.parent.mkdir()
    stand_in.write_text("")
    paths = [_ROOT, *([str(tmp_path)] if case == "stand-in" else [])]
    run = subprocess.run([sys.executable, "-c", _NAME_CHECK, case, *paths], cwd=_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    found, *rest = run.stdout.splitlines()
    ours = os.path.join(_ROOT, "kernels", "__init__.py")
    if case == "stand-in":
        assert found == str(stand_in)
    elif case == "none":
        assert found == ours
    else:
        assert found != ours or rest == ["not installed"], (found, rest)
