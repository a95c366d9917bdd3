"""Rotary position embedding, in place, HF Llama "rotate_half" layout (i pairs with i + D/2)."""
import torch

from ._triton import fast_launch, next_power_of_2, tl, triton


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def rotary_emb_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _rotate_ref(q, cos, sin)
    _rotate_ref(k, cos, sin)


@triton.jit
def _rotate_heads(ptr, token, token_stride, head_stride, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first = ptr + token * token_stride + heads * head_stride + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_token_stride, q_head_stride, k_token_stride, k_head_stride,
                   cos_stride, sin_stride, num_q_heads, num_kv_heads,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * cos_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, q_token_stride, q_head_stride, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, token, k_token_stride, k_head_stride, num_kv_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_emb_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    assert q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    _rotary_kernel[(tokens,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              cos.stride(0), sin.stride(0), num_q_heads, num_kv_heads,
                              HALF=half, BLOCK_HQ=next_power_of_2(num_q_heads),
                              BLOCK_HK=next_power_of_2(num_kv_heads),
                              BLOCK_HALF=next_power_of_2(half), num_warps=4)
