"""Extend attention: the new tokens of each request (a prompt chunk, or one decode token) over
everything that request holds in the token table, causal, GQA.

Layout: the B chunks are packed without padding, request i owning q[cu_q[i]:cu_q[i+1]]. Their
own K/V were written into the cache before the call, so keys are read only from the cache,
through the request's row of req_to_token (slots need not be contiguous). A chunk of q_len
tokens ends the request's kv_len cached tokens: its query j sits at position
kv_len - q_len + j and sees positions 0..itself. A fresh prompt is the case kv_len == q_len,
a decode the case q_len == 1. Requires kv_len <= req_to_token.shape[1]. A sliding-window layer
(`window` > 0) lets each query see its last `window` positions only, itself included; `softcap`
> 0 caps the scores and `sinks` add a logit per head to each denominator (decode_attention.py
says how); an unwindowed, uncapped, sinkless layer pays nothing.

The Triton grid is one program per (query block, head), read from `q_blocks` [2, NB] int32 on the
device: row 0 the chunk of each block, row 1 its block index within the chunk (`extend_q_blocks`
builds it on the host). Entries whose chunk is -1 are padding and leave at once, so a CUDA graph
captured with NB slots replays any step whose blocks fit, and `cu_q` may start past 0 (the rows
before it belong to the step's decodes): the grid never depends on the step's lengths.
"""
import torch
import torch.nn.functional as F

from ._triton import (attend_kv_block, cdiv, fast_launch, fit_attention_launch, fp8_dot_dtype, next_power_of_2,
                      score_scale, shared_memory_limit, sink_weight, tl, triton)
from .decode_attention import softmax_with_sinks


def extend_block_m(head_dim: int) -> int:
    """Queries per block of the block table: wide heads take the larger block (H100, bench-8b's
    128-dim heads). A program may take a part of its block (extend_launch), never more: a model
    whose layers differ in head size (Gemma 4: 256 and 512) keeps one table for all of them."""
    return 128 if next_power_of_2(head_dim) >= 128 else 64


MAX_ACC_ELEMENTS = 128 * 256
# Key blocks wholly before a query block's first position run unmasked when there are at least this
# many such keys; fewer take the masked loop alone (a second pipelined loop's set-up costs more than
# the masks it saves there: tune_extend_attention.py)
SPLIT_FROM_KEYS = 256


def extend_launch(head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                  limit: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, stages, warps) of a launch: heads of up to 128 dimensions 64 queries by 64
    keys over three stages in 4 warps (H200, bench-8b, in the engine's prefill steps with the split
    below: 1.28x faster than 128 queries over two stages in 8 warps on one 8192-token prompt, 1.18x
    on 8 x 1024, 1.03x on 64 x 128; docs/benchmarks.md); wider heads 128 or 64 queries by 64 keys
    over two stages, at most MAX_ACC_ELEMENTS outputs a program. Each is shrunk where its tiles
    would take more shared memory than `limit` (shared_memory_limit; Gemma 4's 512-dim heads: 64
    queries by 32 keys). BLOCK_M divides extend_block_m's block."""
    block_m = extend_block_m(head_dim)
    block_d = next_power_of_2(head_dim)
    if block_d <= 128:
        return (*fit_attention_launch(64, 64, 3, block_d, q_dtype.itemsize, kv_dtype.itemsize, limit, 16), 4)
    # the fp32 output tile in registers: at most 128 a thread of 8 warps (128 x 256; 64 x 512, not 128 x 512)
    block_m = min(block_m, MAX_ACC_ELEMENTS // block_d)
    fitted = fit_attention_launch(block_m, 64, 2, block_d, q_dtype.itemsize, kv_dtype.itemsize, limit, 16)
    return (*fitted, 8 if extend_block_m(head_dim) == 128 else 4)  # 8 warps for wide heads, whatever part they take


def extend_q_blocks(q_lens: list[int], head_dim: int, slots: int | None = None) -> list[int]:
    """The flattened [2, NB] block table for chunks of q_lens: each chunk's index repeated once per
    query block, then the blocks' indices within their chunks; padded with chunk -1 to `slots`."""
    block_m = extend_block_m(head_dim)
    chunks, blocks = [], []
    for i, q_len in enumerate(q_lens):
        count = cdiv(q_len, block_m)
        chunks += [i] * count
        blocks += range(count)
    table = chunks + blocks
    return table if slots is None else pad_q_blocks(table, slots)


def pad_q_blocks(table: list[int], slots: int) -> list[int]:
    """A flattened block table padded with chunk -1 (blocks that leave at once) to `slots` blocks."""
    used = len(table) // 2
    if used > slots:
        raise ValueError(f"{used} query blocks do not fit {slots} slots")
    pad = slots - used
    return table[:used] + [-1] * pad + table[used:] + [0] * pad


def max_q_blocks(tokens: int, chunks: int, head_dim: int) -> int:
    """Most query blocks that `chunks` chunks of `tokens` tokens in all can need."""
    return cdiv(tokens, extend_block_m(head_dim)) + chunks


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         req_to_token: torch.Tensor, req_rows: torch.Tensor, cu_q: torch.Tensor,
                         kv_lens: torch.Tensor, q_blocks: torch.Tensor, sm_scale: float,
                         out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], k_cache/v_cache [S, Hk, D]; q_blocks is unused (only the kernel's grid needs it).
    Writes the rows cu_q[0]:cu_q[-1] of `out` (a new tensor like q when None) and returns it."""
    out = torch.empty_like(q) if out is None else out
    bounds = cu_q.tolist()  # CPU path: host copies are fine here
    for i, (row, kv_len) in enumerate(zip(req_rows.tolist(), kv_lens.tolist())):
        start, end = bounds[i], bounds[i + 1]
        if start == end:  # a padding chunk
            continue
        first = max(kv_len - (end - start) - window + 1, 0) if window else 0  # the chunk's first query's window
        slots = req_to_token[row, first:kv_len].long()
        out[start:end] = _attend_chunk(q[start:end], k_cache[slots], v_cache[slots], sm_scale, window,
                                       softcap, sinks).to(q.dtype)
    return out


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, window: int,
                  softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [q_len, Hq, D] are the last q_len of the n positions of k/v [n, Hk, D]; fp32 out.
    Through torch's SDPA (its CPU kernel works in blocks and never holds the [Hq, q_len, n] scores:
    a 2048-token prompt of the default model's heads in 72 ms against 538 ms written out, on 2
    cores); a soft cap or sinks, which SDPA has no place for, through `_attend_chunk_math`."""
    if softcap or sinks is not None:
        return _attend_chunk_math(q, k, v, sm_scale, window, softcap, sinks)
    q_len, n = q.shape[0], k.shape[0]
    qs, ks, vs = (t.float().transpose(0, 1)[None] for t in (q, k, v))  # [1, H, len, D]
    causal = q_len == n and not window  # aligned at the top as at the bottom: SDPA's own mask
    everything = q_len == 1 and not window  # one query, the last position: it sees every key
    mask = None if causal or everything else ~_hidden(q_len, n, window, q.device)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and q_len > 1,
                                         scale=sm_scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _hidden(q_len: int, n: int, window: int, device: torch.device) -> torch.Tensor:
    """[q_len, n]: which keys each query may not see (later ones; with a window, too early ones)."""
    positions = torch.arange(n - q_len, n, device=device)[:, None]
    keys = torch.arange(n, device=device)[None, :]
    return (keys > positions) | (keys <= positions - window) if window else keys > positions


def _attend_chunk_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, window: int,
                       softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As _attend_chunk, every score written out."""
    group = q.shape[1] // k.shape[1]
    qs = q.float().transpose(0, 1)  # [Hq, q_len, D]
    ks = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, n, D]
    vs = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = (qs @ ks.transpose(1, 2)) * sm_scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = softmax_with_sinks(scores.masked_fill(_hidden(q.shape[0], k.shape[0], window, q.device), float("-inf")),
                               sinks)
    return (probs @ vs).transpose(0, 1)


@fast_launch
@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sinks_ptr, req_to_token_ptr, req_rows_ptr, cu_q_ptr, kv_lens_ptr,
                   q_blocks_ptr,
                   num_blocks, qk_scale, q_token_stride, q_head_stride, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride,
                   o_token_stride, o_head_stride, req_to_token_stride, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TABLE_M: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr,
                   DOT_UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, AS_F16: tl.constexpr,
                   SINKS: tl.constexpr, SPLIT_FROM: tl.constexpr):
    """One program: BLOCK_M queries of one request's chunk and one query head: part `program % parts`
    of the table's block `program // parts` of TABLE_M queries (parts = TABLE_M // BLOCK_M)."""
    program, head = tl.program_id(0), tl.program_id(1)
    block = program // (TABLE_M // BLOCK_M)
    req = tl.load(q_blocks_ptr + block)
    if req < 0:  # a padding slot of the table
        return
    # the program's BLOCK_M rows numbered as blocks of BLOCK_M: the causal bounds below follow
    m_block = tl.load(q_blocks_ptr + num_blocks + block) * (TABLE_M // BLOCK_M) + program % (TABLE_M // BLOCK_M)
    q_start = tl.load(cu_q_ptr + req).to(tl.int64)
    q_len = tl.load(cu_q_ptr + req + 1).to(tl.int64) - q_start
    kv_len = tl.load(kv_lens_ptr + req).to(tl.int64)
    token_row = req_to_token_ptr + tl.load(req_rows_ptr + req).to(tl.int64) * req_to_token_stride
    kv_head = head // GROUP
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = kv_len - q_len + rows  # padding rows get positions >= kv_len; they are never stored
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * q_token_stride + head * q_head_stride + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if AS_F16:  # an fp8 cache: K/V are widened to q's dtype (attend_kv_block), here fp16
        q = q.to(tl.float16)
    # A finite floor, not -inf: under a window a row may see no key of a block (before its window
    # starts), and exp2(-inf - -inf) would make its sums NaN. Every real row sees itself, so no row
    # divides by zero at the end.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: keys past this block's last query position never contribute; under a window neither
    # do keys before its first query's window.
    kv_end = tl.minimum(kv_len - q_len + (m_block + 1) * BLOCK_M, kv_len)
    kv_start = 0
    if WINDOW > 0:
        kv_start = tl.maximum(kv_len - q_len + m_block * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    else:
        # Key blocks that end at or before the block's first query position are seen whole by every
        # row (and lie inside every chunk's kv_len): no causal mask, no bounds on their loads.
        seen = (kv_len - q_len + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        seen = tl.where(seen < SPLIT_FROM, 0, seen)
        for first in range(0, seen, BLOCK_N):
            cols = first + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = attend_kv_block(q, m_i, l_i, acc, k_ptr, v_ptr, token_row, cols, cols >= 0, True,
                                            kv_head, dims, dim_mask, k_slot_stride, k_head_stride, v_slot_stride,
                                            v_head_stride, qk_scale, DOT_UPCAST, SOFTCAP, False)
        kv_start = seen
    for first in range(kv_start, kv_end, BLOCK_N):
        cols = first + tl.arange(0, BLOCK_N)
        col_mask = cols < kv_end
        allowed = (positions[:, None] >= cols[None, :]) & col_mask[None, :]
        if WINDOW > 0:
            allowed = allowed & (cols[None, :] > positions[:, None] - WINDOW)
        m_i, l_i, acc = attend_kv_block(q, m_i, l_i, acc, k_ptr, v_ptr, token_row, cols, col_mask, allowed, kv_head,
                                        dims, dim_mask, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride,
                                        qk_scale, DOT_UPCAST, SOFTCAP, False)
    l_i += sink_weight(sinks_ptr, head, True, tl.where(row_mask, m_i, 0.0), SINKS)  # padding rows: never stored
    if WINDOW > 0:  # padding rows past the chunk may see no key at all; they are not stored
        l_i = tl.where(row_mask, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + rows)[:, None] * o_token_stride + head * o_head_stride + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def extend_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            req_to_token: torch.Tensor, req_rows: torch.Tensor, cu_q: torch.Tensor,
                            kv_lens: torch.Tensor, q_blocks: torch.Tensor, sm_scale: float,
                            out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None,
                            launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """`launch`: (BLOCK_M, BLOCK_N, stages, warps) instead of extend_launch's (BLOCK_M dividing
    extend_block_m's; test/benchmark/kernels/tune_extend_attention.py times the settings)."""
    _, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == req_to_token.stride(-1) == out.stride(-1) == 1
    assert q_blocks.is_contiguous() and q_blocks.shape[0] == 2
    block_d = next_power_of_2(head_dim)
    table_m = extend_block_m(head_dim)
    block_m, block_n, stages, warps = launch or extend_launch(head_dim, q.dtype, k_cache.dtype,
                                                              shared_memory_limit(q.device))
    num_blocks = q_blocks.shape[1]
    _extend_kernel[(num_blocks * (table_m // block_m), num_q_heads)](
        q, k_cache, v_cache, out, out if sinks is None else sinks, req_to_token, req_rows, cu_q, kv_lens, q_blocks,
        num_blocks,
        score_scale(sm_scale, softcap),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0), GROUP=num_q_heads // k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=block_d, TABLE_M=table_m, BLOCK_M=block_m, BLOCK_N=block_n, DOT_UPCAST=not q.is_cuda, WINDOW=window,
        SOFTCAP=float(softcap), AS_F16=fp8_dot_dtype(q, k_cache) != q.dtype, SINKS=sinks is not None,
        SPLIT_FROM=SPLIT_FROM_KEYS, num_warps=warps, num_stages=stages)
    return out
