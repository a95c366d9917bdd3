"""Rotary position embedding fused with the KV write, one launch where there were two: q is
rotated in place, k is rotated on its way into its cache slot and v copied into its own. Attention
reads keys only from the cache, so k itself is left as it came. Layout: HF Llama's "rotate_half"
(dimension i pairs with i + D/2)."""
import torch

from ._triton import fast_launch, next_power_of_2, tl, triton


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the angles of its token, in fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """q [T, Hq, D] rotated in place; rotated k [T, Hk, D] and v to k_cache/v_cache [S, Hk, D] at
    slots [T]; cos/sin [T, D/2] are each token's angles."""
    q.copy_(_rotated(q, cos, sin))
    slots = slots.long()
    k_cache[slots] = _rotated(k, cos, sin).to(k_cache.dtype)
    v_cache[slots] = v


@triton.jit
def _rotate_heads(src, dst, num_heads, src_head_stride, dst_head_stride, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's heads from src rotated into dst (the same place for q)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first = src + heads * src_head_stride + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out = dst + heads * dst_head_stride + dims
    tl.store(out, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(src, dst, num_heads, src_head_stride, dst_head_stride,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_DIM)
    rows = tl.load(src + heads * src_head_stride + dims, mask=mask)
    tl.store(dst + heads * dst_head_stride + dims, rows, mask=mask)


@fast_launch
@triton.jit
def _rotary_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                      q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
                      cos_stride, sin_stride, k_cache_stride, k_cache_head_stride, v_cache_stride,
                      v_cache_head_stride, num_q_heads, num_kv_heads,
                      HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * cos_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    q = q_ptr + token * q_token_stride
    _rotate_heads(q, q, num_q_heads, q_head_stride, q_head_stride, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * k_token_stride, k_cache_ptr + slot * k_cache_stride, num_kv_heads, k_head_stride,
                  k_cache_head_stride, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)
    _copy_heads(v_ptr + token * v_token_stride, v_cache_ptr + slot * v_cache_stride, num_kv_heads, v_head_stride,
                v_cache_head_stride, 2 * HALF, BLOCK_HK, BLOCK_D)


def rotary_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and v.dtype == v_cache.dtype
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    _rotary_kv_kernel[(tokens,)](q, k, v, cos, sin, k_cache, v_cache, slots, q.stride(0), q.stride(1), k.stride(0),
                                 k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
                                 k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                                 num_q_heads, num_kv_heads, HALF=half, BLOCK_HQ=next_power_of_2(num_q_heads),
                                 BLOCK_HK=next_power_of_2(num_kv_heads), BLOCK_HALF=next_power_of_2(half),
                                 BLOCK_D=next_power_of_2(head_dim), num_warps=4)
