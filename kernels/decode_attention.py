"""Decode attention: one query token per request over its KV slots in the token table, GQA.

The Triton version is split-K ("flash-decoding"), one launch: each request's keys are split
into chunks and, per (request, kv head, chunk), a program computes a partial softmax for all the
query heads of that kv group at once, so each K/V row is read once per group. The chunks are
merged by their log-sum-exp in the same launch: each program of a (request, kv head) counts
itself done on a device counter once its partial is stored, and the last to arrive merges them
all and sets the counter back to zero (a merge kernel of its own cost a decode step one launch
a layer, ~2 us each at batch 1). Large batches keep one chunk per request, written straight to
the output. Requires 1 <= seq_lens[b] <= max_seqlen <= req_to_token.shape[1].

A request verifying k drafts has 1 + k consecutive rows, one position apart. A program takes up
to `rows` of them at once (its tile: rows x the group's query heads, each row masked to its own
keys), so their keys are read once, not once a row; the groups are found on the device from the
rows' request rows and lengths alone (_group_size).

A sliding-window layer (`window` > 0) attends to the last `window` keys only, the query's own
included (as transformers' sliding mask: key position > query position - window); its chunks
split those keys alone. `softcap` > 0 caps each score s at softcap * tanh(s / softcap) (Gemma 2).
Both are compile-time constants of the Triton kernel: an unwindowed, uncapped layer pays nothing.
`sinks` [Hq] fp32 (gpt-oss): one learned logit per query head that joins every softmax's
denominator and nothing else (a key whose value is zero); its weight is added where the softmax
is normalised, once per query, after the chunks' merge.
"""
import torch
import torch.nn.functional as F

from ._triton import (attend_kv_block, cdiv, fast_launch, fit_attention_launch, fp8_dot_dtype, grid_dependency_wait,
                      next_power_of_2, num_sms, pdl, score_scale, shared_memory_limit, sink_weight, tl, triton,
                      zeroed_counters)

MAX_SPLITS = 32
WAVES = 4  # programs to aim for, per SM
# (keys per inner step, warps, pipeline stages) of a launch. One split per request (large batches):
# 128 keys over three stages in 4 warps; on an H200 (tune_decode_attention.py, 8B heads, 2026-12-04,
# 76414e0) 0.94-1.01 of the KV stream's copy-speed floor at 256 and 512 requests of 512 and 1024
# keys, against 0.87-0.91 for the H100's 64 / 2 / 2 (2026-11-23, 6bfa73e: 0.96 there at batch 256);
# in bench-8b's decode step of 512 x 512 (profile_step.py, same lease) 283.6 against 312.6 us a
# layer, the step one in flight 21.76 against 22.54 ms. Split requests (small batches) take wider
# blocks over two stages (H100, batch 64 at 0.89 of the floor against 0.61 for 64 / 4 / 2).
WHOLE_LAUNCH = (128, 4, 3)
SPLIT_LAUNCH = (128, 4, 2)
# Split requests also take at least this many keys a chunk. Up to FEW_REQUESTS requests, whose
# step waits on a chain of latencies rather than on the KV stream, narrow blocks over 8 warps and
# chunks of 64, and a request whose keys fit one chunk writes its output directly (DIRECT); more,
# wide blocks and chunks of 256. H100, 8B heads, 2026-11-27 at e8b5a6a, against wide blocks and
# chunks of 64 for all: tune_decode_attention.py (the kernel alone, its KV warm in L2) batch 1 at
# 1024 keys 6.2 us against 8.0, batch 8 12.2 against 15.0; in the step (profile_step.py, graph
# replay) batch 8 6.221 ms against 6.272, batch 1 at 256 keys 5.665 against 5.685, batches 16-64
# unchanged.
MIN_CHUNK = 256
FEW_REQUESTS = 2
FEW_LAUNCH, FEW_MIN_CHUNK = (64, 8, 2), 64


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                         max_seqlen: int, sm_scale: float, out: torch.Tensor | None = None, window: int = 0,
                         softcap: float = 0.0, plan_for: tuple[int, int] | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; request b attends to slots req_to_token[req_rows[b], :seq_lens[b]] (the last
    `window` of them where window > 0). The result
    [B, Hq, D] goes to `out` where given (a slice of the step's attention output), else a new tensor.
    `plan_for` is the Triton launch's (decode_attention_triton); no part of the result.

    A row of length 1 attends to its one slot, so its output is that slot's V: computed apart,
    because a padded mixed step (cuda_graph.py) has one such row per prompt token, and the
    general path costs every row max_seqlen keys."""
    out = torch.empty_like(q) if out is None else out
    group = q.shape[1] // k_cache.shape[1]
    single = seq_lens == 1
    first = req_to_token[req_rows.long(), 0].long()
    alone = v_cache[first[single]].float().repeat_interleave(group, 1)
    if sinks is not None:  # the one key's weight against the sink's: sigmoid(s - sink)
        scores = (q[single].float() * k_cache[first[single]].float().repeat_interleave(group, 1)).sum(-1) * sm_scale
        alone = alone * torch.sigmoid(_capped(scores, softcap) - sinks.float())[..., None]
    out[single] = alone.to(q.dtype)
    longer = (~single).nonzero().flatten()  # the CPU path: a host sync here is fine
    if len(longer):
        out[longer] = _attend_rows(q[longer], k_cache, v_cache, req_to_token, req_rows[longer], seq_lens[longer],
                                   max_seqlen, sm_scale, window, softcap, sinks)
    return out


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [..., Hq, rows, keys] (-inf where hidden); with sinks
    [Hq] one more logit per head joins each denominator, its own weight dropped."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def _attend_rows(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, max_seqlen: int, sm_scale: float,
                 window: int, softcap: float, sinks: torch.Tensor | None = None):
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    seq_lens = seq_lens.long()
    span = min(max_seqlen, window) if window else max_seqlen  # keys a row may see
    first = (seq_lens - span).clamp(min=0)  # [B]: a window's first key; 0 without one
    positions = first[:, None] + torch.arange(span, device=q.device)  # [B, L]
    valid = positions < seq_lens[:, None]
    slots = req_to_token[req_rows.long()[:, None], positions].long()
    slots = torch.where(valid, slots, 0)  # entries past seq_len may hold stale or unset slots
    k = k_cache[slots].float()  # [B, L, Hk, D]
    v = v_cache[slots].float()
    if not softcap and sinks is None:  # torch's SDPA: 2-2.5x the written-out scores below on a CPU
        out = F.scaled_dot_product_attention(q.float()[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=valid[:, None, None, :], scale=sm_scale, enable_gqa=True)
        return out[:, :, 0].to(q.dtype)
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = _capped(torch.einsum("bhgd,blhd->bhgl", qg, k) * sm_scale, softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))  # [B, Hk, G, L]
    probs = softmax_with_sinks(scores.flatten(1, 2)[:, :, None], sinks).view(scores.shape)
    return torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)


@triton.jit
def _chunk(seen, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr):
    """Keys per split of a group: the `seen` keys its rows see together over NUM_SPLITS, at least
    MIN_KEYS, a multiple of BLOCK_N. Every program of the group agrees on it."""
    return tl.cdiv(tl.maximum(tl.cdiv(seen, NUM_SPLITS), MIN_KEYS), BLOCK_N) * BLOCK_N


@triton.jit
def _num_used(seen, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr):
    """The chunks that hold a group's keys."""
    return tl.cdiv(seen, _chunk(seen, NUM_SPLITS, BLOCK_N, MIN_KEYS))


@triton.jit
def _chained(req_rows_ptr, seq_lens_ptr, rows, batch, req_row, seq_len, offsets):
    """Whether each of `rows` (at `offsets` from a row of request row req_row and length seq_len)
    is that request's query `offsets` positions further on: a drafting request's rows in a step."""
    inside = (rows >= 0) & (rows < batch)
    return (inside & (tl.load(req_rows_ptr + rows, mask=inside, other=-1) == req_row)
            & (tl.load(seq_lens_ptr + rows, mask=inside, other=0) == seq_len + offsets))


@triton.jit
def _group_size(req_rows_ptr, seq_lens_ptr, row, batch, req_row, seq_len, ROWS: tl.constexpr):
    """The rows this program attends for, from `row` (0: another program has them). Consecutive
    rows of one request one position apart (its last token and its drafts) form groups of up to
    ROWS rows, counted from the request's first row in the step: each row is in exactly one group,
    whose keys are then read once for all of its rows, and a request's 1 + k rows take
    ceil((1 + k) / ROWS) groups. Decided from the rows' own lengths, so a graph's padding rows
    (all of length 1) stay alone and any mix of decodes and drafts needs no metadata of its own."""
    # 32 rows looked back over: more than a verifying request has (1 + at most 16 drafts,
    # lightllm/engine/spec/config.py); a longer run would only have some rows attended twice, alike.
    back = tl.arange(0, 32) + 1
    before = _chained(req_rows_ptr, seq_lens_ptr, row - back, batch, req_row, seq_len, -back)
    depth = tl.sum(before.to(tl.int32))  # the request's rows before this one (they are adjacent)
    offsets = tl.arange(0, ROWS)
    member = _chained(req_rows_ptr, seq_lens_ptr, row + offsets, batch, req_row, seq_len, offsets)
    size = tl.min(tl.where(member, ROWS, offsets))  # the first row not in the group
    return tl.where(depth % ROWS == 0, size, 0)


@fast_launch
@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, req_to_token_ptr, req_rows_ptr, seq_lens_ptr, part_o_ptr,
                         part_lse_ptr, counters_ptr, o_ptr, sinks_ptr, qk_scale, q_batch_stride, q_head_stride,
                         k_slot_stride,
                         k_head_stride, v_slot_stride, v_head_stride, req_to_token_stride, o_batch_stride,
                         o_head_stride, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr, MIN_KEYS: tl.constexpr, DOT_UPCAST: tl.constexpr,
                         WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, AS_F16: tl.constexpr,
                         DIRECT: tl.constexpr, PDL: tl.constexpr, SINKS: tl.constexpr, ROWS: tl.constexpr):
    """Attention of one group's chunk for the GROUP query heads sharing one kv head.

    A group is one query row, or with ROWS > 1 up to ROWS rows of one request (_group_size: a
    verifying request's last token and drafts), which see the same keys but each its own first
    ones; its tile is its rows x GROUP heads, so the keys are read once for all of them.
    With one chunk per group (NUM_SPLITS == 1, large batches), or (DIRECT, one or two requests)
    where the group's keys fit one chunk, the output is final: it goes straight to o. Otherwise
    the program writes the chunk's normalised output and its log2-sum-exp2 per query, counts
    itself on the (group's first row, kv head)'s counter, and the last of the group's used chunks
    merges them into o (_merge_chunks); empty chunks (past the group's keys) neither write nor
    count. Chunks count from the first key a row of the group sees: 0, or its window's first.
    Each group splits its own keys (_chunk), so a short request beside a long one, or under a
    CUDA graph's fixed bound, still spreads over the splits."""
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    req_row = tl.load(req_rows_ptr + row)
    rows_in = 1
    if ROWS > 1:
        # the grid's first axis is the batch: no argument of its own (an int argument's value is
        # part of a Triton kernel's specialisation, and eager steps' batches would compile anew)
        rows_in = _group_size(req_rows_ptr, seq_lens_ptr, row, tl.num_programs(0), req_row, seq_len, ROWS)
    if rows_in == 0:
        return
    last_len = seq_len + rows_in - 1  # the group's last row sees the most keys
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(seq_len - WINDOW, 0)
    seen = last_len - first_key
    chunk = _chunk(seen, NUM_SPLITS, BLOCK_N, MIN_KEYS)
    first = first_key + split * chunk
    if first >= last_len:
        return
    last = tl.minimum(first + chunk, last_len)
    token_row = req_to_token_ptr + req_row.to(tl.int64) * req_to_token_stride
    # The lengths and the token table are the step's; q and this step's keys come from rotary_kv.
    grid_dependency_wait(PDL)
    tile = tl.arange(0, BLOCK_G)
    offsets = tile // GROUP  # each tile row's query: the group's row `offsets` on, head kv_head * GROUP + tile % GROUP
    heads = kv_head * GROUP + tile % GROUP
    valid = offsets < rows_in
    rows = row + tl.where(valid, offsets, 0).to(tl.int64)
    lens = seq_len + tl.where(valid, offsets, rows_in - 1)  # keys each tile row sees (padding: the last row's)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    # BLOCK_G >= 16 rows for tl.dot; the padding rows are zero queries and are never stored.
    q = tl.load(q_ptr + rows[:, None] * q_batch_stride + heads[:, None] * q_head_stride + dims[None, :],
                mask=valid[:, None] & dim_mask[None, :], other=0.0)
    if AS_F16:  # an fp8 cache: K/V are widened to q's dtype (attend_kv_block), here fp16
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(first, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < last
        allowed = col_mask[None, :]
        if ROWS > 1:  # a group's earlier rows see fewer keys (and, in a window, start earlier)
            allowed = allowed & (cols[None, :] < lens[:, None])
            if WINDOW > 0:
                allowed = allowed & (cols[None, :] >= lens[:, None] - WINDOW)
        m_i, l_i, acc = attend_kv_block(q, m_i, l_i, acc, k_ptr, v_ptr, token_row, cols, col_mask, allowed,
                                        kv_head, dims, dim_mask, k_slot_stride, k_head_stride, v_slot_stride,
                                        v_head_stride, qk_scale, DOT_UPCAST, SOFTCAP, ROWS > 1)
    o_offsets = rows * o_batch_stride + heads * o_head_stride
    # Whether this program's output is final: known at compile time but for DIRECT's split launches,
    # so the other kernels compile one store path only.
    if NUM_SPLITS == 1:
        final = True
    elif DIRECT:  # one or two requests: a group whose keys fit one chunk skips the partials, the count and the merge
        final = _num_used(seen, NUM_SPLITS, BLOCK_N, MIN_KEYS) == 1
    else:
        final = False
    if final:
        l_i += sink_weight(sinks_ptr, heads, valid, m_i, SINKS)
        _store_final(acc, l_i, o_ptr, o_offsets, valid, dims, dim_mask)
    else:
        # part_o [B, Hq, NUM_SPLITS, BLOCK_D] and part_lse [B, Hq, NUM_SPLITS], contiguous: split 0 of each query
        parts = (rows * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS
        _store_partial(acc, m_i, l_i, part_o_ptr, part_lse_ptr, counters_ptr, o_ptr, o_offsets, row, kv_head, split,
                       seen, parts, heads, valid, dims, dim_mask, sinks_ptr, BLOCK_G, BLOCK_D, BLOCK_N, NUM_SPLITS,
                       BLOCK_S, MIN_KEYS, SINKS)


@triton.jit
def _store_final(acc, l_i, o_ptr, o_offsets, valid, dims, dim_mask):
    tl.store(o_ptr + o_offsets[:, None] + dims[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & dim_mask[None, :])


@triton.jit
def _store_partial(acc, m_i, l_i, part_o_ptr, part_lse_ptr, counters_ptr, o_ptr, o_offsets, row, kv_head, split,
                   seen, parts, heads, valid, dims, dim_mask, sinks_ptr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, MIN_KEYS: tl.constexpr,
                   SINKS: tl.constexpr):
    """A chunk's normalised output and log2-sum-exp2 per query, counted on the (group, kv head)'s
    counter; the last of the group's used chunks merges them into o. A query that saw no key of
    this chunk (a group's earlier row) stores zeros and -inf: no weight in the merge."""
    tl.store(part_o_ptr + (parts + split)[:, None] * BLOCK_D + dims[None, :],
             acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=valid[:, None])
    tl.store(part_lse_ptr + parts + split, m_i + tl.log2(l_i), mask=valid)
    tl.debug_barrier()  # every thread's stores before the count (the atomic releases them)
    num_used = _num_used(seen, NUM_SPLITS, BLOCK_N, MIN_KEYS)
    counter = counters_ptr + row * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_used - 1:  # the last chunk done: merge
        tl.store(counter, 0)  # every used chunk has counted: ready for the next launch
        tl.debug_barrier()  # the other programs' partials, acquired, before any thread reads them
        _merge_chunks(part_o_ptr, part_lse_ptr, o_ptr, o_offsets, parts, num_used, heads, valid, dims, dim_mask,
                      sinks_ptr, BLOCK_G, BLOCK_D, BLOCK_S, SINKS)


@triton.jit
def _merge_chunks(part_o_ptr, part_lse_ptr, o_ptr, o_offsets, parts, num_used, heads, valid, dims, dim_mask,
                  sinks_ptr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  SINKS: tl.constexpr):
    """o[query] = the chunks' outputs weighted by exp2 of their log2-sum-exp2, for each query of
    the tile (parts: each one's first chunk); loads bypass L1, which may hold none of them."""
    chunks = tl.arange(0, BLOCK_S)
    used = valid[:, None] & (chunks[None, :] < num_used)
    lse = tl.load(part_lse_ptr + parts[:, None] + chunks[None, :], mask=used, other=float("-inf"), cache_modifier=".cg")
    top = tl.where(valid, tl.max(lse, 1), 0.0)  # padding queries: no chunks, no NaN
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for chunk in range(0, num_used):
        weight = tl.exp2(tl.load(part_lse_ptr + parts + chunk, mask=valid, other=float("-inf"),
                                 cache_modifier=".cg") - top)
        part = tl.load(part_o_ptr + (parts + chunk)[:, None] * BLOCK_D + dims[None, :], mask=valid[:, None],
                       other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * part
        total += weight
    total += sink_weight(sinks_ptr, heads, valid, top, SINKS)
    tl.store(o_ptr + o_offsets[:, None] + dims[None, :], (acc / total[:, None]).to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & dim_mask[None, :])


def group_rows(group: int) -> int:
    """Rows of one request a program takes by default where the plan keeps one chunk a group
    (large batches): as many as fill the 16-row tile its GROUP query heads leave (the tile tl.dot
    needs), so a verifying request's 1 + k rows read its keys ceil((1 + k) / rows) times, not
    1 + k. H200, Llama-3.1-8B's heads, tune_decode_attention.py (2026-12-02, d7caf92), us a call:
    64 requests x 5 rows at 1024 keys 154 against 189 a row alone; 256 plain decodes 272 against
    294. Split plans (small batches) keep each row alone: 64 plain decodes at 1024 keys (two
    splits) 77.3 alone against 80.9 grouped, 16 x 5 rows 50.3 against 52.0. Eight rows (a 32-row
    tile) took 64 x 5 rows in 101.1 against 106.5 us but 64 plain decodes in 109.5 against 100.5
    (H100, 2026-12-06, 9d176bf)."""
    return max(1, 16 // next_power_of_2(group))


def _programs_per_wave(device: torch.device) -> int:
    return num_sms(device)


# Chunk counters a device keeps: more than a split launch has, which is fewer (request, kv head)
# pairs than WAVES x programs_per_wave (_split_plan: 528 on an H100), whatever WAVES a test sets.
NUM_COUNTERS = 4096


def _chunk_counters(device: torch.device) -> torch.Tensor:
    """One int32 per (request, kv head) of a split launch, zero between launches."""
    return zeroed_counters("decode attention", NUM_COUNTERS, device)


def _split_plan(batch: int, num_kv_heads: int, max_seqlen: int, device: torch.device,
                launch: tuple[int, int, int] | None = None,
                min_chunk: int | None = None) -> tuple[int, tuple[int, int, int], int]:
    """(num_splits, (BLOCK_N, warps, stages), the fewest keys a chunk takes) from host ints only,
    so choosing them never waits on the GPU; `launch` and `min_chunk` override the settings
    (tune_decode_attention.py).

    Large batches already fill the GPU with one program per (request, kv head); small ones
    split the keys until there are about WAVES programs per SM, with no more splits than
    chunks of the fewest keys (and of the block) in `max_seqlen`. Each request then cuts its own
    keys into that many chunks (_chunk, on the device): a CUDA graph's bound (max_req_total_len)
    no longer leaves a short request's keys to one program."""
    wanted = cdiv(WAVES * _programs_per_wave(device), batch * num_kv_heads)
    if wanted <= 1:
        default, fewest = WHOLE_LAUNCH, MIN_CHUNK  # one chunk a request: the fewest keys play no part
    elif batch <= FEW_REQUESTS:
        default, fewest = FEW_LAUNCH, FEW_MIN_CHUNK
    else:
        default, fewest = SPLIT_LAUNCH, MIN_CHUNK
    launch, min_chunk = launch or default, min_chunk or fewest
    return max(1, min(wanted, MAX_SPLITS, cdiv(max_seqlen, max(min_chunk, launch[0])))), launch, min_chunk


def fit_decode_launch(launch: tuple[int, int, int], block_g: int, head_dim: int, q_dtype: torch.dtype,
                      kv_dtype: torch.dtype, limit: int | None) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of `launch` with the key block and the stages shrunk where its tiles
    (block_g queries, BLOCK_N keys a stage) would take more shared memory than `limit`
    (shared_memory_limit): SPLIT_LAUNCH at Gemma 3's 256-dim heads, every launch at 512."""
    block_n, warps, stages = launch
    _, block_n, stages = fit_attention_launch(block_g, block_n, stages, next_power_of_2(head_dim), q_dtype.itemsize,
                                              kv_dtype.itemsize, limit, block_g)
    return block_n, warps, stages


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                            max_seqlen: int, sm_scale: float, out: torch.Tensor | None = None, window: int = 0,
                            softcap: float = 0.0, plan_for: tuple[int, int] | None = None,
                            launch: tuple[int, int, int] | None = None, fp8_as_f16: bool = True,
                            min_chunk: int | None = None, sinks: torch.Tensor | None = None,
                            rows: int | None = None) -> torch.Tensor:
    """As decode_attention_ref. The launch plan (splits, block, the fewest keys a split takes) is
    chosen for `plan_for` = (batch, max_seqlen) where given, at least this call's: each plan is a
    kernel Triton compiles, so an eager step takes the plan of the CUDA graph its decodes would
    replay, whose kernel the capture compiled (a plan of its own compiled it again while serving,
    0.3-0.6 s on an H200). `launch` overrides the launch's (BLOCK_N, warps, stages), `min_chunk`
    the fewest keys a split takes (tune_decode_attention.py). `rows`: the most rows of one request
    a program attends for at once (by default group_rows's with one split, else 1: each row alone).
    An fp8 cache is widened to fp16 (fp8_dot_dtype); fp8_as_f16=False widens it to q's dtype, the
    old way (decode_attention_kv_dtype.py times both)."""
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == req_to_token.stride(-1) == 1
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    plan_batch, plan_seqlen = plan_for or (batch, max_seqlen)
    assert plan_batch >= batch and plan_seqlen >= max_seqlen  # a graph bucket holds its batch, its bound every length
    span = min(plan_seqlen, window) if window else plan_seqlen  # the most keys one query sees
    splits, (block_n, warps, stages), min_chunk = _split_plan(plan_batch, num_kv_heads, span, q.device, launch,
                                                              min_chunk)
    block_d = next_power_of_2(head_dim)
    if rows is None:  # grouped where one program takes a group's keys (large batches): measured fastest there
        rows = group_rows(group) if splits == 1 else 1
    block_g = max(16, next_power_of_2(group * rows))
    block_n, warps, stages = fit_decode_launch((block_n, warps, stages), block_g, head_dim, q.dtype, k_cache.dtype,
                                               shared_memory_limit(q.device))
    out = torch.empty_like(q) if out is None else out
    assert out.stride(-1) == 1
    if splits > 1:
        part_o = torch.empty(batch, num_q_heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
        counters = _chunk_counters(q.device)
        assert batch * num_kv_heads <= counters.numel()  # the plan splits only batches below that
    else:  # one split writes `out` directly and never touches the partials: `out` stands in for them
        part_o = part_lse = counters = out
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, req_to_token, req_rows, seq_lens, part_o, part_lse, counters, out,
        out if sinks is None else sinks, score_scale(sm_scale, softcap), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), out.stride(0), out.stride(1), GROUP=group,
        BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=splits, BLOCK_S=next_power_of_2(splits), MIN_KEYS=min_chunk, DOT_UPCAST=not q.is_cuda,
        WINDOW=window, SOFTCAP=float(softcap), AS_F16=fp8_as_f16 and fp8_dot_dtype(q, k_cache) != q.dtype,
        DIRECT=plan_batch <= FEW_REQUESTS, SINKS=sinks is not None, ROWS=rows,
        num_warps=warps, num_stages=stages, **pdl(q))
    return out
