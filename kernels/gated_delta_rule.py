"""The gated delta rule (Gated DeltaNet's linear attention, Qwen3-Next and Qwen3.5), in fp32.

Per value head a state S [dk, dv] decays by exp(g_t) each token, then takes the delta rule's
correction toward v_t along the (L2-normalised) key: S = a S + k (beta (v - k^T a S))^T, and the
output reads it with the scaled, L2-normalised query: o = S^T q. Three forms with one meaning:

- `gated_delta_rule_varlen_ref`: a step's prompt chunks, packed, each from its initial state, all
  at once, in blocks of CHUNK tokens (the WY form: each block is a triangular solve and a few
  matmuls, and the state is carried block to block). `gated_delta_rule_chunk_ref` is the same for
  one sequence.
- `gated_delta_rule_chunks_ref` / `_triton`: the prefill and extend path, the same over all of a
  step's tokens with the chunk bounds on the device and the states in a pool by request row,
  updated in place (no host read: a padded step's forward is captured in a CUDA graph). The
  Triton form is two launches: each block's WY transform (I + A)^-1 and causal scores in fp32,
  every block of the step at once, then a program per (chunk, value head, 32 value dimensions)
  carrying its state tile [k_dim, 32] in fp32 through the chunk's blocks (its dots in the inputs'
  dtype).
- `gated_delta_rule_step_ref` / `_triton`: one token for each of B requests, their states updated
  in place in a pool by row; the decode path.

Key heads fewer than value heads are shared by consecutive value heads (GQA-style). The `_ref`
functions are the CPU path and the oracle.
"""
import torch

from ._triton import cdiv, dot, fast_launch, next_power_of_2, tl, triton

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, dk] -> fp32 [..., Hv, dk], L2-normalised, q scaled by dk^-1/2."""
    groups = num_v_heads // q.shape[-2]
    q, k = (x.float().repeat_interleave(groups, dim=-2) if groups > 1 else x.float() for x in (q, k))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def gated_delta_rule_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, cu_seqlens: list[int], states: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """N packed sequences (a step's prompt chunks), all at once: q, k [T, Hk, dk], v [T, Hv, dv],
    g (log decay, <= 0) and beta [T, Hv]; sequence i is tokens [cu_seqlens[i], cu_seqlens[i+1])
    and starts from states[i] ([N, Hv, dk, dv] fp32). Returns (o [T, Hv, dv] in v's dtype, the final
    states [N, Hv, dk, dv] fp32).

    Each sequence is cut into blocks of CHUNK tokens, its last one padded with tokens that leave
    the state as it is (k = 0, g = 0), so that memory follows the tokens, not N x the longest. The
    blocks' own work is batched over all of them; the state then goes block by block, each round
    taking the i-th block of every sequence that has one."""
    num_heads, dtype = v.shape[1], v.dtype
    layout = BlockLayout(cu_seqlens, v.device)
    q, k = _prepare(q, k, num_heads)
    q, k, v = (layout.blocks(x).transpose(1, 2) for x in (q, k, v.float()))  # [NB, H, C, d]
    g, beta = (layout.blocks(x.float()).transpose(1, 2) for x in (g, beta))  # [NB, H, C]
    g = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [NB, H, C, C]
    k_beta = k * beta[..., None]
    # (I + strictly-lower(beta K K^T decay)) U = beta V: each block's corrected values (the WY form)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed, k_to_end = q * g.exp()[..., None], k * (g[..., -1:] - g).exp()[..., None]
    block_decay = g[..., -1].exp()[..., None, None]
    s, out = states.float().clone(), torch.empty_like(v)
    for seqs, blocks in layout.rounds():
        state = s[seqs]
        new = values[blocks] - k_decayed[blocks] @ state
        out[blocks] = q_decayed[blocks] @ state + scores[blocks] @ new
        s[seqs] = state * block_decay[blocks] + k_to_end[blocks].transpose(-1, -2) @ new
    return layout.tokens(out.transpose(1, 2)).to(dtype), s


def gated_delta_rule_chunks_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                                cu_seqlens: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, fresh: torch.Tensor,
                                out: torch.Tensor) -> None:
    """A step's prompt chunks with their states in a pool (the prefill and extend path): q, k
    [T, Hk, dk], v [T, Hv, dv], g and beta [T, Hv] over all of the step's tokens; chunk i is tokens
    [cu_seqlens[i], cu_seqlens[i+1]) ([N+1] on the device), starts from states[rows[i]] ([S, Hv, dk,
    dv] fp32), or from zeros where fresh[i] (a request's first chunk), and leaves its final state
    there. Writes out's ([T, Hv, dv]) rows of the chunks only: the rows before them (decodes) keep
    what they hold. Empty chunks (a padded step's padding) read and write no state."""
    bounds = cu_seqlens.tolist()
    lo, hi = bounds[0], bounds[-1]
    initial = torch.where(fresh.view(-1, 1, 1, 1), 0, states[rows])
    out[lo:hi], final = gated_delta_rule_varlen_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                                    [b - lo for b in bounds], initial)
    filled = cu_seqlens[1:] > cu_seqlens[:-1]
    states[rows[filled]] = final[filled]


class BlockLayout:
    """Packed sequences in blocks of CHUNK tokens: where each token sits ([block, offset]) and, for
    round i, the sequences with an i-th block and that block's index (one upload)."""

    def __init__(self, cu_seqlens: list[int], device: torch.device):
        lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        counts = [-(-n // CHUNK) for n in lengths]
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        self.num_blocks = sum(counts)
        index = [(firsts[i] + p // CHUNK) * CHUNK + p % CHUNK for i, n in enumerate(lengths) for p in range(n)]
        rounds = [[(i, firsts[i] + r) for i in range(len(counts)) if counts[i] > r] for r in range(max(counts))]
        self.sizes = [len(r) for r in rounds]
        pairs = [pair for r in rounds for pair in r]
        host = torch.tensor(index + [i for i, _ in pairs] + [b for _, b in pairs], dtype=torch.int64)
        flat = host.to(device, non_blocking=True)
        self.index, self._seqs, self._blocks = flat.split([len(index), len(pairs), len(pairs)])

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Packed [T, ...] -> [blocks, CHUNK, ...], zeros past each sequence's end."""
        out = x.new_zeros((self.num_blocks * CHUNK, *x.shape[1:]))
        out[self.index] = x
        return out.view(self.num_blocks, CHUNK, *x.shape[1:])

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[blocks, CHUNK, ...] -> packed [T, ...]."""
        return x.reshape(self.num_blocks * CHUNK, *x.shape[2:])[self.index]

    def rounds(self):
        start = 0
        for size in self.sizes:
            yield self._seqs[start: start + size], self._blocks[start: start + size]
            start += size


def gated_delta_rule_chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [T, Hk, dk], v [T, Hv, dv], g and beta [T, Hv], state [Hv, dk, dv] fp32 or
    None (zeros). Returns (o [T, Hv, dv] in v's dtype, final state fp32)."""
    if state is None:
        state = v.new_zeros((v.shape[1], k.shape[-1], v.shape[-1]), dtype=torch.float32)
    out, final = gated_delta_rule_varlen_ref(q, k, v, g, beta, [0, v.shape[0]], state[None])
    return out, final[0]


def gated_delta_rule_step_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One token each of B requests: q, k [B, Hk, dk], v [B, Hv, dv], g and beta [B, Hv]; states
    [S, Hv, dk, dv] fp32, rows [B] each request's state, updated in place. Returns o [B, Hv, dv].
    A row of -1 (a padded step's padding) reads and writes no state; its output is zeros."""
    q, k = _prepare(q, k, v.shape[1])
    live = rows >= 0
    s = states[rows.clamp(min=0)] * g.float().exp()[..., None, None]
    delta = (v.float() - (s * k[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    states[rows[live]] = s[live]
    return torch.where(live[:, None, None], (s * q[..., None]).sum(-2), 0).to(v.dtype)


@fast_launch
@triton.jit
def _gated_delta_rule_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, rows_ptr, o_ptr,
                                  q_stride, q_head_stride, k_stride, k_head_stride, v_stride, v_head_stride,
                                  g_stride, beta_stride, o_stride, o_head_stride, num_heads, group, scale,
                                  DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (request, value head, block of value dims): its state's columns [DK, BLOCK_V] decay,
    take the delta rule's correction and give the output's columns. States [S, H, DK, DV] contiguous."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < DK, dv < DV
    key_head = head // group
    q = tl.load(q_ptr + b * q_stride + key_head * q_head_stride + dk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * k_stride + key_head * k_head_stride + dk, mask=k_mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + b * v_stride + head * v_head_stride + dv, mask=v_mask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * g_stride + head).to(tl.float32))
    beta = tl.load(beta_ptr + b * beta_stride + head).to(tl.float32)
    row = tl.load(rows_ptr + b).to(tl.int64)
    if row < 0:  # padding: no state, and the output's zeros stay
        return
    s_ptrs = states_ptr + (row * num_heads + head) * DK * DV + dk[:, None] * DV + dv[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptrs, s, mask=mask)
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + b * o_stride + head * o_head_stride + dv, out.to(o_ptr.dtype.element_ty), mask=v_mask)


def gated_delta_rule_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    assert states.is_contiguous() and states.dtype == torch.float32
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and g.stride(-1) == beta.stride(-1) == 1
    batch, num_heads, dv = v.shape
    dk = q.shape[-1]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # a padding row's (row -1) output
    if batch == 0:
        return out
    block_v = min(next_power_of_2(dv), 32)  # a program's state tile [dk, 32] stays in registers
    grid = (batch, num_heads, cdiv(dv, block_v))
    _gated_delta_rule_step_kernel[grid](q, k, v, g, beta, states, rows, out, q.stride(0), q.stride(1), k.stride(0),
                                        k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
                                        out.stride(0), out.stride(1), num_heads, num_heads // q.shape[1],
                                        dk ** -0.5, DK=dk, DV=dv, BLOCK_K=next_power_of_2(dk), BLOCK_V=block_v)
    return out


# ---- the chunked form's Triton kernels: a step's prompt chunks, bounds and states on the device ----

# The Triton kernels' block (tokens): a constant of its own, so that the interpreter's tests can cut
# blocks of 16 and cross many block boundaries on tiny sequences.
TRITON_CHUNK = CHUNK
# The chunks kernel's value dimensions a program (its state tile [k_dim, BLOCK_V]) and warps: chosen
# by register count, not yet timed on a GPU (test/benchmark/kernels/delta_rule_bench.py sets them).
CHUNKS_BLOCK_V, CHUNKS_WARPS = 32, 8


@triton.jit
def _block_bounds(cu_ptr, num_seqs, block, BT: tl.constexpr):
    """The tokens [lo, hi) of the packed sequences' block-th block of BT (sequence by sequence,
    each cut from its start); lo == hi past the last block."""
    lo = tl.load(cu_ptr) * 0
    hi = lo
    seen = lo
    for s in range(num_seqs):
        a = tl.load(cu_ptr + s)
        b = tl.load(cu_ptr + s + 1)
        n = (b - a + BT - 1) // BT
        inside = (block >= seen) & (block < seen + n)
        lo = tl.where(inside, a + (block - seen) * BT, lo)
        hi = tl.where(inside, tl.minimum(a + (block - seen + 1) * BT, b), hi)
        seen += n
    return lo, hi


@triton.jit
def _unit_keys(k_ptr, t, t_mask, k_stride, head_offset, dk, dk_mask):
    """[BT, BK] fp32 L2-normalised keys (zeros for masked tokens)."""
    k = tl.load(k_ptr + t[:, None] * k_stride + head_offset + dk[None, :], mask=t_mask[:, None] & dk_mask[None, :],
                other=0.0).to(tl.float32)
    return k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]


@fast_launch
@triton.jit(do_not_specialize=["num_seqs"])  # one kernel for every step's chunk count
def _delta_rule_blocks_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, cu_ptr, blocks_ptr, num_seqs, q_stride, q_head_stride,
                              k_stride, k_head_stride, g_stride, beta_stride, num_heads, group, scale,
                              DK: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One (block, value head), in fp32: T = (I + A)^-1 for A[i, j] = beta_i k_i.k_j exp(G_i - G_j),
    i > j (G the block's cumulative log decay), by forward substitution row by row (T is the
    block's WY transform: `gated_delta_rule_varlen_ref`'s triangular solves), and the causal scores
    q_i.k_j exp(G_i - G_j), i >= j. blocks [2, blocks, H, BT, BT]: the transforms, then the scores."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    lo, hi = _block_bounds(cu_ptr, num_seqs, block, BT)
    if hi <= lo:
        return
    i = tl.arange(0, BT)
    t = lo + i
    t_mask = t < hi
    dk = tl.arange(0, BK)
    key_head = head // group
    k = _unit_keys(k_ptr, t, t_mask, k_stride, key_head * k_head_stride, dk, dk < DK)
    q = _unit_keys(q_ptr, t, t_mask, q_stride, key_head * q_head_stride, dk, dk < DK) * scale
    beta = tl.load(beta_ptr + t * beta_stride + head, mask=t_mask, other=0.0).to(tl.float32)
    gc = tl.cumsum(tl.load(g_ptr + t * g_stride + head, mask=t_mask, other=0.0).to(tl.float32), axis=0)
    decay = tl.exp(tl.where(i[:, None] >= i[None, :], gc[:, None] - gc[None, :], float("-inf")))
    a = tl.where(i[:, None] > i[None, :], dot(k * beta[:, None], tl.trans(k), DOT_UPCAST) * decay, 0.0)
    inverse = (i[:, None] == i[None, :]).to(tl.float32)
    for r in range(1, BT):  # row r = e_r - sum_{j<r} A[r, j] T[j, :]; rows above r are final
        a_r = tl.sum(tl.where(i[:, None] == r, a, 0.0), axis=0)
        row = tl.where(i == r, 1.0, -tl.sum(a_r[:, None] * inverse, axis=0))
        inverse = tl.where(i[:, None] == r, row[None, :], inverse)
    tile = (block.to(tl.int64) * num_heads + head) * BT * BT + i[:, None] * BT + i[None, :]
    tl.store(blocks_ptr + tile, inverse)
    scores_ptr = blocks_ptr + tl.num_programs(0).to(tl.int64) * num_heads * BT * BT
    tl.store(scores_ptr + tile, dot(q, tl.trans(k), DOT_UPCAST) * decay)


@triton.jit
def _mm(a, b, DT: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """a @ b with operands in DT (the inputs' dtype: bf16 on tensor cores, fp32 exact), fp32 sums."""
    return dot(a.to(DT), b.to(DT), DOT_UPCAST)


@fast_launch
@triton.jit(do_not_specialize=["num_blocks"])  # (the step's tokens and chunks bound it)
def _delta_rule_chunks_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, states_ptr, rows_ptr, fresh_ptr,
                              blocks_ptr, num_blocks, o_ptr, q_stride, q_head_stride, k_stride, k_head_stride, v_stride,
                              v_head_stride, g_stride, beta_stride, o_stride, o_head_stride, num_heads, group, scale,
                              DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One (sequence, value head, block of BV value dimensions): its state's columns [DK, BV] from
    the pool (or zeros), carried block by block over the sequence, then back to the pool. Per
    block: new values U = T (beta v - beta e^G k S), o = (q e^G) S + (q k^T decay) U, and
    S = e^G_last S + (k e^(G_last - G))^T U, T and the scores from _delta_rule_blocks_kernel.
    States [S, H, DK, DV] contiguous."""
    seq = tl.program_id(0)
    lo = tl.load(cu_ptr + seq)
    hi = tl.load(cu_ptr + seq + 1)
    if hi <= lo:  # a padding chunk: no state
        return
    head = tl.program_id(1)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    dk = tl.arange(0, BK)
    i = tl.arange(0, BT)
    dk_mask, dv_mask = dk < DK, dv < DV
    DT = v_ptr.dtype.element_ty
    first_block = tl.load(cu_ptr) * 0
    for s in range(seq):  # this sequence's first block among all of the step's (its tiles' index)
        first_block += (tl.load(cu_ptr + s + 1) - tl.load(cu_ptr + s) + BT - 1) // BT
    row = tl.load(rows_ptr + seq).to(tl.int64)
    s_ptrs = states_ptr + (row * num_heads + head) * DK * DV + dk[:, None] * DV + dv[None, :]
    s_mask = dk_mask[:, None] & dv_mask[None, :]
    keep = tl.load(fresh_ptr + seq + dk * 0) == 0  # (as a vector: the interpreter masks with arrays only)
    state = tl.load(s_ptrs, mask=s_mask & keep[:, None], other=0.0)
    key_head = head // group
    for b in range((hi - lo + BT - 1) // BT):
        t = lo + b * BT + i
        t_mask = t < hi
        k = _unit_keys(k_ptr, t, t_mask, k_stride, key_head * k_head_stride, dk, dk_mask)
        q = _unit_keys(q_ptr, t, t_mask, q_stride, key_head * q_head_stride, dk, dk_mask) * scale
        v = tl.load(v_ptr + t[:, None] * v_stride + head * v_head_stride + dv[None, :],
                    mask=t_mask[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * beta_stride + head, mask=t_mask, other=0.0).to(tl.float32)
        gc = tl.cumsum(tl.load(g_ptr + t * g_stride + head, mask=t_mask, other=0.0).to(tl.float32), axis=0)
        g_last = tl.max(tl.where(i == BT - 1, gc, float("-inf")), axis=0)  # padding tokens add 0
        tile = blocks_ptr + ((first_block + b).to(tl.int64) * num_heads + head) * BT * BT + i[:, None] * BT + i[None, :]
        inverse = tl.load(tile)
        scores = tl.load(tile + num_blocks.to(tl.int64) * num_heads * BT * BT)
        corrected = v * beta[:, None] - _mm(k * (beta * tl.exp(gc))[:, None], state, DT, DOT_UPCAST)
        new = _mm(inverse, corrected, DT, DOT_UPCAST)  # [BT, BV]
        out = _mm(q * tl.exp(gc)[:, None], state, DT, DOT_UPCAST) + _mm(scores, new, DT, DOT_UPCAST)
        tl.store(o_ptr + t[:, None] * o_stride + head * o_head_stride + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & dv_mask[None, :])
        state = state * tl.exp(g_last) + _mm(tl.trans(k * tl.exp(g_last - gc)[:, None]), new, DT, DOT_UPCAST)
    tl.store(s_ptrs, state, mask=s_mask)


def gated_delta_rule_chunks_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, cu_seqlens: torch.Tensor, states: torch.Tensor,
                                   rows: torch.Tensor, fresh: torch.Tensor, out: torch.Tensor) -> None:
    """Two launches, no host read: each block's WY transform and scores (all blocks at once, a grid
    bounded by the tokens and chunks), then every chunk's state carried through its blocks."""
    assert states.is_contiguous() and states.dtype == torch.float32
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == out.stride(-1) == 1
    assert g.stride(-1) == beta.stride(-1) == 1
    tokens, num_heads, dv = v.shape
    dk, num_seqs, bt = q.shape[-1], rows.shape[0], TRITON_CHUNK
    max_blocks = cdiv(tokens, bt) + num_seqs  # each chunk adds at most one partial block
    blocks = torch.empty(2, max_blocks, num_heads, bt, bt, dtype=torch.float32, device=v.device)
    group, block_k, upcast, scale = num_heads // q.shape[1], max(16, next_power_of_2(dk)), not v.is_cuda, dk ** -0.5
    _delta_rule_blocks_kernel[(max_blocks, num_heads)](
        q, k, g, beta, cu_seqlens, blocks, num_seqs, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0),
        beta.stride(0), num_heads, group, scale, DK=dk, BT=bt, BK=block_k, DOT_UPCAST=upcast)
    block_v = max(16, min(next_power_of_2(dv), CHUNKS_BLOCK_V))
    _delta_rule_chunks_kernel[(num_seqs, num_heads, cdiv(dv, block_v))](
        q, k, v, g, beta, cu_seqlens, states, rows, fresh.view(torch.uint8), blocks, max_blocks, out, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), out.stride(0),
        out.stride(1), num_heads, group, scale, DK=dk, DV=dv, BT=bt, BK=block_k, BV=block_v, DOT_UPCAST=upcast,
        num_warps=CHUNKS_WARPS)
