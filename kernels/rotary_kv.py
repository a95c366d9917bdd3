"""Rotary position embedding fused with the KV write, one launch where there were two: q is
rotated in place, k is rotated on its way into its cache slot and v copied into its own. Attention
reads keys only from the cache, so k itself is left as it came. Layout: HF Llama's "rotate_half"
(dimension i pairs with i + D/2)."""
import torch

from ._triton import fast_launch, grid_dependency_wait, launch_dependents, next_power_of_2, pdl, tl, triton
from .fp8_linear import FP8, FP8_MAX, round_to_e4m3


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the angles of its token, in fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  extra: torch.Tensor | None = None) -> None:
    """q [T, Hq, D] rotated in place; rotated k [T, Hk, D] and v to k_cache/v_cache [S, Hk, D] at
    slots [T]; cos/sin [T, D/2] are each token's angles. extra: fp32 [T, (Hq + 2 Hk) D], the q/k/v
    projection's LoRA share in its output's layout, added to q, k and v first, each sum rounded to
    their dtype (as an expand adding into the projection's output would have left it); q keeps it."""
    if extra is not None:
        tokens, d = q.shape[0], q.shape[-1]
        shares = extra.split([q.shape[1] * d, k.shape[1] * d, v.shape[1] * d], dim=-1)
        q.copy_(q.float() + shares[0].view(tokens, -1, d))
        k = (k.float() + shares[1].view(tokens, -1, d)).to(k.dtype)
        v = (v.float() + shares[2].view(tokens, -1, d)).to(v.dtype)
    q.copy_(_rotated(q, cos, sin))
    slots = slots.long()
    k_cache[slots] = to_cache(_rotated(k, cos, sin), k_cache.dtype)
    v_cache[slots] = to_cache(v, v_cache.dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: an fp8 cache (--kv_cache_dtype fp8_e4m3) holds each value rounded
    to the nearest e4m3 with no scale (values past +-448 saturate), as vLLM's fp8 cache does
    without calibrated scales: K and V of the Llama family stay well inside that range."""
    if dtype == FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(dtype)


@triton.jit
def _stored(x, dst, TO_FP8: tl.constexpr):
    """x (fp32) in dst's dtype; to fp8 as to_cache rounds (the interpreter's own cast does not)."""
    if TO_FP8:
        x = round_to_e4m3(tl.clamp(x, -448.0, 448.0))
    return x.to(dst.dtype.element_ty)


@triton.jit
def _rotate_heads(src, dst, extra, num_heads, src_head_stride, dst_head_stride, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, TO_FP8: tl.constexpr,
                  HAS_EXTRA: tl.constexpr):
    """One token's heads from src rotated into dst (the same place for q); HAS_EXTRA: fp32 [heads,
    2 HALF] at `extra` added first, the sum rounded to src's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first = src + heads * src_head_stride + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        added = extra + heads * (2 * HALF) + dims
        x1 = (x1 + tl.load(added, mask=mask, other=0.0)).to(src.dtype.element_ty).to(tl.float32)
        x2 = (x2 + tl.load(added + HALF, mask=mask, other=0.0)).to(src.dtype.element_ty).to(tl.float32)
    out = dst + heads * dst_head_stride + dims
    tl.store(out, _stored(x1 * cos - x2 * sin, dst, TO_FP8), mask=mask)
    tl.store(out + HALF, _stored(x2 * cos + x1 * sin, dst, TO_FP8), mask=mask)


@triton.jit
def _copy_heads(src, dst, extra, num_heads, src_head_stride, dst_head_stride,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TO_FP8: tl.constexpr,
                HAS_EXTRA: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_DIM)
    rows = tl.load(src + heads * src_head_stride + dims, mask=mask)
    if HAS_EXTRA:  # rounded to src's dtype, as _rotate_heads
        added = tl.load(extra + heads * HEAD_DIM + dims, mask=mask, other=0.0)
        rows = (rows.to(tl.float32) + added).to(src.dtype.element_ty)
    if TO_FP8:
        rows = _stored(rows.to(tl.float32), dst, TO_FP8)
    tl.store(dst + heads * dst_head_stride + dims, rows, mask=mask)


@fast_launch
@triton.jit
def _rotary_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, extra_ptr,
                      q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
                      cos_stride, sin_stride, k_cache_stride, k_cache_head_stride, v_cache_stride,
                      v_cache_head_stride, extra_stride, num_q_heads, num_kv_heads,
                      HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
                      HAS_EXTRA: tl.constexpr, PDL: tl.constexpr):
    # Decode attention comes next: its programs may take their places and read the step's lengths
    # while this kernel runs (a few us of a small step's attention).
    launch_dependents(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * cos_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    grid_dependency_wait(PDL)  # the slots and angles are the step's; q, k and v come from the GEMM before
    q = q_ptr + token * q_token_stride
    extra_q = extra_ptr + token * extra_stride  # q's share, then k's, then v's (HAS_EXTRA)
    extra_k = extra_q + num_q_heads * 2 * HALF
    extra_v = extra_k + num_kv_heads * 2 * HALF
    _rotate_heads(q, q, extra_q, num_q_heads, q_head_stride, q_head_stride, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF,
                  False, HAS_EXTRA)
    _rotate_heads(k_ptr + token * k_token_stride, k_cache_ptr + slot * k_cache_stride, extra_k, num_kv_heads,
                  k_head_stride, k_cache_head_stride, cos, sin, HALF, BLOCK_HK, BLOCK_HALF, KV_FP8, HAS_EXTRA)
    _copy_heads(v_ptr + token * v_token_stride, v_cache_ptr + slot * v_cache_stride, extra_v, num_kv_heads,
                v_head_stride, v_cache_head_stride, 2 * HALF, BLOCK_HK, BLOCK_D, KV_FP8, HAS_EXTRA)


def rotary_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     extra: torch.Tensor | None = None) -> None:
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    assert extra is None or (extra.dtype == torch.float32 and extra.stride(-1) == 1
                             and extra.shape[-1] == (q.shape[1] + 2 * k.shape[1]) * q.shape[2])
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and k_cache.dtype == v_cache.dtype
    assert v.dtype == v_cache.dtype or v_cache.dtype == FP8
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    _rotary_kv_kernel[(tokens,)](q, k, v, cos, sin, k_cache, v_cache, slots, q if extra is None else extra,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1),
                                 v_cache.stride(0), v_cache.stride(1), 0 if extra is None else extra.stride(0),
                                 num_q_heads, num_kv_heads, HALF=half, BLOCK_HQ=next_power_of_2(num_q_heads),
                                 BLOCK_HK=next_power_of_2(num_kv_heads), BLOCK_HALF=next_power_of_2(half),
                                 BLOCK_D=next_power_of_2(head_dim), KV_FP8=k_cache.dtype == FP8,
                                 HAS_EXTRA=extra is not None, num_warps=4, **pdl(q))
