"""Causal attention over a packed batch of variable-length prompts (no padding), GQA."""
import torch

from ._triton import LOG2E, dot, tl, triton


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          max_seqlen: int, sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D]; sequence i holds tokens cu_seqlens[i]:cu_seqlens[i+1]."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()  # CPU path: a host copy is fine here
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].float().transpose(0, 1)  # [Hq, L, D]
        ks = k[start:end].float().transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (qs @ ks.transpose(1, 2)) * sm_scale
        length = end - start
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_seqlens_ptr, scale_log2, q_token_stride, q_head_stride,
                    k_token_stride, k_head_stride, v_token_stride, v_head_stride, o_token_stride, o_head_stride,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One program: BLOCK_M queries of one sequence and one query head; online softmax over keys."""
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - start
    if m_block * BLOCK_M >= length:
        return
    kv_head = head // GROUP
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + (start + rows)[:, None] * q_token_stride + head * q_head_stride + dims[None, :],
                mask=(rows < length)[:, None] & dim_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: keys past this block's last query never contribute. Every row sees key 0, so
    # the running max is finite after the first block and no row divides by zero.
    kv_end = tl.minimum((m_block + 1) * BLOCK_M, length)
    for first in range(0, kv_end, BLOCK_N):
        cols = first + tl.arange(0, BLOCK_N)
        col_mask = cols < length
        k = tl.load(k_ptr + (start + cols)[None, :] * k_token_stride + kv_head * k_head_stride + dims[:, None],
                    mask=col_mask[None, :] & dim_mask[:, None], other=0.0)
        scores = dot(q, k, DOT_UPCAST) * scale_log2
        scores = tl.where((rows[:, None] >= cols[None, :]) & col_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (start + cols)[:, None] * v_token_stride + kv_head * v_head_stride + dims[None, :],
                    mask=col_mask[:, None] & dim_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + (start + rows)[:, None] * o_token_stride + head * o_head_stride + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(rows < length)[:, None] & dim_mask[None, :])


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                             max_seqlen: int, sm_scale: float) -> torch.Tensor:
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    _, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, warps = (128, 64, 8) if block_d >= 128 else (64, 64, 4)
    grid = (triton.cdiv(max_seqlen, block_m), cu_seqlens.shape[0] - 1, num_q_heads)
    _prefill_kernel[grid](q, k, v, out, cu_seqlens, sm_scale * LOG2E, q.stride(0), q.stride(1), k.stride(0),
                          k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                          GROUP=num_q_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d,
                          BLOCK_M=block_m, BLOCK_N=block_n, DOT_UPCAST=not q.is_cuda,
                          num_warps=warps, num_stages=2)
    return out
