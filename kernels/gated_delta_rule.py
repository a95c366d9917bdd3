"""The gated delta rule (Gated DeltaNet's linear attention, Qwen3-Next and Qwen3.5), in fp32.

Per value head a state S [dk, dv] decays by exp(g_t) each token, then takes the delta rule's
correction toward v_t along the (L2-normalised) key: S = a S + k (beta (v - k^T a S))^T, and the
output reads it with the scaled, L2-normalised query: o = S^T q. Three forms with one meaning:

- `gated_delta_rule_varlen_ref`: a step's prompt chunks, packed, each from its initial state, all
  at once, in blocks of CHUNK tokens (the WY form: each block is a triangular solve and a few
  matmuls, and the state is carried block to block). `gated_delta_rule_chunk_ref` is the same for
  one sequence.
- `gated_delta_rule_chunks_ref` / `_fla`: the prefill and extend path, the same over all of a
  step's tokens with the chunk bounds on the device and the states in a pool by request row,
  updated in place (no host read: a padded step's forward is captured in a CUDA graph). On CUDA
  it runs flash-linear-attention's `chunk_gated_delta_rule` (fla-core, imported there only):
  measured on an H200 it took 1.5 ms where our own Triton chunks kernel took 26.7 ms for 8192
  tokens of a qwen3.5-27b layer (docs/architecture.md), so ours is gone; the wrapper gathers the
  initial states from the pool and scatters the final ones back.
- `gated_delta_rule_step_ref` / `_triton`: one token for each of B requests, their states updated
  in place in a pool by row; the decode path.
- `gated_delta_rule_runs_ref` / `_triton`: a run of tokens for each of N requests (a verify step's,
  bounds on the device), token after token as the step form, the pool read only or, for the
  tokens each request kept, updated (the commit after acceptance).

Key heads fewer than value heads are shared by consecutive value heads (GQA-style). The `_ref`
functions are the CPU path and the oracle.
"""
from typing import NamedTuple

import torch

from ._triton import cdiv, fast_launch, next_power_of_2, tl, triton
from .causal_conv1d import packed_runs

CHUNK = 64
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a pool's recurrent states (the math is fp32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, dk] -> fp32 [..., Hv, dk], L2-normalised, q scaled by dk^-1/2."""
    groups = num_v_heads // q.shape[-2]
    q, k = (x.float().repeat_interleave(groups, dim=-2) if groups > 1 else x.float() for x in (q, k))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def linear_gates_ref(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's per-token, per-value-head gates from its projections a, b [T, Hv] (strided
    views allowed): the log decay g = -exp(A_log) * softplus(a + dt_bias) in fp32 (neg_a = -exp(A_log),
    dt_bias fp32 [Hv]) and the write strength beta = sigmoid(b) in b's dtype."""
    return neg_a * torch.nn.functional.softplus(a.float() + dt_bias), torch.sigmoid(b)


@fast_launch
@triton.jit
def _linear_gates_kernel(a_ptr, b_ptr, neg_a_ptr, dt_bias_ptr, g_ptr, beta_ptr, heads, a_stride, b_stride, g_stride,
                         beta_stride, BLOCK_H: tl.constexpr):
    """One token's heads: both gates in one launch (the torch form is six)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = h < heads
    x = tl.load(a_ptr + t * a_stride + h, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias_ptr + h, mask=mask,
                                                                                           other=0.0)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold
    tl.store(g_ptr + t * g_stride + h, tl.load(neg_a_ptr + h, mask=mask, other=0.0) * softplus, mask=mask)
    b = tl.load(b_ptr + t * b_stride + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(beta_ptr + t * beta_stride + h, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=mask)


def linear_gates_triton(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    assert a.stride(-1) == b.stride(-1) == 1 and neg_a.dtype == dt_bias.dtype == torch.float32
    tokens, heads = a.shape
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens:
        _linear_gates_kernel[(tokens,)](a, b, neg_a, dt_bias, g, beta, heads, a.stride(0), b.stride(0), g.stride(0),
                                        beta.stride(0), BLOCK_H=next_power_of_2(heads), num_warps=1)
    return g, beta


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
                                out: torch.Tensor, plan=None) -> None:
    """A step's prompt chunks with their states in a pool (the prefill and extend path): q, k
    [T, Hk, dk], v [T, Hv, dv], g and beta [T, Hv] over all of the step's tokens; chunk i is tokens
    [cu_seqlens[i], cu_seqlens[i+1]) ([N+1] on the device), starts from states[rows[i]] ([S, Hv, dk,
    dv], fp32 or narrower: read into fp32, stored rounded), or from zeros where fresh[i] (a
    request's first chunk), and leaves its final state there. Writes out's ([T, Hv, dv]) rows of the chunks only: the rows before them (decodes) keep
    what they hold. Empty chunks (a padded step's padding) read and write no state. `plan`: the CUDA
    path's per-step `fla_plan`, not needed here."""
    bounds = cu_seqlens.tolist()
    lo, hi = bounds[0], bounds[-1]
    initial = torch.where(fresh.view(-1, 1, 1, 1), 0, states[rows].float())
    out[lo:hi], final = gated_delta_rule_varlen_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                                    [b - lo for b in bounds], initial)
    filled = cu_seqlens[1:] > cu_seqlens[:-1]
    states[rows[filled]] = final[filled].to(states.dtype)


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
                              states: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token each of B requests: q, k [B, Hk, dk], v [B, Hv, dv], g and beta [B, Hv]; states
    [S, Hv, dk, dv] (fp32 or narrower: the update runs in fp32, the state is stored rounded), rows
    [B] each request's state, updated in place. Returns o [B, Hv, dv] (written into `out` if given).
    A row of -1 (a padded step's padding) reads and writes no state; its output is zeros."""
    q, k = _prepare(q, k, v.shape[1])
    live = rows >= 0
    s = states[rows.clamp(min=0)].float() * g.float().exp()[..., None, None]
    delta = (v.float() - (s * k[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    states[rows[live]] = s[live].to(states.dtype)
    o = torch.where(live[:, None, None], (s * q[..., None]).sum(-2), 0).to(v.dtype)
    return o if out is None else out.copy_(o)


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
    row = tl.load(rows_ptr + b).to(tl.int64)
    if row < 0:  # padding: no state, zeros out
        tl.store(o_ptr + b * o_stride + head * o_head_stride + dv, tl.zeros([BLOCK_V], tl.float32).to(
            o_ptr.dtype.element_ty), mask=v_mask)
        return
    s_ptrs = states_ptr + (row * num_heads + head) * DK * DV + dk[:, None] * DV + dv[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    s = _delta_rule_token(tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32), b, q_ptr, k_ptr, v_ptr, g_ptr,
                          beta_ptr, o_ptr, q_stride, q_head_stride, k_stride, k_head_stride, v_stride, v_head_stride,
                          g_stride, beta_stride, o_stride, o_head_stride, head, key_head, scale, dk, dv, k_mask,
                          v_mask)
    tl.store(s_ptrs, s.to(states_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_rule_token(s, t, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, q_stride, q_head_stride, k_stride,
                      k_head_stride, v_stride, v_head_stride, g_stride, beta_stride, o_stride, o_head_stride, head,
                      key_head, scale, dk, dv, k_mask, v_mask):
    """Token t of one value head on its state's columns s [BLOCK_K, BLOCK_V]: the decay, the delta
    rule's correction along the L2-normalised key, the output's columns read with the scaled,
    L2-normalised query and stored; returns the new s."""
    q = tl.load(q_ptr + t * q_stride + key_head * q_head_stride + dk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * k_stride + key_head * k_head_stride + dk, mask=k_mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + t * v_stride + head * v_head_stride + dv, mask=v_mask, other=0.0).to(tl.float32)
    s = s * tl.exp(tl.load(g_ptr + t * g_stride + head).to(tl.float32))
    delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + t * beta_stride + head).to(tl.float32)
    s = s + k[:, None] * delta[None, :]
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + t * o_stride + head * o_head_stride + dv, out.to(o_ptr.dtype.element_ty), mask=v_mask)
    return s


def step_launch(dv: int, launch: tuple[int, int] | None = None) -> tuple[int, int]:
    """(value dims a program takes, its warps) for the decode step: `launch` where given (a
    benchmark's sweep), else 64 dims on 4 warps (a state tile [dk, 64] in registers): the fastest
    of 17 launches on an H200 at qwen3.5-27b's shapes, batches 64-512, bf16 and fp32 states
    (`delta_rule_bench.py --decode`, 2026-12-04: 564 against 847 us a layer at 512 in bf16, 0.67
    of a copy's bandwidth against 0.45; 835 against 983 us in fp32, 0.91 against 0.77)."""
    return launch or (min(next_power_of_2(dv), 64), 4)


def gated_delta_rule_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, states: torch.Tensor, rows: torch.Tensor,
                                 out: torch.Tensor | None = None,
                                 launch: tuple[int, int] | None = None) -> torch.Tensor:
    assert states.is_contiguous() and states.dtype in STATE_DTYPES
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and g.stride(-1) == beta.stride(-1) == 1
    batch, num_heads, dv = v.shape
    dk = q.shape[-1]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    assert out.shape == v.shape and out.stride(-1) == 1
    if batch == 0:
        return out
    block_v, num_warps = step_launch(dv, launch)
    grid = (batch, num_heads, cdiv(dv, block_v))
    _gated_delta_rule_step_kernel[grid](q, k, v, g, beta, states, rows, out, q.stride(0), q.stride(1), k.stride(0),
                                        k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
                                        out.stride(0), out.stride(1), num_heads, num_heads // q.shape[1],
                                        dk ** -0.5, DK=dk, DV=dv, BLOCK_K=next_power_of_2(dk), BLOCK_V=block_v,
                                        num_warps=num_warps)
    return out



def gated_delta_rule_runs_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              states: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                              update: bool) -> torch.Tensor:
    """A run of tokens for each of N requests (a verify step's decode tokens, or the ones each kept):
    q, k [T, Hk, dk], v [T, Hv, dv], g and beta [T, Hv]; request i's run is tokens [starts[i],
    starts[i] + lengths[i]) from states[rows[i]] ([S, Hv, dk, dv], fp32 or narrower, as the step's).
    Returns o [T, Hv, dv] (zeros at tokens in no run); `update`: each run leaves its final state in the pool (a commit), else the
    pool is only read (a verify: the drafts may yet be rejected). A row of -1 reads and writes nothing."""
    out = torch.zeros_like(v)
    packed = packed_runs(rows, starts, lengths)
    if packed is None:
        return out
    tokens, held, bounds = packed
    out[tokens], final = gated_delta_rule_varlen_ref(q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], bounds,
                                                     states[held].float())
    if update:
        states[held] = final.to(states.dtype)
    return out


@fast_launch
@triton.jit
def _gated_delta_rule_runs_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, rows_ptr, starts_ptr, lengths_ptr,
                                  o_ptr, q_stride, q_head_stride, k_stride, k_head_stride, v_stride, v_head_stride,
                                  g_stride, beta_stride, o_stride, o_head_stride, num_heads, group, scale,
                                  DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                                  UPDATE: tl.constexpr):
    """One (request, value head, block of value dims): the step kernel's update token after token
    over the request's run, its state's columns [DK, BLOCK_V] in registers throughout, stored back
    at the end when UPDATE. States [S, H, DK, DV] contiguous."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < DK, dv < DV
    key_head = head // group
    row = tl.load(rows_ptr + b).to(tl.int64)
    if row < 0:  # padding: no state, and the output's zeros stay
        return
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    s_ptrs = states_ptr + (row * num_heads + head) * DK * DV + dk[:, None] * DV + dv[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    for j in range(0, length):
        s = _delta_rule_token(s, start + j, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, q_stride, q_head_stride,
                              k_stride, k_head_stride, v_stride, v_head_stride, g_stride, beta_stride, o_stride,
                              o_head_stride, head, key_head, scale, dk, dv, k_mask, v_mask)
    if UPDATE:
        tl.store(s_ptrs, s.to(states_ptr.dtype.element_ty), mask=mask)


def gated_delta_rule_runs_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                                 lengths: torch.Tensor, update: bool) -> torch.Tensor:
    """A program per (request, value head, 32 value dims), looping over the run: no host read."""
    assert states.is_contiguous() and states.dtype in STATE_DTYPES
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and g.stride(-1) == beta.stride(-1) == 1
    num_heads, dv = v.shape[1:]
    dk = q.shape[-1]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if rows.shape[0] == 0:
        return out
    block_v, num_warps = step_launch(dv)  # as the step kernel's: the state tile stays in registers
    grid = (rows.shape[0], num_heads, cdiv(dv, block_v))
    _gated_delta_rule_runs_kernel[grid](q, k, v, g, beta, states, rows, starts, lengths, out, q.stride(0), q.stride(1),
                                        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
                                        beta.stride(0), out.stride(0), out.stride(1), num_heads,
                                        num_heads // q.shape[1], dk ** -0.5, DK=dk, DV=dv,
                                        BLOCK_K=next_power_of_2(dk), BLOCK_V=block_v, UPDATE=update,
                                        num_warps=num_warps)
    return out

# ---- the chunked form on CUDA: flash-linear-attention's chunk_gated_delta_rule over the step's tokens ----

def l2norm_heads_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (a strided view allowed): each head's row L2-normalised in fp32, in x's dtype."""
    return l2norm(x.float()).to(x.dtype)


@fast_launch
@triton.jit
def _l2norm_heads_kernel(x_ptr, y_ptr, heads, dim, x_stride, x_head_stride, y_stride, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """One token, all its heads: one read, one write (the torch form is seven passes in fp32)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < dim)
    x = tl.load(x_ptr + t * x_stride + h[:, None] * x_head_stride + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    tl.store(y_ptr + t * y_stride + h[:, None] * dim + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def l2norm_heads_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.stride(-1) == 1
    tokens, heads, dim = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens:
        block_h, block_d = next_power_of_2(heads), next_power_of_2(dim)
        _l2norm_heads_kernel[(tokens,)](x, y, heads, dim, x.stride(0), x.stride(1), y.stride(0), BLOCK_H=block_h,
                                        BLOCK_D=block_d, num_warps=min(max(block_h * block_d // 512, 1), 16))
    return y


def _fla_chunk_gated_delta_rule():
    """Imported on first use, on CUDA only: the CPU path (and CI) never needs the library."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise ImportError("the hybrid models' prompt chunks on a GPU run flash-linear-attention's chunked delta "
                          "rule: pip install 'fla-core>=0.6,<0.7' (or this package's [cuda] extra)") from exc
    return chunk_gated_delta_rule


def require_fla() -> None:
    """Raise at load, not at the first prompt, where flash-linear-attention is missing."""
    _fla_chunk_gated_delta_rule()


def fla_sequences(cu_seqlens: torch.Tensor, tokens: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's chunks as flash-linear-attention's packed sequences, built on the device: bounds
    [lo, cu_seqlens..., hi, hi] with lo and hi the chunks' first and end token (an empty lead, the
    chunks, an empty tail and an empty last one: the decode tokens before the chunks and a padded
    step's padding tokens after them are in no sequence, so fla's kernels never touch them; as a
    lead sequence the decodes of a burst's step, hundreds of tokens, cost fla their blocks' work and
    a chain of them longer than most chunks') and the fixed-size block index [(sequence, block)]
    of cdiv(tokens, chunk) + the sequences' count rows, the real blocks first, the rest pointing at
    the empty last sequence (whose blocks fla's kernels skip). Fixed sizes and no host read keep a
    padded step's call capturable in a CUDA graph."""
    cu = cu_seqlens.long()
    bounds = torch.cat([cu[:1], cu, cu[-1:], cu[-1:]])
    blocks = (bounds[1:] - bounds[:-1] + chunk - 1) // chunk
    offsets = torch.cat([blocks.new_zeros(1), blocks.cumsum(0)])
    slots = torch.arange(cdiv(tokens, chunk) + blocks.shape[0], device=cu.device)
    seq = torch.searchsorted(offsets, slots, right=True) - 1
    real = slots < offsets[-1]
    seq = torch.where(real, seq, blocks.shape[0] - 1)
    index = torch.where(real, slots - offsets[seq], 0)
    return bounds, torch.stack([seq, index], 1)


class FlaPlan(NamedTuple):
    """What every linear layer of a step derives alike from its chunks' bounds, made once a step
    (about twenty small kernels a layer otherwise): fla's packed sequences (`fla_sequences`), which
    of the step's tokens belong to a chunk ([T, 1, 1] bool) and which chunks hold any ([C] bool)."""
    bounds: torch.Tensor
    index: torch.Tensor
    inside: torch.Tensor
    filled: torch.Tensor


def fla_plan(cu_seqlens: torch.Tensor, tokens: int) -> FlaPlan:
    bounds, index = fla_sequences(cu_seqlens, tokens)
    at = torch.arange(tokens, device=cu_seqlens.device)
    inside = (at >= cu_seqlens[0]) & (at < cu_seqlens[-1])
    filled = cu_seqlens[1:] > cu_seqlens[:-1]  # padding chunks (empty) share one row
    return FlaPlan(bounds, index, inside.view(-1, 1, 1), filled)


STATE_BLOCK = 4096  # elements of a state a program of the two below moves (a qwen3.5-27b state: 192 of them)


def chunk_states_in_ref(states: torch.Tensor, rows: torch.Tensor, fresh: torch.Tensor, filled: torch.Tensor,
                        initial: torch.Tensor) -> None:
    """The initial states of fla's packed sequences ([C + 3, Hv, dk, dv], states' dtype): the lead
    (row 0: the decode tokens), the step's C chunks, the tail and the empty last sequence. A filled
    chunk's is its row of the pool, or zeros where `fresh` (a request's first chunk); the lead's,
    the tail's and the empty one's are zeros; an empty chunk's (a padded step's padding) is left as
    it was: its sequence has no tokens and its final state is dropped, so nothing reads it."""
    initial[0], initial[-2:] = 0, 0
    chunks = initial[1:-2]
    chunks.copy_(torch.where((filled & ~fresh).view(-1, 1, 1, 1), states[rows],
                             torch.where(filled.view(-1, 1, 1, 1), 0, chunks)))


@fast_launch
@triton.jit
def _chunk_states_in_kernel(states_ptr, rows_ptr, fresh_ptr, filled_ptr, initial_ptr, chunks, size,
                            BLOCK: tl.constexpr):
    """One block of one initial state: a padding chunk's is not touched, so that a padded step
    moves the states of its real chunks only."""
    i = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    real = (i >= 1) & (i <= chunks)
    c = tl.minimum(tl.maximum(i - 1, 0), chunks - 1)
    empty = tl.load(filled_ptr + c).to(tl.int32) == 0
    if real & empty:
        return
    keep = (real & (tl.load(fresh_ptr + c).to(tl.int32) == 0)).to(tl.int32)
    row = tl.load(rows_ptr + c).to(tl.int64)
    x = tl.load(states_ptr + row * size + offs, mask=mask & (offs * 0 + keep != 0), other=0.0)
    tl.store(initial_ptr + i.to(tl.int64) * size + offs, x, mask=mask)


def chunk_states_in_triton(states: torch.Tensor, rows: torch.Tensor, fresh: torch.Tensor, filled: torch.Tensor,
                           initial: torch.Tensor) -> None:
    assert states.is_contiguous() and initial.is_contiguous() and initial.dtype == states.dtype
    size = states[0].numel()
    if rows.shape[0] == 0:  # the lead, the tail and the empty sequence only
        initial.zero_()
        return
    _chunk_states_in_kernel[(initial.shape[0], cdiv(size, STATE_BLOCK))](states, rows, fresh.view(torch.uint8),
                                                                         filled.view(torch.uint8), initial,
                                                                         rows.shape[0], size, BLOCK=STATE_BLOCK)


def chunk_states_out_ref(final: torch.Tensor, rows: torch.Tensor, filled: torch.Tensor, states: torch.Tensor) -> None:
    """Each filled chunk's final state (fla's final[1 + i], fp32) back to its row, rounded to the
    pool's dtype; an empty chunk's row is not touched (padding chunks share one)."""
    states[rows[filled]] = final[1:-2][filled].to(states.dtype)


@fast_launch
@triton.jit
def _chunk_states_out_kernel(final_ptr, rows_ptr, filled_ptr, states_ptr, size, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    if tl.load(filled_ptr + c).to(tl.int32) == 0:
        return
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    row = tl.load(rows_ptr + c).to(tl.int64)
    x = tl.load(final_ptr + (c + 1).to(tl.int64) * size + offs, mask=mask)
    tl.store(states_ptr + row * size + offs, x.to(states_ptr.dtype.element_ty), mask=mask)


def chunk_states_out_triton(final: torch.Tensor, rows: torch.Tensor, filled: torch.Tensor,
                            states: torch.Tensor) -> None:
    assert states.is_contiguous() and final.is_contiguous()
    size = states[0].numel()
    _chunk_states_out_kernel[(rows.shape[0], cdiv(size, STATE_BLOCK))](final, rows, filled.view(torch.uint8),
                                                                       states, size, BLOCK=STATE_BLOCK)



def gated_delta_rule_chunks_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, cu_seqlens: torch.Tensor, states: torch.Tensor,
                                rows: torch.Tensor, fresh: torch.Tensor, out: torch.Tensor,
                                chunk_fn=None, plan: FlaPlan | None = None) -> None:
    """`gated_delta_rule_chunks_ref` on CUDA through flash-linear-attention (its value heads sharing
    key heads as ours do; the L2 norms before it): the initial states gathered from the pool (zeros
    where a chunk starts its request), one call over all of the step's tokens, the outputs kept for
    the chunks' rows only, the final states of the non-empty chunks scattered back; all on the
    device, no host read. chunk_fn: a stand-in with chunk_gated_delta_rule's signature (tests);
    plan: `fla_plan(cu_seqlens, T)`, made here if absent (the model makes it once a step)."""
    chunk_fn = chunk_fn or _fla_chunk_gated_delta_rule()
    tokens, dk = v.shape[0], k.shape[-1]
    plan = plan or fla_plan(cu_seqlens, tokens)
    # The lead, the chunks, the tail, the empty sequence: a padded step moves its real chunks' states
    # only (the torch form gathered, selected and scattered all MAX_GRAPH_CHUNKS rows, about 30 ms of a
    # qwen3.5-27b mixed step on an H200). fla reads them into fp32, whatever their dtype.
    initial = states.new_empty((rows.shape[0] + 3, *states.shape[1:]))
    moves_in, moves_out = (chunk_states_in_triton, chunk_states_out_triton) if q.is_cuda else \
        (chunk_states_in_ref, chunk_states_out_ref)
    moves_in(states, rows, fresh, plan.filled, initial)
    # The L2 norms here, not in fla's kernel: its norm kernel autotunes per bucket of 65,536 rows of
    # tokens x key heads, so the first step to reach each bucket (5,339 tokens at qwen3.5-27b's 16 key
    # heads) spent about 10 s benchmarking configurations before it launched (H200 step trace). In fp32,
    # rounded to their dtype, as fla's kernel does.
    norm = l2norm_heads_triton if q.is_cuda else l2norm_heads_ref
    q, k = norm(q), norm(k)
    o, final = chunk_fn(q[None], k[None], v[None], g[None], beta[None], scale=dk ** -0.5, initial_state=initial,
                        output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=plan.bounds,
                        chunk_indices=plan.index)
    torch.where(plan.inside, o[0].to(out.dtype), out, out=out)
    moves_out(final, rows, plan.filled, states)
