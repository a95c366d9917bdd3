"""Scatter the new tokens' K and V into their cache slots."""
import torch

from ._triton import fast_launch, next_power_of_2, tl, triton


def copy_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor) -> None:
    slots = slots.long()
    k_cache[slots] = k
    v_cache[slots] = v


@triton.jit
def _copy_rows(src_ptr, dst_ptr, token, slot, src_token_stride, src_head_stride, dst_slot_stride,
               dst_head_stride, num_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_DIM)
    rows = tl.load(src_ptr + token * src_token_stride + heads * src_head_stride + dims, mask=mask)
    tl.store(dst_ptr + slot * dst_slot_stride + heads * dst_head_stride + dims, rows, mask=mask)


@fast_launch
@triton.jit
def _copy_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_token_stride, k_head_stride,
                    v_token_stride, v_head_stride, k_cache_stride, k_cache_head_stride, v_cache_stride,
                    v_cache_head_stride, num_heads,
                    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    _copy_rows(k_ptr, k_cache_ptr, token, slot, k_token_stride, k_head_stride, k_cache_stride,
               k_cache_head_stride, num_heads, HEAD_DIM, BLOCK_H, BLOCK_D)
    _copy_rows(v_ptr, v_cache_ptr, token, slot, v_token_stride, v_head_stride, v_cache_stride,
               v_cache_head_stride, num_heads, HEAD_DIM, BLOCK_H, BLOCK_D)


def copy_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
    tokens, num_heads, head_dim = k.shape
    _copy_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), num_heads,
                               HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_heads),
                               BLOCK_D=next_power_of_2(head_dim), num_warps=4)
