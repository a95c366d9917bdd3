"""Gated DeltaNet's short causal convolution: per channel, out_t = silu(sum_j w[j] x_{t-K+1+j}),
with the last K - 1 inputs of a sequence kept as its state, so that a later chunk or decode step
continues where the last one stopped.

- `causal_conv1d_varlen_ref`: a step's prompt chunks, packed, each after its state [C, K-1]
  (zeros at a request's start), all at once; returns the outputs and the new states.
  `causal_conv1d_ref` is the same for one sequence.
- `causal_conv1d_chunks_ref` / `_triton`: the prefill and extend path, the same over all of a
  step's tokens with the chunk bounds on the device and the states in a pool by request row,
  updated in place (a program per chunk and 128 channels, looping over the chunk's tokens).
- `causal_conv1d_step_ref` / `_triton`: one token for each of B requests, their states in a pool
  by row, updated in place.
- `causal_conv1d_runs_ref` / `_triton`: a run of tokens for each of N requests (a verify step's,
  bounds on the device), the pool read only or, for the tokens each request kept, updated (the
  chunks kernel over the runs).

The `_ref` functions are the CPU path and the oracle.
"""
import itertools

import torch
import torch.nn.functional as F

from ._triton import cdiv, fast_launch, next_power_of_2, tl, triton


def causal_conv1d_varlen_ref(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int], states: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """N packed sequences (a step's prompt chunks) at once: x [T, C], sequence i is tokens
    [cu_seqlens[i], cu_seqlens[i+1]) after its state states[i] ([N, C, K-1]). Returns
    (silu(conv) [T, C], the new states [N, C, K-1]: each sequence's last K - 1 inputs).
    Each sequence is laid out after its own state, [state 0 | x 0 | state 1 | x 1 | ...]: one
    convolution over that line gives every token its own window, and nothing is padded."""
    channels, width = weight.shape
    n, tail = len(cu_seqlens) - 1, width - 1
    token_rows = torch.tensor([t + tail * (i + 1) for i, (a, b) in enumerate(zip(cu_seqlens, cu_seqlens[1:]))
                               for t in range(a - cu_seqlens[0], b - cu_seqlens[0])], device=x.device)
    ends = torch.tensor([b - cu_seqlens[0] + tail * (i + 1) for i, b in enumerate(cu_seqlens[1:])], device=x.device)
    state_rows = ends[:, None] - torch.arange(tail, 0, -1, device=x.device)  # [N, K-1]: each one's last inputs
    line = x.new_empty(x.shape[0] + n * tail, channels)
    starts = (ends - torch.tensor([b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])], device=x.device))[:, None]
    line[starts - torch.arange(tail, 0, -1, device=x.device)] = states.transpose(1, 2).to(x.dtype)
    line[token_rows] = x
    conv = F.conv1d(line.T[None].to(weight.dtype), weight[:, None, :], groups=channels)[0]  # [C, rows - K + 1]
    out = F.silu(conv.T[token_rows - tail]).to(x.dtype)
    return out, line[state_rows].transpose(1, 2).contiguous()


def causal_conv1d_chunks_ref(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, states: torch.Tensor,
                             rows: torch.Tensor, fresh: torch.Tensor, out: torch.Tensor, plan=None) -> None:
    """A step's prompt chunks with their states in a pool: x [T, C] all of the step's tokens, chunk
    i is tokens [cu_seqlens[i], cu_seqlens[i+1]) ([N+1] on the device) after states[rows[i]] ([S, C,
    K-1]), or after zeros where fresh[i], and leaves its last K - 1 inputs there. Writes out's rows
    of the chunks only (the decodes' rows before them keep theirs). Empty chunks (a padded step's
    padding) read and write no state. `plan`: the CUDA path's per-step `fla_plan` (its blocks of
    tokens), not needed here."""
    bounds = cu_seqlens.tolist()
    lo, hi = bounds[0], bounds[-1]
    initial = torch.where(fresh.view(-1, 1, 1), 0, states[rows])
    out[lo:hi], new = causal_conv1d_varlen_ref(x[lo:hi], weight, [b - lo for b in bounds], initial)
    filled = cu_seqlens[1:] > cu_seqlens[:-1]
    states[rows[filled]] = new[filled].to(states.dtype)


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, C], weight [C, K], state [C, K-1] or None (zeros). Returns (silu(conv)
    [T, C], state [C, K-1])."""
    if state is None:
        state = x.new_zeros(weight.shape[0], weight.shape[1] - 1)
    out, states = causal_conv1d_varlen_ref(x, weight, [0, x.shape[0]], state[None])
    return out, states[0]


def causal_conv1d_step_ref(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                           rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C], weight [C, K], states [S, C, K-1] updated in place at rows [B]. Returns [B, C]
    (written into `out` if given).
    A row of -1 (a padded step's padding) reads and writes no state; its output is zeros."""
    live = rows >= 0
    seq = torch.cat([states[rows.clamp(min=0)].to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    states[rows[live]] = seq[live, :, 1:].to(states.dtype)
    y = torch.where(live[:, None], F.silu((seq.to(weight.dtype) * weight).sum(-1)), 0).to(x.dtype)
    return y if out is None else out.copy_(y)


@fast_launch
@triton.jit
def _causal_conv1d_step_kernel(x_ptr, weight_ptr, states_ptr, rows_ptr, out_ptr, channels, x_stride, out_stride,
                               WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """One (request, block of channels): the window [state | x] times the weights, then the
    state shifted by one. States [S, C, WIDTH - 1] and weight [C, WIDTH] contiguous."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)[None, :]
    c_mask = (c < channels)[:, None]
    row = tl.load(rows_ptr + b).to(tl.int64)
    if row < 0:  # padding: no state, zeros out
        tl.store(out_ptr + b * out_stride + c, tl.zeros([BLOCK_C], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=c < channels)
        return
    state = states_ptr + row * channels * (WIDTH - 1) + c[:, None] * (WIDTH - 1)
    x = tl.load(x_ptr + b * x_stride + c, mask=c < channels, other=0.0)[:, None]
    window = tl.load(state + j, mask=c_mask & (j < WIDTH - 1), other=0.0)
    window = tl.where(j == WIDTH - 1, x, window)
    shifted = tl.load(state + j + 1, mask=c_mask & (j < WIDTH - 2), other=0.0)  # read before any store
    shifted = tl.where(j == WIDTH - 2, x, shifted)
    weight = tl.load(weight_ptr + c[:, None] * WIDTH + j, mask=c_mask & (j < WIDTH), other=0.0).to(tl.float32)
    acc = tl.sum(window.to(tl.float32) * weight, axis=1)
    tl.store(state + j, shifted.to(states_ptr.dtype.element_ty), mask=c_mask & (j < WIDTH - 1))
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * out_stride + c, out.to(out_ptr.dtype.element_ty), mask=c < channels)


def causal_conv1d_step_triton(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                              rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    assert states.is_contiguous() and weight.is_contiguous() and x.stride(-1) == 1
    batch, channels = x.shape
    width = weight.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == x.shape and out.stride(-1) == 1
    if batch == 0:
        return out
    block_c = min(next_power_of_2(channels), 256)
    _causal_conv1d_step_kernel[(batch, cdiv(channels, block_c))](
        x, weight, states, rows, out, channels, x.stride(0), out.stride(0), WIDTH=width, BLOCK_C=block_c,
        BLOCK_W=next_power_of_2(width))
    return out


@triton.jit
def _conv_block(x_ptr, weight_ptr, state, keep, out_ptr, x_stride, out_stride, lo, hi, start, c, c_mask,
                WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tokens [start, start + BLOCK_T) of a chunk [lo, hi) on channels c: each input before lo read
    from the chunk's old state (`state`: its channels' entries; zeros where not `keep`), silu(conv)
    stored to out."""
    t = start + tl.arange(0, BLOCK_T)
    mask = (t < hi)[:, None] & c_mask[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        src = t - (WIDTH - 1) + j  # the input this weight meets: the chunk's, or its state's (src < lo)
        from_x = (src >= lo)[:, None]
        xs = tl.load(x_ptr + src[:, None].to(tl.int64) * x_stride + c[None, :], mask=mask & from_x, other=0.0)
        held = tl.load(state[None, :] + (src - lo + WIDTH - 1)[:, None], mask=mask & ~from_x & keep[None, :],
                       other=0.0)
        w = tl.load(weight_ptr + c * WIDTH + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += (xs.to(tl.float32) + held.to(tl.float32)) * w[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None].to(tl.int64) * out_stride + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@fast_launch
@triton.jit
def _causal_conv1d_blocks_kernel(x_ptr, weight_ptr, bounds_ptr, index_ptr, states_ptr, rows_ptr, fresh_ptr, out_ptr,
                                 chunks, channels, x_stride, out_stride, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                                 BLOCK_C: tl.constexpr):
    """One (block of BLOCK_T tokens of one chunk, block of channels), from fla's packed sequences
    (`fla_plan`: sequence 0 the decode tokens, 1..chunks the chunks, then the tail and an empty one,
    whose blocks return at once): the conv's outputs only; the states move in a second launch,
    after every block has read them."""
    seq = tl.load(index_ptr + 2 * tl.program_id(0))
    if (seq < 1) | (seq > chunks):
        return
    lo = tl.load(bounds_ptr + seq)
    hi = tl.load(bounds_ptr + seq + 1)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < channels
    row = tl.load(rows_ptr + seq - 1).to(tl.int64)
    keep = tl.load(fresh_ptr + seq - 1 + c * 0) == 0
    state = states_ptr + row * channels * (WIDTH - 1) + c * (WIDTH - 1)
    start = lo + tl.load(index_ptr + 2 * tl.program_id(0) + 1) * BLOCK_T
    _conv_block(x_ptr, weight_ptr, state, keep, out_ptr, x_stride, out_stride, lo, hi, start, c, c_mask, WIDTH,
                BLOCK_T, BLOCK_C)


@fast_launch
@triton.jit
def _causal_conv1d_chunks_kernel(x_ptr, weight_ptr, lo_ptr, hi_ptr, states_ptr, rows_ptr, fresh_ptr, out_ptr,
                                 channels, x_stride, out_stride, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                                 BLOCK_C: tl.constexpr, UPDATE: tl.constexpr, CONV: tl.constexpr):
    """One (chunk, block of channels): (CONV) its tokens [lo, hi) in blocks of BLOCK_T, each input
    before the chunk's start read from its state (zeros when fresh), then (UPDATE) its last WIDTH - 1
    inputs as the new state. States [S, C, WIDTH - 1] and weight [C, WIDTH] contiguous."""
    seq = tl.program_id(0)
    lo = tl.load(lo_ptr + seq)
    hi = tl.load(hi_ptr + seq)
    if hi <= lo:  # a padding chunk: no state
        return
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < channels
    row = tl.load(rows_ptr + seq).to(tl.int64)
    # the state is read only for a chunk that continues its request (a vector: the interpreter masks with arrays)
    keep = tl.load(fresh_ptr + seq + c * 0) == 0
    state = states_ptr + row * channels * (WIDTH - 1) + c * (WIDTH - 1)
    if CONV:
        for start in range(lo, hi, BLOCK_T):
            _conv_block(x_ptr, weight_ptr, state, keep, out_ptr, x_stride, out_stride, lo, hi, start, c, c_mask,
                        WIDTH, BLOCK_T, BLOCK_C)
    if not UPDATE:
        return
    tl.debug_barrier()  # every read of the old state above comes before the new state's stores
    for j in tl.static_range(WIDTH - 1):
        # new state j is input hi - (WIDTH - 1) + j: the chunk's, or (a chunk shorter than the state)
        # the old state's entry hi - lo + j, past every entry stored before it
        src = hi - (WIDTH - 1) + j + c * 0
        xs = tl.load(x_ptr + src.to(tl.int64) * x_stride + c, mask=c_mask & (src >= lo), other=0.0)
        held = tl.load(state + (src - lo + WIDTH - 1), mask=c_mask & (src < lo) & keep, other=0.0)
        tl.store(state + j, (xs.to(tl.float32) + held.to(tl.float32)).to(states_ptr.dtype.element_ty), mask=c_mask)


def causal_conv1d_chunks_triton(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, states: torch.Tensor,
                                rows: torch.Tensor, fresh: torch.Tensor, out: torch.Tensor, plan=None) -> None:
    """Two launches, no host read, grids fixed by the step's token and chunk counts: the conv, a
    program per (block of 64 tokens of a chunk, 128 channels) over `plan`'s blocks (fla_plan's,
    made here if absent; the model makes it once a step), so a long chunk's tokens spread over the
    device rather than queue in one program each; then the new states, a program per (chunk, 128
    channels). A padding chunk's programs return at once."""
    assert states.is_contiguous() and weight.is_contiguous() and x.stride(-1) == out.stride(-1) == 1
    from .gated_delta_rule import CHUNK, fla_plan  # its packed sequences' blocks: CHUNK tokens each

    plan = plan or fla_plan(cu_seqlens, x.shape[0])
    channels, width = weight.shape
    block_c = min(next_power_of_2(channels), 128)
    fresh = fresh.view(torch.uint8)
    _causal_conv1d_blocks_kernel[(plan.index.shape[0], cdiv(channels, block_c))](
        x, weight, plan.bounds, plan.index, states, rows, fresh, out, rows.shape[0], channels, x.stride(0),
        out.stride(0), WIDTH=width, BLOCK_T=CHUNK, BLOCK_C=block_c)
    _causal_conv1d_chunks_kernel[(rows.shape[0], cdiv(channels, block_c))](
        x, weight, cu_seqlens, cu_seqlens[1:], states, rows, fresh, out, channels, x.stride(0), out.stride(0),
        WIDTH=width, BLOCK_T=CHUNK, BLOCK_C=block_c, UPDATE=True, CONV=False)


def packed_runs(rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """The runs' references' host view of N requests' runs (request i's: tokens [starts[i],
    starts[i] + lengths[i]) on row rows[i]): (their tokens in order, the rows of the runs with any,
    their packed bounds), leaving out rows of -1 and empty runs; None where no run is left."""
    runs = [(i, a, n) for i, (r, a, n) in enumerate(zip(rows.tolist(), starts.tolist(), lengths.tolist()))
            if r >= 0 and n > 0]
    if not runs:
        return None
    tokens = torch.tensor([a + j for _, a, n in runs for j in range(n)], device=rows.device)
    held = rows[torch.tensor([i for i, _, _ in runs], device=rows.device)]
    return tokens, held, [0, *itertools.accumulate(n for _, _, n in runs)]


def causal_conv1d_runs_ref(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, rows: torch.Tensor,
                           starts: torch.Tensor, lengths: torch.Tensor, update: bool) -> torch.Tensor:
    """A run of tokens for each of N requests (a verify step's decode tokens, or the ones each kept):
    x [T, C], request i's run is tokens [starts[i], starts[i] + lengths[i]) after its state
    states[rows[i]] ([S, C, K-1]). Returns out [T, C] (zeros at tokens in no run); `update`: each run
    leaves its last K - 1 inputs as its state (a commit), else the pool is only read (a verify: the
    drafts may yet be rejected). A row of -1 reads and writes nothing."""
    out = torch.zeros_like(x)
    packed = packed_runs(rows, starts, lengths)
    if packed is None:
        return out
    tokens, held, bounds = packed
    out[tokens], new = causal_conv1d_varlen_ref(x[tokens], weight, bounds, states[held])
    if update:
        states[held] = new.to(states.dtype)
    return out


def causal_conv1d_runs_triton(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, rows: torch.Tensor,
                              starts: torch.Tensor, lengths: torch.Tensor, update: bool) -> torch.Tensor:
    """The chunks kernel over [starts, starts + lengths), every state read: no host read."""
    assert states.is_contiguous() and weight.is_contiguous() and x.stride(-1) == 1
    channels, width = weight.shape
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    ends = starts + torch.where(rows >= 0, lengths, 0)  # a row of -1 runs no token
    block_c = min(next_power_of_2(channels), 128)
    _causal_conv1d_chunks_kernel[(rows.shape[0], cdiv(channels, block_c))](
        x, weight, starts, ends, states, rows, torch.zeros_like(rows, dtype=torch.uint8), out, channels, x.stride(0),
        out.stride(0), WIDTH=width, BLOCK_T=16, BLOCK_C=block_c, UPDATE=update, CONV=True)
    return out
